//! A model opened for decoding, the one way every front end opens it:
//! `flashtier run`, `serve`, `bench serve`, `bench decode` and library
//! users describe what they want in [`SessionOptions`] and get a
//! [`Session`] back; they parse flags and print, nothing more.
//!
//! [`SessionOptions::open`] does, in order:
//! 1. opens the checkpoint once (a FIFO or a device as `config.json` is
//!    refused) and checks its config against its tensors, so a count the
//!    checkpoint contradicts is refused before anything is packed;
//! 2. refuses a KV budget on the CPU before packing;
//! 3. finds the expert store: the given file (packed there first when it
//!    does not exist, waiting for another writer packing the same file),
//!    or the store cache's file for the model (packed once on first use,
//!    reused while it pairs with the checkpoint);
//! 4. opens the engine on the placement with that same checkpoint, its
//!    expert tiers under the budgets, the KV tier and the PLE row store.
//!
//! Packing reports its bytes through the caller's progress callback
//! ([`Opening`]); the caller draws the bar.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use flashtier::experts::{Backing, ExpertsError};
use flashtier_engine::checkpoint::Checkpoint;
use flashtier_engine::config::qwen4::Qwen4Config;
use flashtier_engine::device::cuda::experts::TierBudgets;
use flashtier_engine::device::cuda::kv::KvBudget;
use flashtier_engine::engine::{self, Chosen, Engine, Placement};
use flashtier_engine::family::qwen4::PleRowOptions;
use flashtier_engine::load::{
    GpuOptions, LoadOptions, qwen4_weight_bytes_per_token, weight_bytes_per_token,
};
use flashtier_engine::{EngineError, ModelConfig};
use flashtier_io::StorageBackend;

use crate::cache::StoreCache;
use crate::pack::{PackOptions, pack_experts, plan_experts, planned_bytes};

/// Where a session's expert store comes from.
#[derive(Clone, Debug)]
pub enum StoreSource {
    /// This file, packed there from the checkpoint first when it does not
    /// exist.
    File(PathBuf),
    /// The store cache's file for the model (`None`: the cache's default
    /// location, [`StoreCache::default_location`]).
    Cache(Option<PathBuf>),
}

/// A PLE row store: its RAM budget and the folder of its shards.
#[derive(Clone, Debug)]
pub struct RowStore {
    /// Row cache bytes (0: every row read from its shard).
    pub budget_bytes: u64,
    /// Shard folder (`None`: beside the expert store, [`PleRowOptions::dir_beside`]).
    pub dir: Option<PathBuf>,
}

/// What to open and under which budgets.
#[derive(Clone)]
pub struct SessionOptions {
    /// Checkpoint folder (config.json and safetensors).
    pub model: PathBuf,
    /// The expert store.
    pub store: StoreSource,
    /// The device.
    pub placement: Placement,
    /// Resident expert bytes (`None`: every expert); on a GPU, the HBM
    /// budget unless [`Self::budget_hbm`] is set.
    pub budget: Option<u64>,
    /// GPU: HBM for expert slots.
    pub budget_hbm: Option<u64>,
    /// GPU: pinned RAM tier for experts (0: the staging one step needs).
    pub budget_ram: u64,
    /// GPU: HBM for the KV cache, and the folder of its store file
    /// (`None`: the expert store's folder).
    pub kv: Option<(u64, Option<PathBuf>)>,
    /// Qwen4-Exp: its PLE rows from the row store (`None`: from the
    /// checkpoint's shards).
    pub rows: Option<RowStore>,
    /// The CPU pool's backing.
    pub backing: Backing,
    /// Expert reads in flight at most.
    pub queue_depth: usize,
    /// The storage backend the expert reads go through (`None`: the
    /// platform's default).
    pub backend: Option<Arc<dyn StorageBackend>>,
}

impl std::fmt::Debug for SessionOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionOptions")
            .field("model", &self.model)
            .field("store", &self.store)
            .field("placement", &self.placement)
            .field("budget", &self.budget)
            .field("budget_hbm", &self.budget_hbm)
            .field("budget_ram", &self.budget_ram)
            .field("kv", &self.kv)
            .field("rows", &self.rows)
            .field("backing", &self.backing)
            .field("queue_depth", &self.queue_depth)
            .field("backend", &self.backend.as_ref().map(|_| "custom"))
            .finish()
    }
}

/// A step of [`SessionOptions::open`] worth showing.
#[derive(Clone, Copy, Debug)]
pub enum Opening<'a> {
    /// Packing the model's experts into `store`: `done` of `total` bytes.
    /// `cached` when `store` is the store cache's file.
    Packing {
        /// The store being written.
        store: &'a Path,
        /// Whether it is the store cache's.
        cached: bool,
        /// Bytes packed so far.
        done: u64,
        /// Bytes to pack.
        total: u64,
    },
}

/// The model on its device, with what was chosen on the way.
#[derive(Debug)]
pub struct Session {
    /// The model.
    pub engine: Engine,
    /// The expert store it reads.
    pub store: PathBuf,
    /// Where it runs and why.
    pub chosen: Chosen,
    /// Weight bytes one decode token reads (the roofline's numerator).
    pub weight_bytes_per_token: u64,
}

/// A session that could not open.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SessionError {
    /// No store file given and no store cache location (no
    /// `FLASHTIER_CACHE`, `XDG_CACHE_HOME` or `HOME`).
    #[error("no store cache: set FLASHTIER_CACHE or HOME, or give a store file")]
    NoCache,
    /// Packing the experts of `model` into `store` failed.
    #[error("packing the experts of {} into {}: {source}", model.display(), store.display())]
    Pack {
        /// Checkpoint folder.
        model: PathBuf,
        /// Store file.
        store: PathBuf,
        /// Why.
        source: Box<EngineError>,
    },
    /// Opening or loading the model failed.
    #[error("loading {}: {source}", model.display())]
    Load {
        /// Checkpoint folder.
        model: PathBuf,
        /// Why.
        source: Box<EngineError>,
    },
}

impl SessionError {
    /// The engine's error underneath, if any.
    #[must_use]
    pub fn engine(&self) -> Option<&EngineError> {
        match self {
            Self::NoCache => None,
            Self::Pack { source, .. } | Self::Load { source, .. } => Some(source),
        }
    }

    /// When a pool budget cannot hold one step's experts: the records it
    /// must hold at least.
    #[must_use]
    pub fn pool_needs_records(&self) -> Option<usize> {
        self.engine().and_then(pool_needs_records)
    }
}

/// When `e` says a pool budget cannot hold one step's experts: the
/// records it must hold at least.
#[must_use]
pub fn pool_needs_records(e: &EngineError) -> Option<usize> {
    match e {
        EngineError::Pool(ExpertsError::PoolTooSmall { needed, .. }) => Some(*needed),
        _ => None,
    }
}

impl SessionOptions {
    /// `model` on `auto` with every expert resident, the store from the
    /// store cache's default location, 8 reads in flight.
    #[must_use]
    pub fn new(model: impl Into<PathBuf>) -> Self {
        Self {
            model: model.into(),
            store: StoreSource::Cache(None),
            placement: Placement::Auto,
            budget: None,
            budget_hbm: None,
            budget_ram: 0,
            kv: None,
            rows: None,
            backing: Backing::Slots,
            queue_depth: 8,
            backend: None,
        }
    }

    /// The expert store file this session reads (or packs), without
    /// opening or packing anything.
    ///
    /// # Errors
    /// [`SessionError::NoCache`] without a store file or a cache location;
    /// [`SessionError::Load`] when the model folder cannot be resolved.
    pub fn store_path(&self) -> Result<PathBuf, SessionError> {
        match &self.store {
            StoreSource::File(path) => Ok(path.clone()),
            StoreSource::Cache(dir) => self.cache_path(&self.cache(dir.as_deref())?),
        }
    }

    /// The file of `cache` for this session's model.
    fn cache_path(&self, cache: &StoreCache) -> Result<PathBuf, SessionError> {
        cache
            .path_for(&self.model)
            .map_err(|source| SessionError::Load {
                model: self.model.clone(),
                source: Box::new(source),
            })
    }

    /// The folder of the PLE row shards under [`Self::rows`]: the given
    /// one, else beside the expert store (`None` without a row store).
    ///
    /// # Errors
    /// As [`Self::store_path`].
    pub fn rows_dir(&self) -> Result<Option<PathBuf>, SessionError> {
        let Some(rows) = &self.rows else {
            return Ok(None);
        };
        match &rows.dir {
            Some(dir) => Ok(Some(dir.clone())),
            None => Ok(Some(PleRowOptions::dir_beside(&self.store_path()?))),
        }
    }

    /// Open the model (see the module's docs for the steps).
    ///
    /// # Errors
    /// A typed [`SessionError`]: the model, its store, or the engine's
    /// error naming what failed (a pool too small to hold one step's
    /// experts: [`SessionError::pool_needs_records`]).
    pub fn open(&self, progress: &(dyn Fn(Opening<'_>) + Sync)) -> Result<Session, SessionError> {
        let load = |source| SessionError::Load {
            model: self.model.clone(),
            source: Box::new(source),
        };
        // The checkpoint first: it refuses a FIFO or device as config.json.
        let ckpt = Checkpoint::open(&self.model).map_err(load)?;
        let weight_bytes_per_token = checked_weight_bytes(&ckpt).map_err(load)?;
        if self.kv.is_some() && self.placement == Placement::Cpu {
            return Err(load(EngineError::KvBudgetNeedsGpu { why: None }));
        }
        let store = self.ensure_store(&ckpt, progress)?;
        let opts = LoadOptions {
            store: store.clone(),
            budget_bytes: self.budget,
            backing: self.backing,
            queue_depth: self.queue_depth,
            backend: self.backend.clone(),
        };
        let kv = self.kv.as_ref().map(|(bytes, dir)| {
            let dir = dir.clone().unwrap_or_else(|| {
                store
                    .parent()
                    .filter(|p| !p.as_os_str().is_empty())
                    .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
            });
            KvBudget::new(*bytes, dir)
        });
        let gpu = GpuOptions {
            kv,
            ordinal: 0,
            budgets: TierBudgets {
                hbm_bytes: self.budget_hbm.or(self.budget),
                ram_bytes: self.budget_ram,
                in_place: false,
            },
        };
        let rows = self.rows.as_ref().map(|r| PleRowOptions {
            dir: r
                .dir
                .clone()
                .unwrap_or_else(|| PleRowOptions::dir_beside(&store)),
            budget_bytes: r.budget_bytes,
        });
        let (engine, chosen) =
            engine::open_checkpoint(ckpt, &store, &opts, self.placement, &gpu, rows.as_ref())
                .map_err(load)?;
        Ok(Session {
            engine,
            store,
            chosen,
            weight_bytes_per_token,
        })
    }

    fn cache(&self, dir: Option<&Path>) -> Result<StoreCache, SessionError> {
        match dir {
            Some(dir) => Ok(StoreCache::at(dir)),
            None => StoreCache::default_location().ok_or(SessionError::NoCache),
        }
    }

    /// The store file, packed first when it does not exist (or, from the
    /// cache, when it no longer pairs with the checkpoint).
    fn ensure_store(
        &self,
        ckpt: &Checkpoint,
        progress: &(dyn Fn(Opening<'_>) + Sync),
    ) -> Result<PathBuf, SessionError> {
        match &self.store {
            StoreSource::File(path) if path.exists() => Ok(path.clone()),
            StoreSource::File(path) => {
                let pack = |source| SessionError::Pack {
                    model: self.model.clone(),
                    store: path.clone(),
                    source: Box::new(source),
                };
                let total = plan_experts(ckpt.source())
                    .map(|(_, manifest)| planned_bytes(&manifest))
                    .map_err(|e| pack(e.into()))?;
                let done = std::sync::atomic::AtomicU64::new(0);
                // Another session may be packing the same store: wait for
                // it, then use its store instead of packing again.
                let mut opts = PackOptions::new(&self.model, path);
                opts.reuse_existing = true;
                pack_experts(&opts, &|n| {
                    let done = done.fetch_add(n, std::sync::atomic::Ordering::Relaxed) + n;
                    progress(Opening::Packing {
                        store: path,
                        cached: false,
                        done,
                        total,
                    });
                })
                .map(|report| report.out)
                .map_err(|e| pack(e.into()))
            }
            StoreSource::Cache(dir) => {
                let cache = self.cache(dir.as_deref())?;
                let path = self.cache_path(&cache)?;
                let cached = cache.ensure(&self.model, &|done, total| {
                    progress(Opening::Packing {
                        store: &path,
                        cached: true,
                        done,
                        total,
                    });
                });
                cached
                    .map(|c| c.path().to_path_buf())
                    .map_err(|source| SessionError::Pack {
                        model: self.model.clone(),
                        store: path.clone(),
                        source: Box::new(source),
                    })
            }
        }
    }
}

/// The weight bytes a decode token reads, after the config is checked
/// against the checkpoint (Qwen4-Exp's tensors are checked at load).
fn checked_weight_bytes(ckpt: &Checkpoint) -> Result<u64, EngineError> {
    let json = ckpt.source().config();
    if Qwen4Config::is_qwen4(json) {
        let cfg = Qwen4Config::from_json(json)?;
        return Ok(qwen4_weight_bytes_per_token(&cfg, ckpt));
    }
    let cfg = ModelConfig::from_json(json)?;
    flashtier_engine::config::bounds::check(&cfg, ckpt)?;
    Ok(weight_bytes_per_token(&cfg, ckpt))
}
