//! A read-only file mapping locked in RAM (`mmap` + `mlock`), for the row
//! store's RAM mode: the whole table resident, no read ever reaches the drive.
//!
//! Bounds: the mapping is exactly the file's length at open time and is
//! locked in full or not at all. When the kernel refuses the lock, the error
//! names the `RLIMIT_MEMLOCK` soft limit and the bytes that were needed, so
//! the operator knows which limit to raise (`ulimit -l`, `LimitMEMLOCK=`).
//!
//! Contract: the file must not be truncated or rewritten while mapped (store
//! files are immutable once packed); a truncation would fault on access.

use std::fs::File;
use std::path::{Path, PathBuf};

/// Mapping or locking a file failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LockError {
    /// The file could not be opened or its length read.
    #[error("open {path}: {source}")]
    Open {
        /// File.
        path: PathBuf,
        /// OS error.
        source: std::io::Error,
    },
    /// The path names a FIFO, device or directory (refused before opening).
    #[error(transparent)]
    NotRegular(flashtier_format::OpenError),
    /// The file could not be mapped.
    #[error("mmap {path} ({len_bytes} bytes): {source}")]
    Map {
        /// File.
        path: PathBuf,
        /// Bytes to map.
        len_bytes: u64,
        /// OS error.
        source: std::io::Error,
    },
    /// The kernel refused to lock the mapping in RAM.
    #[error(
        "mlock {path}: locking {needed_bytes} bytes in RAM was refused ({source}); RLIMIT_MEMLOCK soft limit is {}; raise it (ulimit -l / LimitMEMLOCK=) to at least {needed_bytes} bytes or leave RAM mode",
        limit_text(*limit_bytes)
    )]
    MemlockRefused {
        /// File.
        path: PathBuf,
        /// Bytes that needed locking.
        needed_bytes: u64,
        /// The RLIMIT_MEMLOCK soft limit (`None` = unlimited).
        limit_bytes: Option<u64>,
        /// OS error.
        source: std::io::Error,
    },
}

fn limit_text(limit: Option<u64>) -> String {
    limit.map_or_else(|| "unlimited".to_string(), |b| format!("{b} bytes"))
}

/// The current `RLIMIT_MEMLOCK` soft limit in bytes (`None` = unlimited).
#[must_use]
pub fn memlock_limit_bytes() -> Option<u64> {
    rustix::process::getrlimit(rustix::process::Resource::Memlock).current
}

/// A read-only mapping of a whole file, locked in RAM.
pub struct LockedMap {
    map: Option<memmap2::Mmap>,
    path: PathBuf,
}

impl LockedMap {
    /// Map `path` read-only, fault it in, and lock it in RAM.
    pub fn open(path: &Path) -> Result<Self, LockError> {
        let file = flashtier_format::open_regular_read(path).map_err(|e| match e {
            flashtier_format::OpenError::Os { path, source } => LockError::Open { path, source },
            other => LockError::NotRegular(other),
        })?;
        Self::from_file(&file, path)
    }

    /// Map and lock an already open `file` (named `path` in errors).
    pub fn from_file(file: &File, path: &Path) -> Result<Self, LockError> {
        let len_bytes = file
            .metadata()
            .map_err(|source| LockError::Open {
                path: path.to_path_buf(),
                source,
            })?
            .len();
        if len_bytes == 0 {
            return Ok(Self {
                map: None,
                path: path.to_path_buf(),
            });
        }
        // SAFETY: the mapping is read-only and private to this value; the
        // module contract (store files are immutable while mapped) rules out
        // a concurrent truncation, the one way a file mapping can fault.
        let map =
            unsafe { memmap2::MmapOptions::new().populate().map(file) }.map_err(|source| {
                LockError::Map {
                    path: path.to_path_buf(),
                    len_bytes,
                    source,
                }
            })?;
        map.lock().map_err(|source| LockError::MemlockRefused {
            path: path.to_path_buf(),
            needed_bytes: len_bytes,
            limit_bytes: memlock_limit_bytes(),
            source,
        })?;
        Ok(Self {
            map: Some(map),
            path: path.to_path_buf(),
        })
    }

    /// The mapped bytes.
    #[must_use]
    pub fn bytes(&self) -> &[u8] {
        self.map.as_deref().unwrap_or(&[])
    }

    /// Mapped length in bytes.
    #[must_use]
    pub fn len_bytes(&self) -> usize {
        self.bytes().len()
    }

    /// The mapped file.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl std::fmt::Debug for LockedMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LockedMap")
            .field("path", &self.path)
            .field("len_bytes", &self.len_bytes())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_exact_bytes_or_names_the_limit() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("t.bin");
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
        std::fs::write(&path, &data).expect("write");
        match LockedMap::open(&path) {
            Ok(m) => assert_eq!(m.bytes(), &data[..]),
            Err(LockError::MemlockRefused { needed_bytes, .. }) => {
                assert_eq!(needed_bytes, 10_000);
            }
            Err(e) => panic!("unexpected error: {e}"),
        }
    }

    #[test]
    fn empty_file_maps_empty() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("e.bin");
        std::fs::write(&path, b"").expect("write");
        assert!(LockedMap::open(&path).expect("empty").bytes().is_empty());
    }

    #[test]
    fn refusal_message_names_limit_and_bytes() {
        let e = LockError::MemlockRefused {
            path: "/x/table.bin".into(),
            needed_bytes: 1 << 30,
            limit_bytes: Some(65536),
            source: std::io::Error::from_raw_os_error(libc::ENOMEM),
        };
        let s = e.to_string();
        assert!(
            s.contains("RLIMIT_MEMLOCK") && s.contains("65536 bytes") && s.contains("1073741824"),
            "{s}"
        );
    }

    #[test]
    fn missing_file_is_open_error() {
        assert!(matches!(
            LockedMap::open(Path::new("/nonexistent/flashtier/x")),
            Err(LockError::Open { .. })
        ));
    }
}
