//! The typed failures of KV geometry, addressing and headers.

use crate::text::hex_bytes;

/// Typed failures of KV geometry, addressing and headers.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum KvFormatError {
    /// A geometry field is zero or out of its range.
    #[error("KV geometry field {field} = {value} is invalid")]
    BadField {
        /// Field name.
        field: &'static str,
        /// Its value.
        value: u64,
    },
    /// Sizes overflow 64-bit byte offsets.
    #[error("KV geometry overflows 64-bit offsets")]
    Overflow,
    /// A block id outside the store.
    #[error(
        "block (layer {layer}, block {block}) outside the store ({num_layers} layers x {num_blocks} blocks)"
    )]
    BlockOutOfRange {
        /// Layer asked for.
        layer: u32,
        /// Block asked for.
        block: u32,
        /// Layers in the store.
        num_layers: u32,
        /// Blocks per layer in the store.
        num_blocks: u32,
    },
    /// A kv head outside the store.
    #[error("kv head {kv_head} outside 0..{num_kv_heads}")]
    HeadOutOfRange {
        /// Head asked for.
        kv_head: u32,
        /// Heads in the store.
        num_kv_heads: u32,
    },
    /// Header bytes too short.
    #[error("KV header truncated: {got} bytes, need {need}")]
    Truncated {
        /// Bytes available.
        got: usize,
        /// Bytes required.
        need: usize,
    },
    /// Not a KV store.
    #[error("bad KV store magic {} (expected FTKVSTOR)", hex_bytes(found))]
    BadMagic {
        /// The magic found.
        found: [u8; 8],
    },
    /// A version this build does not read.
    #[error("KV store version {found} unsupported (this build reads {supported})")]
    BadVersion {
        /// Version found.
        found: u32,
        /// Version supported.
        supported: u32,
    },
    /// The header checksum does not match.
    #[error("KV header checksum mismatch: stored {stored:#018x}, computed {computed:#018x}")]
    HeaderChecksum {
        /// Stored value.
        stored: u64,
        /// Computed value.
        computed: u64,
    },
    /// A derived header field disagrees with the geometry.
    #[error("KV header field {field} = {found} disagrees with its geometry ({expected})")]
    Inconsistent {
        /// Field name.
        field: &'static str,
        /// Stored value.
        found: u64,
        /// Value the geometry implies.
        expected: u64,
    },
}
