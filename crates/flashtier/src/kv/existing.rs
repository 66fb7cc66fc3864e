//! What [`super::swap::KvSwap::create`] may replace at its path.
//!
//! Nothing, or a KV store of the same layout (geometry and block order) and
//! the same owner (model hash and rank): its blocks are a cache the caller is
//! starting afresh. A KV store whose header no longer decodes (a torn write)
//! is its own kind, damaged, and may be replaced too, as the packers replace
//! a damaged store of their kind. Anything else (a file without the KV
//! magic, a directory, a KV store of another geometry, model or rank) is
//! [`PersistError::NotReplaceable`] and is left as it is.

use flashtier_format::kv::{KV_HEADER_BYTES, KV_MAGIC, KvHeader};
use flashtier_io::persist::{Existing, FileKind, Output};
use flashtier_io::{DirectMode, PersistError, StoreFile};

use super::error::KvError;

/// The kind of file a KV store is, for [`flashtier_io::persist`].
pub const KV_STORE_KIND: FileKind = FileKind {
    name: "flashtier KV store of this layout, model and rank",
    magic: &KV_MAGIC,
};

/// Refuse, under `out`'s lock, an existing file at its target that `create`
/// must not replace with a store whose header is `want`.
pub(super) fn check_replaceable(out: &Output, want: &KvHeader) -> Result<(), KvError> {
    if out.existing(KV_STORE_KIND)? == Existing::Absent {
        return Ok(());
    }
    let path = out.target();
    let file = StoreFile::open_read(path, DirectMode::Off)?;
    if file.len_bytes()? < KV_HEADER_BYTES as u64 {
        return Ok(());
    }
    let mut page = vec![0u8; KV_HEADER_BYTES];
    file.read_exact_at(&mut page, 0)?;
    let Ok(found) = KvHeader::decode(&page) else {
        return Ok(());
    };
    if found == *want {
        return Ok(());
    }
    Err(PersistError::NotReplaceable {
        path: path.to_path_buf(),
        expected: KV_STORE_KIND.name,
        found: format!("it is a KV store of {}", describe(&found)),
    }
    .into())
}

/// A KV store's layout and owner in words.
pub(super) fn describe(h: &KvHeader) -> String {
    let g = h.layout.geometry();
    format!(
        "{} layers x {} blocks x {} KV heads x {} tokens x {} dims of {} bytes, {}, model {:#x} rank {}",
        g.num_layers,
        g.num_blocks,
        g.num_kv_heads,
        g.block_tokens,
        g.head_dim,
        g.dtype_bytes,
        h.layout.order(),
        h.model_hash,
        h.rank
    )
}

#[cfg(test)]
mod tests {
    use flashtier_format::kv::{BlockOrder, GroupLayout, KvGeometry};

    use super::*;

    #[test]
    fn a_header_is_described_in_words() {
        let geometry = KvGeometry {
            num_layers: 2,
            num_blocks: 4,
            num_kv_heads: 1,
            block_tokens: 16,
            head_dim: 64,
            dtype_bytes: 2,
        };
        let h = KvHeader {
            layout: GroupLayout::new(geometry, BlockOrder::PerLayer).expect("layout"),
            model_hash: 0x4d,
            rank: 1,
        };
        assert_eq!(
            describe(&h),
            "2 layers x 4 blocks x 1 KV heads x 16 tokens x 64 dims of 2 bytes, per-layer, model 0x4d rank 1"
        );
    }
}
