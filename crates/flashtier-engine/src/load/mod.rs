//! Putting a model together: the checkpoint's resident weights on a
//! device, and the experts from a packed store through the expert pool.
//! (Packing a store, or finding the one packed before in a store cache, is
//! `flashtier-pack`'s: this crate opens stores, it does not write them.)

pub(crate) mod weights;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use flashtier::experts::{Backing, StoreSet};
use flashtier_format::Store;
use flashtier_io::{PosixBackend, StorageBackend};

use crate::checkpoint::Checkpoint;
use crate::checkpoint::files::CheckpointFiles;
use crate::config::ModelConfig;
use crate::config::qwen4::Qwen4Config;
use crate::device::cpu::CpuDevice;
use crate::device::cpu::experts::PoolExperts;
use crate::device::cuda::CudaDevice;
use crate::device::cuda::experts::{CudaExperts, TierBudgets};
use crate::device::cuda::kv::KvBudget;
use crate::error::EngineError;
use crate::experts::{StreamOptions, open_pool};
use crate::model::Model;
use crate::store::check_pairing;

/// How [`load_cpu`] builds a model.
#[derive(Clone)]
pub struct LoadOptions {
    /// The expert store file, which must pair with the checkpoint.
    pub store: PathBuf,
    /// Budget for resident expert records in bytes (`None`: all of them).
    pub budget_bytes: Option<u64>,
    /// Pool backing.
    pub backing: Backing,
    /// Expert reads in flight at most (reader threads of the default backend).
    pub queue_depth: usize,
    /// The backend expert reads go through (`None`: posix, `queue_depth` readers).
    pub backend: Option<Arc<dyn StorageBackend>>,
}

impl std::fmt::Debug for LoadOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadOptions")
            .field("store", &self.store)
            .field("budget_bytes", &self.budget_bytes)
            .field("backing", &self.backing)
            .field("queue_depth", &self.queue_depth)
            .finish_non_exhaustive()
    }
}

impl LoadOptions {
    /// Experts from the store file `store`, all resident, slots backing.
    pub fn store(store: &Path) -> Self {
        Self {
            store: store.to_path_buf(),
            budget_bytes: None,
            backing: Backing::Slots,
            queue_depth: 8,
            backend: None,
        }
    }

    /// The backend expert reads go through: `backend`, or posix with
    /// `queue_depth` readers.
    fn reader(&self) -> Result<Arc<dyn StorageBackend>, EngineError> {
        Ok(match &self.backend {
            Some(b) => b.clone(),
            None => Arc::new(PosixBackend::new(self.queue_depth.max(1))?),
        })
    }

    /// The same with a budget of `bytes` for resident experts.
    #[must_use]
    pub fn budget(mut self, bytes: u64) -> Self {
        self.budget_bytes = Some(bytes);
        self
    }
}

/// The CPU expert tier for `model`'s store under `opts`.
pub fn cpu_experts(
    cfg: &ModelConfig,
    ckpt: &Checkpoint,
    store: &Path,
    opts: &LoadOptions,
) -> Result<PoolExperts, EngineError> {
    crate::config::bounds::check(cfg, ckpt)?;
    pool_experts(cfg, ckpt.source(), store, opts)
}

/// The CPU expert tier over `store` for the experts `view` lays out
/// (Qwen4-Exp's [`Qwen4Config::expert_view`], or the model's own config),
/// after checking that `store` was packed from `ckpt`; the budget is
/// `opts.budget_bytes`, or every record.
pub(crate) fn pool_experts(
    view: &ModelConfig,
    ckpt: &CheckpointFiles,
    store: &Path,
    opts: &LoadOptions,
) -> Result<PoolExperts, EngineError> {
    let opened = Store::open(store)?;
    check_pairing(&opened, ckpt)?;
    let budget = opts
        .budget_bytes
        .unwrap_or(opened.stride_bytes() * opened.record_count());
    let stream = StreamOptions {
        backing: opts.backing,
        budget_bytes: budget,
        queue_depth: opts.queue_depth,
    };
    let (pool, layout) = open_pool(store, view, stream, opts.reader()?)?;
    let mut experts = PoolExperts::new(pool, layout);
    let loaded = experts.load_all()?;
    if loaded > 0 {
        tracing::info!(records = loaded, "every expert record loaded up front");
    }
    Ok(experts)
}

/// Load the model in `model` on the CPU with experts from `opts.store`.
pub fn load_cpu(model: &Path, opts: &LoadOptions) -> Result<Model<CpuDevice>, EngineError> {
    // The checkpoint first: it refuses a FIFO or device as config.json.
    let ckpt = Checkpoint::open(model)?;
    let cfg = ModelConfig::from_file(&model.join("config.json"))?;
    let store = opts.store.clone();
    let experts = cpu_experts(&cfg, &ckpt, &store, opts)?;
    Model::new(CpuDevice, &cfg, &ckpt, experts)
}

/// How [`load_cuda`] places a model on a GPU.
#[derive(Clone, Debug)]
pub struct GpuOptions {
    /// Device ordinal.
    pub ordinal: usize,
    /// The expert tiers' budgets.
    pub budgets: TierBudgets,
    /// The KV cache's HBM budget and store (`None`: every position in
    /// HBM; see [`crate::device::cuda::kv`]).
    pub kv: Option<KvBudget>,
}

impl Default for GpuOptions {
    fn default() -> Self {
        Self {
            ordinal: 0,
            budgets: TierBudgets {
                hbm_bytes: None,
                ram_bytes: 0,
                in_place: false,
            },
            kv: None,
        }
    }
}

/// Bytes of the checkpoint's tensors that stay resident (every tensor but
/// the routed experts', which the store serves, and Qwen4-Exp's n-gram row
/// tables, read a step's rows at a time).
pub fn resident_weight_bytes(ckpt: &Checkpoint) -> u64 {
    ckpt.source()
        .tensors()
        .iter()
        .filter(|(name, _)| !is_routed_expert_tensor(name) && !is_row_table(name))
        .map(|(_, t)| t.len_bytes)
        .sum()
}

/// Weight bytes one decode token reads: every resident tensor, except that
/// an untied embedding table gives one row, plus `top_k / num_experts` of
/// the routed experts' bytes (the chosen experts of every sparse layer).
pub fn weight_bytes_per_token(cfg: &ModelConfig, ckpt: &Checkpoint) -> u64 {
    let (resident, chosen) = weight_bytes_split(cfg, ckpt);
    resident.saturating_add(chosen)
}

/// [`weight_bytes_per_token`] in its two parts: the bytes every step reads
/// once whatever its rows (dense weights, norms, the LM head; one embedding
/// row per token), and the routed expert bytes one token chooses (a step of
/// several tokens reads the union of their choices).
pub fn weight_bytes_split(cfg: &ModelConfig, ckpt: &Checkpoint) -> (u64, u64) {
    let mut resident = 0u64;
    let mut routed = 0u64;
    for (name, t) in ckpt.source().tensors() {
        if is_routed_expert_tensor(name) {
            routed += t.len_bytes;
        } else if is_row_table(name) {
            // Row tables are counted by the rows a token reads (see
            // `qwen4_weight_bytes_per_token`).
        } else if name.ends_with("embed_tokens.weight") && !cfg.tie_word_embeddings {
            let rows = t.shape.first().copied().unwrap_or(1).max(1);
            resident += t.len_bytes / rows;
        } else {
            resident += t.len_bytes;
        }
    }
    let chosen = routed.saturating_mul(cfg.top_k as u64) / (cfg.num_experts.max(1) as u64);
    (resident, chosen)
}

/// [`weight_bytes_per_token`] of a Qwen4-Exp checkpoint: its routed
/// experts as the expert view sees them, plus one row of every n-gram head
/// in every PLE layer instead of the whole tables.
pub fn qwen4_weight_bytes_per_token(cfg: &Qwen4Config, ckpt: &Checkpoint) -> u64 {
    let row_bytes = ckpt
        .source()
        .tensors()
        .iter()
        .find(|(name, _)| is_row_table(name))
        .map_or(0, |(_, t)| {
            t.len_bytes / t.shape.first().copied().unwrap_or(1).max(1)
        });
    let rows = cfg
        .ple
        .as_ref()
        .map_or(0, |p| (p.heads() * p.layers.len()) as u64);
    weight_bytes_per_token(&cfg.expert_view(), ckpt).saturating_add(rows.saturating_mul(row_bytes))
}

/// Bytes of Qwen4-Exp's n-gram row tables in the checkpoint (0 for other
/// models): the row store's cache holds every row at this budget.
pub fn row_table_bytes(ckpt: &Checkpoint) -> u64 {
    ckpt.source()
        .tensors()
        .iter()
        .filter(|(name, _)| is_row_table(name))
        .map(|(_, t)| t.len_bytes)
        .sum()
}

/// Whether `name` is one of Qwen4-Exp's n-gram row tables
/// (`...ngram_embedding.shard_K.weight`, or unsplit `...ngram_embedding.weight`).
fn is_row_table(name: &str) -> bool {
    name.contains(".ngram_embedding.")
}

/// Whether `name` is a routed expert's tensor (`...experts.E.*` per expert,
/// or the fused `...experts.gate_up_proj` / `down_proj`), which the store
/// serves; shared experts (`shared_expert.`, `shared_experts.`) stay.
pub(crate) fn is_routed_expert_tensor(name: &str) -> bool {
    let Some(at) = name.find(".experts.") else {
        return false;
    };
    let rest = &name[at + ".experts.".len()..];
    rest.split('.')
        .next()
        .is_some_and(|p| p.parse::<u64>().is_ok())
        || rest.starts_with("gate_up_proj")
        || rest.starts_with("down_proj")
}

/// The CUDA device's expert tiers for `store` under `opts` and `gpu`.
pub fn cuda_experts(
    dev: &CudaDevice,
    cfg: &ModelConfig,
    ckpt: &Checkpoint,
    store: &Path,
    opts: &LoadOptions,
    gpu: &GpuOptions,
) -> Result<CudaExperts, EngineError> {
    let opened = Store::open(store)?;
    check_pairing(&opened, ckpt.source())?;
    let backend = opts.reader()?;
    let stores = StoreSet::open(store, false)?;
    // The layout check needs a pool; a one-record host pool reads nothing.
    let probe = StreamOptions {
        backing: Backing::Slots,
        budget_bytes: opened.stride_bytes(),
        queue_depth: 1,
    };
    let (_, layout) = open_pool(store, cfg, probe, backend.clone())?;
    CudaExperts::new(
        dev.gpu(),
        stores,
        backend,
        layout,
        cfg.num_layers,
        cfg.num_experts,
        cfg.top_k,
        gpu.budgets,
    )
}

/// Refuse a model whose resident weights, HBM expert slots and a first KV
/// allocation do not fit in the device's free memory, naming the bytes.
pub(crate) fn check_fits(
    dev: &CudaDevice,
    ckpt: &Checkpoint,
    store: &Path,
    gpu: &GpuOptions,
) -> Result<(), EngineError> {
    check_fits_bytes(dev, resident_weight_bytes(ckpt), store, gpu)
}

/// [`check_fits`] for a model whose resident weights are `weights` bytes.
pub(crate) fn check_fits_bytes(
    dev: &CudaDevice,
    weights: u64,
    store: &Path,
    gpu: &GpuOptions,
) -> Result<(), EngineError> {
    let opened = Store::open(store)?;
    let all = opened.stride_bytes() * opened.record_count();
    let slots = gpu.budgets.hbm_bytes.map_or(all, |b| b.min(all));
    let need = weights + slots;
    let (free, total) = dev.gpu().memory_info()?;
    if need > free as u64 {
        return Err(EngineError::DeviceMemory {
            need_bytes: need,
            weights_bytes: weights,
            experts_bytes: slots,
            free_bytes: free as u64,
            total_bytes: total as u64,
        });
    }
    Ok(())
}

/// Load the model in `model` on GPU `gpu.ordinal`: resident weights in HBM,
/// experts from `opts.store` through the GPU's tiers.
pub fn load_cuda(
    model: &Path,
    opts: &LoadOptions,
    gpu: &GpuOptions,
) -> Result<Model<CudaDevice>, EngineError> {
    // The checkpoint first: it refuses a FIFO or device as config.json.
    let ckpt = Checkpoint::open(model)?;
    let cfg = ModelConfig::from_file(&model.join("config.json"))?;
    let store = opts.store.clone();
    let dev = CudaDevice::open(gpu.ordinal)?;
    dev.set_kv_budget(gpu.kv.clone());
    check_fits(&dev, &ckpt, &store, gpu)?;
    let experts = cuda_experts(&dev, &cfg, &ckpt, &store, opts, gpu)?;
    Model::new(dev, &cfg, &ckpt, experts)
}
