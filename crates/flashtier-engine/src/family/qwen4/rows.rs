//! PLE rows through the row store: each PLE layer's n-gram shards
//! (`ngram_embedding.shard_K.weight`, BF16 rows of `ple_embed_dim /
//! ngram_heads` values) packed once into row shards (4 KiB blocks, an xxh3
//! per block, checked on every read) and served by one [`RowStore`] per
//! shard, all sharing one RAM cache budget.
//!
//! Files: `{dir}/layer{L}.shard{K}-{tag}.ftrows` ([`ple_shards`] lists
//! them), where `L` is the decoder layer, `K` the table shard and `tag` the
//! xxh3 of the checkpoint file's header, its length and the tensor's
//! offset in it (as the expert store's pairing checks them), so a shard
//! packed from another checkpoint is never served; a missing shard is
//! packed from the checkpoint tensor ([`TableSource::safetensors_unscaled`])
//! when the model opens, or all of them beforehand by [`pack_ple_rows`]
//! (`flashtier pack rows --ple`); one whose rows or geometry do not match
//! the tensor is an error naming it. Every shard is written by the row
//! packer ([`pack_shard_with`]: a lock beside it, a unique temp file,
//! fsync, rename; only an older row shard is replaced) and may not be a
//! file of the checkpoint.
//!
//! Bounds: the budget is split evenly over the shards (a share under one
//! cache slot gives that shard no cache; 0 gives none at all, every row
//! read from its shard). A step's reads are started for every PLE layer as
//! soon as its tokens are known ([`LayerRows::prefetch`], a no-op without
//! a cache): each layer's shards share one backend with
//! [`ROW_QUEUE_DEPTH`] reads in flight ([`row_backend`]: io_uring where the
//! kernel allows it, else posix workers), so the reads are only submitted
//! there and land while the earlier layers compute (the inline backend
//! would read them on the spot). A lookup waits for its layer's prefetch,
//! then reads what is still missing. Stall time is all the time the forward
//! pass spends on rows: starting the prefetch, that wait and the lookup.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use flashtier::rows::pack::pack_shard_with;
use flashtier::rows::{RowError, RowPrefetch, RowStore, RowStoreConfig, TableSource};
use flashtier_format::row_shard::RowShardHeader;
use flashtier_format::xxh3_64;
use flashtier_io::persist::{Wait, refuse_inputs};
use flashtier_io::{PosixBackend, StorageBackend, UringBackend};

use crate::checkpoint::Checkpoint;
use crate::checkpoint::files::CheckpointFiles;
use crate::config::qwen4::{Qwen4Config, in_scope};
use crate::error::EngineError;

/// Where a Qwen4-Exp model's PLE rows come from, when not from the
/// checkpoint directly.
#[derive(Clone, Debug)]
pub struct PleRowOptions {
    /// Folder of the packed row shards (created, and shards packed there
    /// from the checkpoint, when missing).
    pub dir: PathBuf,
    /// RAM cache budget over all PLE shards, in bytes (0: no cache).
    pub budget_bytes: u64,
}

impl PleRowOptions {
    /// The folder `flashtier run` keeps the shards in by default: the
    /// expert store's path plus `.ple-rows`.
    pub fn dir_beside(store: &Path) -> PathBuf {
        let mut dir = store.as_os_str().to_owned();
        dir.push(".ple-rows");
        PathBuf::from(dir)
    }
}

/// One PLE table shard and the row shard file it is packed into.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PleShard {
    /// Decoder layer (zero-based) of the table.
    pub layer: usize,
    /// Shard of the layer's table.
    pub shard: usize,
    /// The checkpoint tensor (`...ngram_embedding.shard_K.weight`).
    pub tensor: String,
    /// Bytes of the tensor (the rows the file holds).
    pub table_bytes: u64,
    /// The packed file, `{dir}/layer{L}.shard{K}-{tag}.ftrows`.
    pub path: PathBuf,
}

/// Every PLE table shard of the checkpoint `ckpt` (config `cfg`) and the
/// file the engine packs it into, and opens it from, in `dir`; in layer,
/// then shard order (none without PLE layers).
pub fn ple_shards(
    ckpt: &CheckpointFiles,
    cfg: &Qwen4Config,
    dir: &Path,
) -> Result<Vec<PleShard>, EngineError> {
    let Some(ple) = &cfg.ple else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for &layer in &ple.layers {
        let stem = table_stem(&format!("{}.layers.{layer}", cfg.prefix));
        for (shard, tensor) in table_names(ckpt, &stem, ple.split_parts)
            .into_iter()
            .enumerate()
        {
            let path = shard_path(ckpt, &tensor, dir, layer, shard)?;
            let table_bytes = ckpt.tensors().get(&tensor).map_or(0, |t| t.len_bytes);
            out.push(PleShard {
                layer,
                shard,
                tensor,
                table_bytes,
                path,
            });
        }
    }
    Ok(out)
}

/// Pack every PLE table shard of the Qwen4-Exp checkpoint in `model` into
/// `dir` (created when missing) under the engine's names ([`ple_shards`]),
/// replacing older row shards there, so that a model opened with its rows
/// in `dir` packs nothing. `wait` says what to do when another process
/// writes the same shard; `progress(done, total)` sees the table bytes
/// packed so far of all shards'. Returns each shard with the header
/// written.
pub fn pack_ple_rows(
    model: &Path,
    dir: &Path,
    wait: Wait,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<Vec<(PleShard, RowShardHeader)>, EngineError> {
    let ckpt = CheckpointFiles::open(model)?;
    let cfg = Qwen4Config::from_json(ckpt.config())?;
    let shards = ple_shards(&ckpt, &cfg, dir)?;
    if shards.is_empty() {
        let none = EngineError::config(
            "ple_layer_ids",
            "this model has no PLE layers, so no row tables to pack",
        );
        return Err(in_scope(none, cfg.field_scope()));
    }
    create_dir(dir)?;
    let total: u64 = shards.iter().map(|s| s.table_bytes).sum();
    let mut done_bytes = 0u64;
    let mut out = Vec::with_capacity(shards.len());
    for s in shards {
        let src = TableSource::safetensors_unscaled(ckpt.dir(), &s.tensor)?;
        let header = pack_one(&ckpt, &src, &s, wait, &mut |rows| {
            progress(
                done_bytes + rows * u64::from(src.geometry.weight_bytes),
                total,
            );
        })?;
        done_bytes += s.table_bytes;
        out.push((s, header));
    }
    Ok(out)
}

/// Pack `src` (the tensor of `shard`) into its file, refusing any file of
/// `ckpt` as the output.
fn pack_one(
    ckpt: &CheckpointFiles,
    src: &TableSource,
    shard: &PleShard,
    wait: Wait,
    progress: &mut dyn FnMut(u64),
) -> Result<RowShardHeader, EngineError> {
    refuse_inputs(&shard.path, &ckpt.input_paths()).map_err(RowError::from)?;
    let layer = shard.layer as u64;
    Ok(pack_shard_with(
        src,
        layer,
        0,
        src.rows,
        &shard.path,
        wait,
        progress,
    )?)
}

/// Create the shard folder `dir` (and its parents).
fn create_dir(dir: &Path) -> Result<(), EngineError> {
    std::fs::create_dir_all(dir).map_err(|source| EngineError::Io {
        path: dir.to_path_buf(),
        source,
    })
}

/// Row-store counters of the PLE tables.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PleRowStats {
    /// Rows looked up (one per n-gram head, PLE layer and token).
    pub lookups: u64,
    /// Lookups served from the cache (prefetched rows included).
    pub hits: u64,
    /// Distinct rows read from the shards.
    pub misses: u64,
    /// Bytes read from the shards (4 KiB blocks).
    pub bytes_read: u64,
    /// Nanoseconds the forward pass waited for rows.
    pub stall_ns: u64,
}

impl PleRowStats {
    /// Lookups whose row was cached before its step (1 with no lookups).
    /// A row the prefetch read is a miss, though its lookup then finds it
    /// in the cache (and counts in `hits`).
    pub fn hit_rate(&self) -> f64 {
        if self.lookups == 0 {
            1.0
        } else {
            1.0 - self.misses.min(self.lookups) as f64 / self.lookups as f64
        }
    }

    /// The counters since `earlier`.
    #[must_use]
    pub fn since(&self, earlier: &Self) -> Self {
        Self {
            lookups: self.lookups - earlier.lookups,
            hits: self.hits - earlier.hits,
            misses: self.misses - earlier.misses,
            bytes_read: self.bytes_read - earlier.bytes_read,
            stall_ns: self.stall_ns - earlier.stall_ns,
        }
    }
}

/// One PLE layer's shards in the row store.
pub(crate) struct LayerRows {
    stores: Vec<RowStore>,
    pending: Vec<RowPrefetch>,
    /// Reads of the next prompt chunk's rows, started while this one
    /// computes ([`Self::read_ahead`]).
    ahead: Vec<RowPrefetch>,
    stall_ns: u64,
}

/// The backend of one PLE layer's row reads: io_uring, which submits a
/// step's reads in one system call and wakes no worker per read (on the
/// demo model, 2 cores: row stall 4.3-4.7% of the step against 6.4% with
/// posix workers), or posix workers where the kernel refuses a ring.
pub fn row_backend() -> Result<Arc<dyn StorageBackend>, EngineError> {
    match UringBackend::new(ROW_QUEUE_DEPTH) {
        Ok(ring) => Ok(Arc::new(ring)),
        Err(e) => {
            tracing::debug!("row reads on posix workers: io_uring unavailable ({e})");
            Ok(Arc::new(PosixBackend::new(ROW_QUEUE_DEPTH)?))
        }
    }
}

/// Start each shard's prefetch of its rows `per_shard[k]` (none for an
/// empty list), the handles into `into`.
fn start_into(
    stores: &[RowStore],
    per_shard: &[Vec<u64>],
    into: &mut Vec<RowPrefetch>,
) -> Result<(), EngineError> {
    for (store, ids) in stores.iter().zip(per_shard) {
        if !ids.is_empty() {
            into.push(store.prefetch_start(ids)?);
        }
    }
    Ok(())
}

/// Block a row-shard read fetches.
const BLOCK_BYTES: u64 = 4096;

/// Row reads in flight per PLE layer (a step reads `ngram_heads` rows per
/// layer).
pub const ROW_QUEUE_DEPTH: usize = 32;

impl LayerRows {
    /// Open (packing first where missing) the shards `names` of PLE layer
    /// `layer`, each with `cache_bytes` of cache.
    pub(crate) fn open(
        ckpt: &Checkpoint,
        layer: usize,
        names: &[String],
        opts: &PleRowOptions,
        cache_bytes: u64,
    ) -> Result<Self, EngineError> {
        create_dir(&opts.dir)?;
        let files = ckpt.source();
        let mut stores = Vec::with_capacity(names.len());
        let backend = row_backend()?;
        for (k, name) in names.iter().enumerate() {
            let src = TableSource::safetensors_unscaled(files.dir(), name)?;
            let path = shard_path(files, name, &opts.dir, layer, k)?;
            if !path.exists() {
                let shard = PleShard {
                    layer,
                    shard: k,
                    tensor: name.clone(),
                    table_bytes: src.rows * u64::from(src.geometry.weight_bytes),
                    path: path.clone(),
                };
                pack_one(files, &src, &shard, Wait::Block, &mut |_| {})?;
            }
            let cfg = RowStoreConfig {
                cache_bytes,
                backend: Some(backend.clone()),
                ..Default::default()
            };
            let store = RowStore::open_packed(&path, cfg)?;
            if store.rows() != src.rows
                || store.range() != (0, src.rows)
                || store.geometry() != src.geometry
            {
                return Err(EngineError::Layout {
                    what: path.display().to_string(),
                    reason: format!(
                        "a row shard of {} rows ({} bytes each), but `{name}` has {} rows of {} bytes",
                        store.rows(),
                        store.geometry().weight_bytes,
                        src.rows,
                        src.geometry.weight_bytes
                    ),
                });
            }
            stores.push(store);
        }
        Ok(Self {
            stores,
            pending: Vec::new(),
            ahead: Vec::new(),
            stall_ns: 0,
        })
    }

    /// Start reading the rows `per_shard[k]` of each shard `k` into the
    /// caches (returns before the reads finish).
    pub(crate) fn prefetch(&mut self, per_shard: &[Vec<u64>]) -> Result<(), EngineError> {
        let t0 = Instant::now();
        let started = self.start_reads(per_shard);
        self.stall_ns += t0.elapsed().as_nanos() as u64;
        started
    }

    fn start_reads(&mut self, per_shard: &[Vec<u64>]) -> Result<(), EngineError> {
        // The reads started a step ahead land in the caches first, so the
        // rows they bring are not read again.
        self.ahead.drain(..).try_for_each(RowPrefetch::wait)?;
        start_into(&self.stores, per_shard, &mut self.pending)
    }

    /// Start reading the rows `per_shard[k]` of each shard `k` (the next
    /// prompt chunk's) behind this step's reads; the next step's
    /// [`Self::prefetch`] waits for them before it starts its own.
    pub(crate) fn read_ahead(&mut self, per_shard: &[Vec<u64>]) -> Result<(), EngineError> {
        let t0 = Instant::now();
        let started = start_into(&self.stores, per_shard, &mut self.ahead);
        self.stall_ns += t0.elapsed().as_nanos() as u64;
        started
    }

    /// Prefetches started ahead and not yet waited for.
    #[cfg(test)]
    pub(crate) fn ahead_len(&self) -> usize {
        self.ahead.len()
    }

    /// Abandon the reads started ahead (the sequence was reset: its next
    /// chunk will not come).
    pub(crate) fn forget_ahead(&mut self) {
        self.ahead.clear();
    }

    /// Wait for the layer's prefetch, then look up `ids` of shard `k`
    /// into `out` (`ids.len()` rows).
    pub(crate) fn lookup(
        &mut self,
        k: usize,
        ids: &[u64],
        out: &mut [u8],
    ) -> Result<(), EngineError> {
        let t0 = Instant::now();
        let done = self.wait_and_lookup(k, ids, out);
        self.stall_ns += t0.elapsed().as_nanos() as u64;
        done
    }

    fn wait_and_lookup(
        &mut self,
        k: usize,
        ids: &[u64],
        out: &mut [u8],
    ) -> Result<(), EngineError> {
        self.pending.drain(..).try_for_each(RowPrefetch::wait)?;
        let store = self.stores.get(k).ok_or_else(|| EngineError::Shape {
            op: "ple row",
            what: format!("shard {k} of {}", self.stores.len()),
        })?;
        Ok(store.lookup(ids, out, &mut [])?)
    }

    /// The layer's counters.
    pub(crate) fn stats(&self) -> PleRowStats {
        let mut out = PleRowStats {
            stall_ns: self.stall_ns,
            ..Default::default()
        };
        for s in &self.stores {
            let st = s.stats();
            out.hits += st.hits;
            out.misses += st.misses;
            out.bytes_read += st.reads * BLOCK_BYTES;
        }
        out
    }
}

/// The table of the PLE layer whose tensors start `layer_prefix`
/// (`{prefix}.layers.{L}`): its shards are `{stem}.shard_K.weight`.
pub(crate) fn table_stem(layer_prefix: &str) -> String {
    format!("{layer_prefix}.ple.ple_embedding.ngram_embedding")
}

/// The shard tensors of table `stem`: `{stem}.shard_K.weight` for `K` in
/// `0..parts` when the checkpoint splits it, else the one `{stem}.weight`.
pub(crate) fn table_names(ckpt: &CheckpointFiles, stem: &str, parts: usize) -> Vec<String> {
    if ckpt
        .tensors()
        .contains_key(&format!("{stem}.shard_0.weight"))
    {
        (0..parts)
            .map(|k| format!("{stem}.shard_{k}.weight"))
            .collect()
    } else {
        vec![format!("{stem}.weight")]
    }
}

/// `{dir}/layer{L}.shard{K}-{tag}.ftrows` for tensor `name` (see the module docs).
fn shard_path(
    ckpt: &CheckpointFiles,
    name: &str,
    dir: &Path,
    layer: usize,
    k: usize,
) -> Result<PathBuf, EngineError> {
    let missing = || EngineError::MissingTensor {
        name: name.to_string(),
    };
    let info = ckpt.tensors().get(name).ok_or_else(missing)?;
    let file = ckpt.files().get(info.file).ok_or_else(missing)?;
    let mut id = file.header.clone();
    id.extend_from_slice(&file.len_bytes.to_le_bytes());
    id.extend_from_slice(&info.offset.to_le_bytes());
    let tag = xxh3_64(&id);
    Ok(dir.join(format!("layer{layer}.shard{k}-{tag:016x}.ftrows")))
}

#[cfg(test)]
mod tests {
    use super::PleRowStats;

    #[test]
    fn a_prefetched_row_is_a_miss_though_its_lookup_hits() {
        // Every row of the step read ahead, then found by its lookup.
        let s = PleRowStats {
            lookups: 32,
            hits: 32,
            misses: 32,
            bytes_read: 32 * 4096,
            stall_ns: 0,
        };
        assert_eq!(s.hit_rate(), 0.0);
        let half = PleRowStats { misses: 16, ..s };
        assert_eq!(half.hit_rate(), 0.5);
        assert_eq!(PleRowStats::default().hit_rate(), 1.0);
    }
}
