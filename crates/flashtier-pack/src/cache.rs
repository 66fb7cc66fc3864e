//! The store cache: where `flashtier run` keeps the expert store it packs
//! from a checkpoint given without `--store`, so the engine's one expert
//! source (the pool over a packed store) also serves plain checkpoints.
//!
//! Location: `$FLASHTIER_CACHE`, else `$XDG_CACHE_HOME/flashtier`, else
//! `$HOME/.cache/flashtier`; stores live in its `stores/` folder, one per
//! checkpoint folder, named `{folder name}-{xxh3 of the canonical path}.ftstore`.
//! A cached store is reused only while it pairs with the checkpoint
//! ([`flashtier_engine::store::check_pairing`]: config checksum, file lengths, header
//! checksums); otherwise it is packed again. Packing is the packer's own
//! (bounded memory, temporary file renamed into place when complete).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use flashtier_format::{Store, xxh3_64};

use crate::pack::{PackOptions, PackReport, pack_experts, plan_experts, planned_bytes};
use flashtier_engine::checkpoint::files::CheckpointFiles;
use flashtier_engine::config::qwen4::Qwen4Config;
use flashtier_engine::config::{ModelConfig, bounds};
use flashtier_engine::error::EngineError;
use flashtier_engine::store::check_pairing;

/// What [`StoreCache::ensure`] found or did.
#[derive(Clone, Debug)]
pub enum CachedStore {
    /// A store packed earlier from this checkpoint.
    Reused(PathBuf),
    /// Packed now.
    Packed(PackReport),
}

impl CachedStore {
    /// The store file.
    pub fn path(&self) -> &Path {
        match self {
            CachedStore::Reused(p) => p,
            CachedStore::Packed(r) => &r.out,
        }
    }
}

/// A folder of expert stores packed from checkpoints.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreCache {
    dir: PathBuf,
}

impl StoreCache {
    /// A cache in `dir`.
    pub fn at(dir: &Path) -> Self {
        Self {
            dir: dir.to_path_buf(),
        }
    }

    /// The default location (see the module docs), or `None` when neither
    /// `FLASHTIER_CACHE`, `XDG_CACHE_HOME` nor `HOME` is set.
    pub fn default_location() -> Option<Self> {
        let dir = flashtier_engine::settings::cache_dir(&flashtier_io::settings::Env::process())?;
        Some(Self { dir })
    }

    /// The cache folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where the store of the checkpoint in `model` lives.
    pub fn path_for(&self, model: &Path) -> Result<PathBuf, EngineError> {
        let canonical = model.canonicalize().map_err(|source| EngineError::Io {
            path: model.to_path_buf(),
            source,
        })?;
        let name = canonical
            .file_name()
            .map_or_else(|| "model".into(), |n| n.to_string_lossy().into_owned());
        let hash = xxh3_64(canonical.as_os_str().as_encoded_bytes());
        Ok(self
            .dir
            .join("stores")
            .join(format!("{name}-{hash:016x}.ftstore")))
    }

    /// The store of `model`: the cached one while it pairs with the
    /// checkpoint, else packed now (`progress(done, total)` sees the bytes
    /// packed of the planned total).
    pub fn ensure(
        &self,
        model: &Path,
        progress: &(dyn Fn(u64, u64) + Sync),
    ) -> Result<CachedStore, EngineError> {
        let path = self.path_for(model)?;
        if path.exists() && pairs(&path, model)? {
            return Ok(CachedStore::Reused(path));
        }
        let ckpt = CheckpointFiles::open(model)?;
        // A config the checkpoint contradicts is refused before anything is packed.
        // (Qwen4-Exp's own config is checked against its tensors at load.)
        if Qwen4Config::is_qwen4(ckpt.config()) {
            Qwen4Config::from_json(ckpt.config())?;
        } else {
            bounds::check_source(&ModelConfig::from_json(ckpt.config())?, &ckpt)?;
        }
        let (_, manifest) = plan_experts(&ckpt)?;
        drop(ckpt);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|source| EngineError::Io {
                path: parent.to_path_buf(),
                source,
            })?;
        }
        let total = planned_bytes(&manifest);
        let done = AtomicU64::new(0);
        // Two runs of one checkpoint: the second waits for the first's
        // pack and keeps its store.
        let mut opts = PackOptions::new(model, &path);
        opts.reuse_existing = true;
        let report = pack_experts(&opts, &|n| {
            progress(done.fetch_add(n, Ordering::Relaxed) + n, total);
        })?;
        Ok(if report.reused {
            CachedStore::Reused(report.out)
        } else {
            CachedStore::Packed(report)
        })
    }
}

/// Whether the store at `path` was packed from the checkpoint in `model`
/// (a store that cannot be read at all counts as stale and is repacked).
fn pairs(path: &Path, model: &Path) -> Result<bool, EngineError> {
    let Ok(store) = Store::open(path) else {
        return Ok(false);
    };
    let ckpt = CheckpointFiles::open(model)?;
    Ok(check_pairing(&store, &ckpt).is_ok())
}
