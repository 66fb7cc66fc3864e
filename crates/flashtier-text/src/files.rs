//! Bounded reads of a model folder's files.
//!
//! Invariants: a file is read only if `metadata` says it is a regular file
//! (a FIFO would block the reader forever, a device node could stream
//! without end) and its size is at most the cap; the read itself stops at
//! `cap + 1` bytes, so a file that grows between the check and the read is
//! still refused rather than read past its cap.

use std::fs::File;
use std::io::Read;
use std::path::Path;

use serde_json::Value;

use crate::error::{Result, TextError};

/// The cap on every JSON config file (tokenizer_config.json, config.json,
/// generation_config.json) and on `chat_template.jinja`.
pub const MAX_CONFIG_BYTES: u64 = 64 << 20;

/// The cap on `tokenizer.json` (large vocabularies run to tens of MiB).
pub const MAX_TOKENIZER_BYTES: u64 = 256 << 20;

/// Reads a whole regular file of at most `limit_bytes` bytes.
pub(crate) fn read_capped(path: &Path, limit_bytes: u64) -> Result<Vec<u8>> {
    let io = |source| TextError::Io {
        path: path.to_path_buf(),
        source,
    };
    let meta = std::fs::metadata(path).map_err(io)?;
    if !meta.is_file() {
        return Err(TextError::NotRegularFile {
            path: path.to_path_buf(),
        });
    }
    if meta.len() > limit_bytes {
        return Err(TextError::TooLarge {
            path: path.to_path_buf(),
            len_bytes: meta.len(),
            limit_bytes,
        });
    }
    let file = File::open(path).map_err(io)?;
    // Reserve what metadata promised (at most the cap), then read at most
    // one byte past the cap to see a file that grew after the check.
    let mut bytes = Vec::with_capacity(usize::try_from(meta.len()).unwrap_or(0));
    file.take(limit_bytes.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(io)?;
    let len_bytes = bytes.len() as u64;
    if len_bytes > limit_bytes {
        return Err(TextError::TooLarge {
            path: path.to_path_buf(),
            len_bytes,
            limit_bytes,
        });
    }
    Ok(bytes)
}

/// Reads a UTF-8 text file under [`MAX_CONFIG_BYTES`].
pub(crate) fn read_text(path: &Path) -> Result<String> {
    let bytes = read_capped(path, MAX_CONFIG_BYTES)?;
    String::from_utf8(bytes).map_err(|err| TextError::Io {
        path: path.to_path_buf(),
        source: std::io::Error::new(std::io::ErrorKind::InvalidData, err.utf8_error()),
    })
}

/// Reads and parses a JSON file under [`MAX_CONFIG_BYTES`]; `Ok(None)` when
/// the file does not exist (every config file but tokenizer.json is
/// optional).
pub(crate) fn read_json_if_present(path: &Path) -> Result<Option<Value>> {
    match std::fs::symlink_metadata(path) {
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(TextError::Io {
                path: path.to_path_buf(),
                source,
            });
        }
        Ok(_) => {}
    }
    let bytes = read_capped(path, MAX_CONFIG_BYTES)?;
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|source| TextError::Json {
            path: path.to_path_buf(),
            source,
        })
}

/// Whether `path` exists (a dangling symlink counts: reading it then
/// reports the error with the path).
pub(crate) fn exists(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok()
}
