//! The flags `run`, `serve` and `bench serve` share ([`ModelArgs`]) and
//! the session they describe ([`flashtier_pack::session`] opens it; here
//! only the packing bar and the flag a too-small pool names).

use std::path::PathBuf;

use flashtier::experts::Backing;
use flashtier_engine::EngineError;
use flashtier_engine::engine::Placement;
use flashtier_pack::session::{
    Opening, RowStore, Session, SessionOptions, StoreSource, pool_needs_records,
};

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

impl ModelArgs {
    /// The session these flags describe.
    pub fn session(&self) -> SessionOptions {
        SessionOptions {
            model: self.model.clone(),
            store: match &self.store {
                Some(path) => StoreSource::File(path.clone()),
                None => StoreSource::Cache(self.cache.clone()),
            },
            placement: self.device,
            budget: self.budget,
            budget_hbm: self.budget_hbm,
            budget_ram: self.budget_ram,
            kv: self.kv_budget_hbm.map(|bytes| (bytes, self.kv_dir.clone())),
            rows: self.rows_budget.map(|budget_bytes| RowStore {
                budget_bytes,
                dir: self.rows_dir.clone(),
            }),
            backing: self.backing,
            queue_depth: self.queue_depth,
            backend: None,
        }
    }
}

/// The model these flags name, opened with a packing bar unless `json`.
pub(crate) fn load_model(m: &ModelArgs, json: bool) -> anyhow::Result<Session> {
    open_session(&m.session(), m, !json)
}

/// `opts` opened with a packing bar when `show`; a pool too small for
/// one step names the flag that sets it (from `m`).
pub(crate) fn open_session(
    opts: &SessionOptions,
    m: &ModelArgs,
    show: bool,
) -> anyhow::Result<Session> {
    let bar = bytes_bar(0, "packing", show);
    let session = opts.open(&|event| match event {
        Opening::Packing {
            store,
            cached,
            done,
            total,
        } => {
            if bar.length() != Some(total) {
                bar.set_length(total);
                let into = if cached {
                    " once into the store cache"
                } else {
                    " into"
                };
                bar.println(format!(
                    "packing the experts of {}{into} {}",
                    opts.model.display(),
                    store.display()
                ));
            }
            bar.set_position(done);
        }
    });
    bar.finish_and_clear();
    session.map_err(|e| {
        let needed = e.pool_needs_records();
        pool_hint(anyhow::Error::new(e), needed, m)
    })
}

/// A decode whose pool cannot hold one step's experts says how big the
/// budget must be; every other failure is reported as it is.
pub(crate) fn explain_pool(e: EngineError, m: &ModelArgs) -> anyhow::Error {
    let needed = pool_needs_records(&e);
    pool_hint(anyhow::Error::new(e), needed, m)
}

fn pool_hint(e: anyhow::Error, needed: Option<usize>, m: &ModelArgs) -> anyhow::Error {
    let flag = if m.budget_hbm.is_some() {
        "--budget-hbm"
    } else {
        "--budget"
    };
    match needed {
        Some(needed) => e.context(format!(
            "{flag} must hold at least one step's {needed} expert records"
        )),
        None => e,
    }
}
