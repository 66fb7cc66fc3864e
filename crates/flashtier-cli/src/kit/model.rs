//! Opening a model the way `run`, `serve` and `bench serve` do: the
//! flags they share ([`ModelArgs`]), the store (given, packed first when
//! missing, or from the store cache) and the engine on its device.

use std::path::{Path, PathBuf};

use anyhow::Context;
use flashtier::experts::{Backing, ExpertsError};
use flashtier_engine::checkpoint::Checkpoint;
use flashtier_engine::config::qwen4::Qwen4Config;
use flashtier_engine::device::cuda::experts::TierBudgets;
use flashtier_engine::device::cuda::kv::KvBudget;
use flashtier_engine::engine::{self, Chosen, Engine, Placement};
use flashtier_engine::family::qwen4::PleRowOptions;
use flashtier_engine::load::{GpuOptions, LoadOptions};
use flashtier_engine::{EngineError, ModelConfig};
use flashtier_pack::cache::StoreCache;
use flashtier_pack::pack::{PackOptions, PackReport};

use super::{bytes_bar, parse_bytes};

/// The model, its stores and its memory budgets: the options `run` and
/// `serve` share.
#[derive(clap::Args, Debug, Clone)]
pub struct ModelArgs {
    /// Model directory: config.json and safetensors (tokenizer.json for --prompt).
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    /// Expert store packed from the model; packed there first when the file
    /// does not exist. Without it, the experts are packed once into the
    /// store cache (--cache) and reused by later runs.
    #[arg(long, value_name = "FILE")]
    pub store: Option<PathBuf>,
    /// Store cache folder for runs without --store [default: $FLASHTIER_CACHE,
    /// else $XDG_CACHE_HOME/flashtier, else ~/.cache/flashtier].
    #[arg(long, value_name = "DIR")]
    pub cache: Option<PathBuf>,
    /// Where to decode: `cuda` (GPU 0; `cuda:N`), `cpu`, or `auto` (the GPU
    /// when there is a driver and a device, else the CPU, saying why).
    /// Qwen4-Exp runs on the CPU only (`auto` says so).
    #[arg(long, value_name = "DEVICE", default_value = "auto")]
    pub device: Placement,
    /// Memory budget for resident experts (K, M, G, T: powers of 1024);
    /// default: all experts. On the GPU, the HBM budget unless
    /// --budget-hbm is given.
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes)]
    pub budget: Option<u64>,
    /// GPU: HBM for expert slots (default: all records, loaded up front).
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes)]
    pub budget_hbm: Option<u64>,
    /// GPU: pinned host RAM for experts, the tier between HBM and the drive
    /// (0: only the staging one step needs).
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes, default_value = "0")]
    pub budget_ram: u64,
    /// GPU: HBM for the KV cache (keys and values of every layer); a
    /// context that needs more keeps its newest positions in HBM and
    /// offloads the older ones to a KV store file, restored tile by tile
    /// for every attention (the output is the same bits). Default: every
    /// position in HBM. Refused on the CPU.
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes)]
    pub kv_budget_hbm: Option<u64>,
    /// Folder of the KV store file under --kv-budget-hbm (a scratch file,
    /// removed at exit) [default: the expert store's folder].
    #[arg(long, value_name = "DIR", requires = "kv_budget_hbm")]
    pub kv_dir: Option<PathBuf>,
    /// Pool backing: `slots` (direct reads into a slot arena) or `mapped`
    /// (the store memory-mapped, the page cache as a second tier). A mapped
    /// store must not be modified in place while the run reads it (replacing
    /// it by rename is safe): a changed record fails its checksum and a
    /// truncated store is an error, but a truncation that races a read can
    /// still end the process with SIGBUS.
    #[arg(long, value_name = "KIND", default_value = "slots")]
    pub backing: Backing,
    /// Qwen4-Exp: RAM cache for PLE n-gram rows, served from the row store
    /// (0: no cache, every row read from its packed shard); without it the
    /// rows are read from the checkpoint's shards directly.
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes)]
    pub rows_budget: Option<u64>,
    /// Folder of the packed PLE row shards (packed there from the
    /// checkpoint when missing) [default: the expert store's path plus
    /// `.ple-rows`].
    #[arg(long, value_name = "DIR", requires = "rows_budget")]
    pub rows_dir: Option<PathBuf>,
    /// Expert reads in flight at most.
    #[arg(long, value_name = "N", default_value_t = 8)]
    pub queue_depth: usize,
}

/// The model with experts from `--store` (packed first when missing) or
/// from the store cache, paired with this checkpoint.
/// The model, its store, where it runs, and the weight bytes a decode
/// token reads.
pub(crate) fn load_model(
    m: &ModelArgs,
    json: bool,
) -> anyhow::Result<(Engine, PathBuf, Chosen, u64)> {
    // The checkpoint first: it refuses a FIFO or device as config.json.
    let ckpt =
        Checkpoint::open(&m.model).with_context(|| format!("opening {}", m.model.display()))?;
    let touched = checked_weight_bytes(m, &ckpt)?;
    drop(ckpt);
    let show = !json;
    let path = match &m.store {
        Some(path) if !path.exists() => pack_store(&m.model, path, show)?.out,
        Some(path) => path.clone(),
        None => {
            let cache = store_cache(m.cache.as_deref())?;
            let bar = bytes_bar(0, "packing", show);
            let cached = cache.ensure(&m.model, &|done, total| {
                if bar.length() != Some(total) {
                    bar.set_length(total);
                    bar.println(format!(
                        "packing the experts of {} once into the store cache {}",
                        m.model.display(),
                        cache.dir().display()
                    ));
                }
                bar.set_position(done);
            });
            let cached =
                cached.with_context(|| format!("packing the experts of {}", m.model.display()))?;
            bar.finish_and_clear();
            cached.path().to_path_buf()
        }
    };
    let opts = LoadOptions {
        store: path.clone(),
        budget_bytes: m.budget,
        backing: m.backing,
        queue_depth: m.queue_depth,
        backend: None,
    };
    let kv = m.kv_budget_hbm.map(|bytes| {
        let dir = m.kv_dir.clone().unwrap_or_else(|| {
            path.parent()
                .filter(|p| !p.as_os_str().is_empty())
                .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
        });
        KvBudget::new(bytes, dir)
    });
    let gpu = GpuOptions {
        kv,
        ordinal: 0,
        budgets: TierBudgets {
            hbm_bytes: m.budget_hbm.or(m.budget),
            ram_bytes: m.budget_ram,
            in_place: false,
        },
    };
    let rows = m.rows_budget.map(|budget_bytes| PleRowOptions {
        dir: m
            .rows_dir
            .clone()
            .unwrap_or_else(|| PleRowOptions::dir_beside(&path)),
        budget_bytes,
    });
    let (model, chosen) =
        engine::open_with_rows(&m.model, &path, &opts, m.device, &gpu, rows.as_ref())
            .map_err(|e| explain_pool(e, m))
            .with_context(|| format!("loading {}", m.model.display()))?;
    Ok((model, path, chosen, touched))
}

/// The weight bytes a decode token reads, after the config is checked
/// against the checkpoint (counts it contradicts are refused before
/// anything is packed; Qwen4-Exp's tensors are checked at load).
fn checked_weight_bytes(m: &ModelArgs, ckpt: &Checkpoint) -> anyhow::Result<u64> {
    let json = ckpt.source().config();
    if Qwen4Config::is_qwen4(json) {
        let cfg = Qwen4Config::from_json(json)?;
        return Ok(flashtier_engine::load::qwen4_weight_bytes_per_token(
            &cfg, ckpt,
        ));
    }
    let cfg = ModelConfig::from_file(&m.model.join("config.json"))?;
    flashtier_engine::config::bounds::check(&cfg, ckpt)?;
    Ok(flashtier_engine::load::weight_bytes_per_token(&cfg, ckpt))
}

/// Pack `model`'s experts into `out` with a progress bar.
fn pack_store(model: &Path, out: &Path, show: bool) -> anyhow::Result<PackReport> {
    // Another `run` may be packing the same store: wait for it, then use
    // its store instead of packing again.
    let mut opts = PackOptions::new(model, out);
    opts.reuse_existing = true;
    super::pack_with_bar(&opts, show)
}

/// A pool that cannot hold one step's experts says how big the budget must
/// be; every other failure is reported as it is.
pub(crate) fn explain_pool(e: EngineError, m: &ModelArgs) -> anyhow::Error {
    let flag = if m.budget_hbm.is_some() {
        "--budget-hbm"
    } else {
        "--budget"
    };
    match e {
        EngineError::Pool(ExpertsError::PoolTooSmall { needed, .. }) => anyhow::Error::new(e)
            .context(format!(
                "{flag} must hold at least one step's {needed} expert records"
            )),
        other => anyhow::Error::new(other),
    }
}

/// The store cache at `cache`, or at the default location.
pub(crate) fn store_cache(cache: Option<&Path>) -> anyhow::Result<StoreCache> {
    match cache {
        Some(dir) => Ok(StoreCache::at(dir)),
        None => StoreCache::default_location().ok_or_else(|| {
            anyhow::anyhow!(
                "no store cache: set FLASHTIER_CACHE or HOME, or give --store or --cache"
            )
        }),
    }
}

/// The expert store `run` uses for `model`: `store`, or the store cache's
/// file of the model (packed there on first use).
pub(crate) fn store_path(
    model: &Path,
    store: Option<&Path>,
    cache: Option<&Path>,
) -> anyhow::Result<PathBuf> {
    match store {
        Some(p) => Ok(p.to_path_buf()),
        None => store_cache(cache)?
            .path_for(model)
            .with_context(|| format!("opening {}", model.display())),
    }
}

/// The folder of `model`'s packed PLE row shards under `run`'s flags:
/// `rows_dir`, else beside the expert store (`--store`, or the cache's).
pub(crate) fn ple_rows_dir(
    model: &Path,
    store: Option<&Path>,
    cache: Option<&Path>,
    rows_dir: Option<&Path>,
) -> anyhow::Result<PathBuf> {
    match rows_dir {
        Some(dir) => Ok(dir.to_path_buf()),
        None => Ok(PleRowOptions::dir_beside(&store_path(model, store, cache)?)),
    }
}
