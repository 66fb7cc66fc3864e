//! One model on whichever device runs it: [`Engine`] holds a
//! [`Model`] on the CPU or on a GPU and forwards to it, so callers (the
//! CLI, the demo) are written once. [`Placement::Auto`] takes the GPU when
//! there is a driver and a device, and says why when it falls back.

use std::path::Path;

use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::device::cpu::CpuDevice;
use crate::device::cuda::CudaDevice;
use crate::device::cuda::experts::{ExpertPath, TierStats};
use crate::error::EngineError;
use crate::experts::ExpertStats;
use crate::load::{GpuOptions, LoadOptions, cpu_experts, cuda_experts};
use crate::model::{Generation, Model};

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
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Cpu(m) => m.fmt(f),
            Self::Cuda(m) => m.fmt(f),
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
    // The checkpoint first: it refuses a FIFO or device as config.json.
    let ckpt = Checkpoint::open(model)?;
    let cfg = ModelConfig::from_file(&model.join("config.json"))?;
    let (dev, fallback) = match placement {
        Placement::Cpu => (None, None),
        Placement::Cuda(n) => (Some(CudaDevice::open(n)?), None),
        Placement::Auto => match CudaDevice::open(0) {
            Ok(d) => (Some(d), None),
            Err(e) => (None, Some(e.to_string())),
        },
    };
    match dev {
        Some(dev) => {
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

impl Engine {
    /// The model's config.
    pub fn config(&self) -> &ModelConfig {
        match self {
            Self::Cpu(m) => m.config(),
            Self::Cuda(m) => m.config(),
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
        }
    }

    /// Forget the sequence (the expert tiers stay warm).
    pub fn reset(&mut self) -> Result<(), EngineError> {
        match self {
            Self::Cpu(m) => m.reset(),
            Self::Cuda(m) => m.reset(),
        }
    }

    /// Expert counters so far.
    pub fn expert_stats(&self) -> ExpertStats {
        match self {
            Self::Cpu(m) => m.expert_stats(),
            Self::Cuda(m) => m.expert_stats(),
        }
    }

    /// The GPU's per-tier counters and expert path, on a GPU.
    pub fn gpu_tiers(&self) -> Option<(TierStats, ExpertPath, bool)> {
        match self {
            Self::Cpu(_) => None,
            Self::Cuda(m) => {
                let e = m.experts();
                Some((e.tier_stats(), e.path(), e.resident_all()))
            }
        }
    }
}
