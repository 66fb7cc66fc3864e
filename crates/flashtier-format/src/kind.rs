//! Telling flashtier's file kinds apart from their first bytes.
//!
//! Every flashtier file starts with an 8-byte magic: `FTSTORE\0` for a
//! record store (experts, and their low-bit companions, which differ only in
//! the manifest), `FTROWSH1` for a packed row shard (`row_shard`) and
//! `FTKVSTOR` for a KV store (`kv_header`). [`FileKind::sniff`] needs only
//! those [`SNIFF_BYTES`] bytes; the kind's own decoder then validates
//! everything else. A file shorter than the magic is of no kind.

use std::path::{Path, PathBuf};

use crate::header::MAGIC;
use crate::kv::KV_MAGIC;
use crate::row_shard::ROW_SHARD_MAGIC;
use crate::text::hex_bytes;

/// Bytes [`FileKind::sniff`] looks at.
pub const SNIFF_BYTES: usize = 8;

/// The kinds of file flashtier writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FileKind {
    /// A record store (`FTSTORE\0`): experts or a low-bit companion.
    Store,
    /// A packed row shard (`FTROWSH1`).
    RowShard,
    /// A KV store (`FTKVSTOR`).
    KvStore,
}

impl FileKind {
    /// Every kind, in the order they are tried.
    pub const ALL: [Self; 3] = [Self::Store, Self::RowShard, Self::KvStore];

    /// The magic at byte 0 of a file of this kind.
    #[must_use]
    pub const fn magic(self) -> [u8; 8] {
        match self {
            Self::Store => MAGIC,
            Self::RowShard => ROW_SHARD_MAGIC,
            Self::KvStore => KV_MAGIC,
        }
    }

    /// Lower-case name (`store`, `row_shard`, `kv_store`).
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::Store => "store",
            Self::RowShard => "row_shard",
            Self::KvStore => "kv_store",
        }
    }

    /// The kind whose magic `first` starts with, if any.
    #[must_use]
    pub fn sniff(first: &[u8]) -> Option<Self> {
        let head = first.get(..SNIFF_BYTES)?;
        Self::ALL.into_iter().find(|k| head == k.magic())
    }

    /// [`FileKind::sniff`], with an error naming `path` and the bytes found.
    pub fn sniff_path(path: &Path, first: &[u8]) -> Result<Self, UnknownKind> {
        Self::sniff(first).ok_or_else(|| UnknownKind {
            path: path.to_path_buf(),
            found: hex_bytes(first.get(..SNIFF_BYTES).unwrap_or(first)),
        })
    }
}

impl std::fmt::Display for FileKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A file that starts with none of flashtier's magics.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{path}: not a flashtier store, row shard or KV store (first bytes {found}; expected \
     FTSTORE\\0, FTROWSH1 or FTKVSTOR)"
)]
pub struct UnknownKind {
    /// The file.
    pub path: PathBuf,
    /// Its first bytes (up to 8) as hex, or `none` for an empty file.
    pub found: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_magic_is_its_kind() {
        for k in FileKind::ALL {
            let mut bytes = k.magic().to_vec();
            bytes.extend_from_slice(&[0; 100]);
            assert_eq!(FileKind::sniff(&bytes), Some(k));
        }
        assert_eq!(FileKind::sniff(b"FTSTORE"), None);
        assert_eq!(FileKind::sniff(b"FTSTORE\x01"), None);
    }

    #[test]
    fn unknown_bytes_are_named_in_hex() {
        let err = FileKind::sniff_path(Path::new("x.bin"), &[0, 1, 0xff]).expect_err("unknown");
        assert_eq!(err.found, "00 01 ff");
        let msg = err.to_string();
        assert!(
            msg.contains("x.bin") && msg.contains("not a flashtier store"),
            "{msg}"
        );
        let empty = FileKind::sniff_path(Path::new("e"), &[]).expect_err("empty");
        assert_eq!(empty.found, "none");
    }
}
