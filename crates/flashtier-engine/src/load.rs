//! Putting a model together: the checkpoint's resident weights on a
//! device, and the experts from a packed store (given, or packed once into
//! the [`StoreCache`]) through the expert pool.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use flashtier::experts::Backing;
use flashtier_format::Store;
use flashtier_io::{PosixBackend, StorageBackend};

use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::device::cpu::CpuDevice;
use crate::device::cpu::experts::PoolExperts;
use crate::error::EngineError;
use crate::experts::{StreamOptions, open_pool};
use crate::model::Model;
use crate::pack::check_pairing;
use crate::store_cache::StoreCache;

/// Where the experts come from.
#[derive(Clone, Debug)]
pub enum ExpertStore {
    /// This store file, which must pair with the checkpoint.
    File(PathBuf),
    /// The cache's store of the checkpoint, packed first when missing.
    Cache(StoreCache),
}

/// How [`load_cpu`] builds a model.
#[derive(Clone)]
pub struct LoadOptions {
    /// The expert store.
    pub store: ExpertStore,
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
    /// Experts from the store cache at `cache`, all resident, slots backing.
    pub fn cached(cache: &Path) -> Self {
        Self::with_store(ExpertStore::Cache(StoreCache::at(cache)))
    }

    /// Experts from the store file `store`, all resident, slots backing.
    pub fn store(store: &Path) -> Self {
        Self::with_store(ExpertStore::File(store.to_path_buf()))
    }

    fn with_store(store: ExpertStore) -> Self {
        Self {
            store,
            budget_bytes: None,
            backing: Backing::Slots,
            queue_depth: 8,
            backend: None,
        }
    }

    /// The same with a budget of `bytes` for resident experts.
    #[must_use]
    pub fn budget(mut self, bytes: u64) -> Self {
        self.budget_bytes = Some(bytes);
        self
    }
}

/// The store file `opts` names for `model`, packed into the cache first
/// when needed (`progress(done, total)` sees packed bytes).
pub fn resolve_store(
    model: &Path,
    opts: &LoadOptions,
    progress: &(dyn Fn(u64, u64) + Sync),
) -> Result<PathBuf, EngineError> {
    match &opts.store {
        ExpertStore::File(p) => Ok(p.clone()),
        ExpertStore::Cache(cache) => Ok(cache.ensure(model, progress)?.path().to_path_buf()),
    }
}

/// The CPU expert tier for `model`'s store under `opts`.
pub fn cpu_experts(
    cfg: &ModelConfig,
    ckpt: &Checkpoint,
    store: &Path,
    opts: &LoadOptions,
) -> Result<PoolExperts, EngineError> {
    let opened = Store::open(store)?;
    check_pairing(&opened, ckpt.source())?;
    let budget = opts
        .budget_bytes
        .unwrap_or(opened.stride_bytes() * opened.record_count());
    let backend = match &opts.backend {
        Some(b) => b.clone(),
        None => Arc::new(PosixBackend::new(opts.queue_depth.max(1))?),
    };
    let stream = StreamOptions {
        backing: opts.backing,
        budget_bytes: budget,
        queue_depth: opts.queue_depth,
    };
    let (pool, layout) = open_pool(store, cfg, stream, backend)?;
    Ok(PoolExperts::new(pool, layout))
}

/// Load the model in `model` on the CPU with experts from `opts.store`.
pub fn load_cpu(model: &Path, opts: &LoadOptions) -> Result<Model<CpuDevice>, EngineError> {
    let cfg = ModelConfig::from_file(&model.join("config.json"))?;
    let ckpt = Checkpoint::open(model)?;
    let store = resolve_store(model, opts, &|_, _| {})?;
    let experts = cpu_experts(&cfg, &ckpt, &store, opts)?;
    Model::new(CpuDevice, &cfg, &ckpt, experts)
}
