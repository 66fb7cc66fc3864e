//! One model on whichever device runs it: [`Engine`] holds a
//! [`Model`] on the CPU or on a GPU and forwards to it, so callers (the
//! CLI, the demo) are written once. [`Placement::Auto`] takes the GPU when
//! there is a driver and a device, and says why when it falls back.
//!
//! Qwen4-Exp (`qwen4_exp`, `qwen4_exp_text`) runs on its own decoder,
//! [`Qwen4Model`], over the hybrid device operations
//! ([`crate::device::hybrid`]) on the CPU or a GPU ([`Qwen4Engine`]); `auto`
//! takes the GPU as for the other families. It has no KV tier (its sparse
//! layers keep their own cache): a KV budget is refused for it.

use std::path::Path;

use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::config::qwen4::Qwen4Config;
use crate::device::cpu::CpuDevice;
use crate::device::cuda::CudaDevice;
use crate::device::cuda::experts::{ExpertPath, TierStats};
use crate::error::EngineError;
use crate::experts::ExpertStats;
use crate::family::qwen4::{PleRowOptions, PleRowStats};
use crate::load::{GpuOptions, LoadOptions, cpu_experts, cuda_experts};
use crate::model::{Generation, Model};

mod batch;
mod qwen4;
pub use batch::{EngineStep, SeqKv};
pub use qwen4::Qwen4Engine;

/// Where a model runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Placement {
    /// The CPU engine.
    Cpu,
    /// GPU `ordinal`.
    Cuda(usize),
    /// GPU 0 when a driver and a device are there, else the CPU.
    #[default]
    Auto,
}

impl std::str::FromStr for Placement {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(Self::Cpu),
            "cuda" | "gpu" => Ok(Self::Cuda(0)),
            "auto" => Ok(Self::Auto),
            other => match other.strip_prefix("cuda:") {
                Some(n) => n
                    .parse()
                    .map(Self::Cuda)
                    .map_err(|_| format!("`{other}`: not a GPU ordinal")),
                None => Err(format!(
                    "unknown device `{other}` (cpu | cuda | cuda:N | auto)"
                )),
            },
        }
    }
}

/// A model on its device (boxed: the two models differ in size).
pub enum Engine {
    /// On the CPU.
    Cpu(Box<Model<CpuDevice>>),
    /// On a GPU.
    Cuda(Box<Model<CudaDevice>>),
    /// Qwen4-Exp, on the CPU or a GPU.
    Qwen4(Box<Qwen4Engine>),
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Cpu(m) => m.fmt(f),
            Self::Cuda(m) => m.fmt(f),
            Self::Qwen4(m) => m.fmt(f),
        }
    }
}

/// What [`open`] chose and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chosen {
    /// `cpu` or `cuda`.
    pub device: &'static str,
    /// The GPU's name, on a GPU.
    pub gpu_name: Option<String>,
    /// Why `auto` stayed on the CPU.
    pub fallback: Option<String>,
}

/// Open the model in `model` with experts from the store at `store`, on
/// the device `placement` names.
pub fn open(
    model: &Path,
    store: &Path,
    opts: &LoadOptions,
    placement: Placement,
    gpu: &GpuOptions,
) -> Result<(Engine, Chosen), EngineError> {
    open_with_rows(model, store, opts, placement, gpu, None)
}

/// [`open`], with Qwen4-Exp's PLE rows from the row store under `rows`
/// (`None`: from the checkpoint). A model without row tables refuses
/// `rows`.
pub fn open_with_rows(
    model: &Path,
    store: &Path,
    opts: &LoadOptions,
    placement: Placement,
    gpu: &GpuOptions,
    rows: Option<&PleRowOptions>,
) -> Result<(Engine, Chosen), EngineError> {
    // The checkpoint first: it refuses a FIFO or device as config.json.
    let ckpt = Checkpoint::open(model)?;
    open_checkpoint(ckpt, store, opts, placement, gpu, rows)
}

/// [`open_with_rows`] on a checkpoint already opened (a caller that read
/// its config or sized its weights first opens it once).
pub fn open_checkpoint(
    ckpt: Checkpoint,
    store: &Path,
    opts: &LoadOptions,
    placement: Placement,
    gpu: &GpuOptions,
    rows: Option<&PleRowOptions>,
) -> Result<(Engine, Chosen), EngineError> {
    if Qwen4Config::is_qwen4(ckpt.source().config()) {
        if gpu.kv.is_some() {
            return Err(EngineError::config(
                "model_type",
                "Qwen4-Exp keeps its sparse layers' keys in its own cache: a KV budget does not \
                 apply to it",
            ));
        }
        return open_qwen4(ckpt, store, opts, placement, gpu, rows);
    }
    if rows.is_some() {
        return Err(EngineError::config(
            "model_type",
            "this model has no row tables for the row store (Qwen4-Exp's PLE tables have)",
        ));
    }
    let cfg = ModelConfig::from_json(ckpt.source().config())?;
    let (dev, fallback) = gpu_for(placement)?;
    match dev {
        Some(dev) => {
            dev.set_kv_budget(gpu.kv.clone());
            let name = dev.gpu().info().name.clone();
            crate::load::check_fits(&dev, &ckpt, store, gpu)?;
            let experts = cuda_experts(&dev, &cfg, &ckpt, store, opts, gpu)?;
            let m = Model::new(dev, &cfg, &ckpt, experts)?;
            let chosen = Chosen {
                device: "cuda",
                gpu_name: Some(name),
                fallback: None,
            };
            Ok((Engine::Cuda(Box::new(m)), chosen))
        }
        None => {
            if gpu.kv.is_some() {
                return Err(EngineError::KvBudgetNeedsGpu { why: fallback });
            }
            crate::device::cpu::isa::Isa::configured()?;
            let experts = cpu_experts(&cfg, &ckpt, store, opts)?;
            let m = Model::new(CpuDevice, &cfg, &ckpt, experts)?;
            let chosen = Chosen {
                device: "cpu",
                gpu_name: None,
                fallback,
            };
            Ok((Engine::Cpu(Box::new(m)), chosen))
        }
    }
}

/// The GPU `placement` names (`auto`: GPU 0 when there is one), or why
/// `auto` stays on the CPU.
fn gpu_for(placement: Placement) -> Result<(Option<CudaDevice>, Option<String>), EngineError> {
    Ok(match placement {
        Placement::Cpu => (None, None),
        Placement::Cuda(n) => (Some(CudaDevice::open(n)?), None),
        Placement::Auto => match CudaDevice::open(0) {
            Ok(d) => (Some(d), None),
            Err(e) => (None, Some(e.to_string())),
        },
    })
}

/// Qwen4-Exp on the device `placement` names (`auto`: the GPU when there
/// is one, else the CPU, saying why).
fn open_qwen4(
    ckpt: Checkpoint,
    store: &Path,
    opts: &LoadOptions,
    placement: Placement,
    gpu: &GpuOptions,
    rows: Option<&PleRowOptions>,
) -> Result<(Engine, Chosen), EngineError> {
    let (dev, fallback) = gpu_for(placement)?;
    let Some(dev) = dev else {
        crate::device::cpu::isa::Isa::configured()?;
        let m = crate::family::qwen4::Qwen4Model::from_checkpoint(ckpt, store, opts, rows)?;
        let chosen = Chosen {
            device: "cpu",
            gpu_name: None,
            fallback,
        };
        return Ok((Engine::Qwen4(Box::new(Qwen4Engine::Cpu(m))), chosen));
    };
    let cfg = Qwen4Config::from_json(ckpt.source().config())?;
    let scope = cfg.field_scope();
    let name = dev.gpu().info().name.clone();
    crate::load::check_fits(&dev, &ckpt, store, gpu)?;
    let experts = cuda_experts(&dev, &cfg.expert_view(), &ckpt, store, opts, gpu)?;
    let m = crate::family::qwen4::Qwen4Model::with_experts(dev, ckpt, cfg, experts, rows)
        .map_err(|e| crate::config::qwen4::in_scope(e, scope))?;
    let chosen = Chosen {
        device: "cuda",
        gpu_name: Some(name),
        fallback: None,
    };
    Ok((Engine::Qwen4(Box::new(Qwen4Engine::Cuda(m))), chosen))
}

impl Engine {
    /// The model's config (`None` for Qwen4-Exp, whose config is its own:
    /// [`Qwen4Engine::config`]).
    pub fn config(&self) -> Option<&ModelConfig> {
        match self {
            Self::Cpu(m) => Some(m.config()),
            Self::Cuda(m) => Some(m.config()),
            Self::Qwen4(_) => None,
        }
    }

    /// The GPU model, when this engine runs on a GPU (for callers that
    /// need its device-specific counters, e.g. `bench decode`).
    pub fn into_cuda(self) -> Option<Model<CudaDevice>> {
        match self {
            Self::Cuda(m) => Some(*m),
            Self::Cpu(_) | Self::Qwen4(_) => None,
        }
    }

    /// The model's end-of-sequence tokens.
    pub fn eos_token_ids(&self) -> &[u32] {
        match self {
            Self::Cpu(m) => &m.config().eos_token_ids,
            Self::Cuda(m) => &m.config().eos_token_ids,
            Self::Qwen4(m) => &m.config().eos_token_ids,
        }
    }

    /// Greedy decoding (see [`Model::generate`]). The CPU engine's steps
    /// run on a thread of rayon's pool, so each product's caller takes the
    /// first of its tasks itself instead of waking a worker and waiting
    /// (about 2-4 points less idle CPU in a 512-token prefill on 2 cores);
    /// hence `on_token` is `Send`.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        max_new: usize,
        stop_ids: &[u32],
        keep_prompt_logits: bool,
        on_token: impl FnMut(u32) + Send,
    ) -> Result<Generation, EngineError> {
        match self {
            Self::Cpu(m) => rayon::scope(|_| {
                m.generate(prompt, max_new, stop_ids, keep_prompt_logits, on_token)
            }),
            Self::Cuda(m) => m.generate(prompt, max_new, stop_ids, keep_prompt_logits, on_token),
            Self::Qwen4(m) => m.generate(prompt, max_new, stop_ids, keep_prompt_logits, on_token),
        }
    }

    /// Forget the sequence (the expert tiers stay warm).
    pub fn reset(&mut self) -> Result<(), EngineError> {
        match self {
            Self::Cpu(m) => m.reset(),
            Self::Cuda(m) => m.reset(),
            Self::Qwen4(m) => m.reset(),
        }
    }

    /// Expert counters so far.
    pub fn expert_stats(&self) -> ExpertStats {
        match self {
            Self::Cpu(m) => m.expert_stats(),
            Self::Cuda(m) => m.expert_stats(),
            Self::Qwen4(m) => m.expert_stats(),
        }
    }

    /// Row-store counters so far, for a model whose rows come from a row
    /// store (Qwen4-Exp's PLE tables packed as shards); `None` otherwise.
    pub fn row_stats(&self) -> Option<PleRowStats> {
        match self {
            Self::Cpu(_) | Self::Cuda(_) => None,
            Self::Qwen4(m) => m.row_stats(),
        }
    }

    /// The GPU's per-tier counters and expert path, on a GPU.
    pub fn gpu_tiers(&self) -> Option<(TierStats, ExpertPath, bool)> {
        match self {
            Self::Cpu(_) | Self::Qwen4(_) => None,
            Self::Cuda(m) => {
                let e = m.experts();
                Some((e.tier_stats(), e.path(), e.resident_all()))
            }
        }
    }
}
