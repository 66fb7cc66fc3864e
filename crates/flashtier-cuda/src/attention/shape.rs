//! The attention problem's shape, the KV shape it gives the stride triples
//! of `flashtier_format::kv::KvStrides`, and the validated device tile table.

use cudarc::driver::CudaSlice;
use flashtier_format::kv::KvShape;
pub use flashtier_format::kv::MAX_HEAD_DIM;

use crate::error::CudaError;

/// Largest number of sequences in one step (a grid dimension).
pub const MAX_SEQS: usize = 65_535;

/// Shape of the attention problem, fixed for the life of a [`DecodeAttention`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct AttnDims {
    /// Most sequences in one step.
    pub max_seqs: usize,
    /// Query heads.
    pub num_q_heads: usize,
    /// KV heads (divides `num_q_heads`).
    pub num_kv_heads: usize,
    /// Head dimension (multiple of 16, at most 256).
    pub head_dim: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Most blocks per sequence in one tile.
    pub tile_capacity: usize,
}

impl AttnDims {
    /// Check every dimension; a clear error instead of a wrong answer.
    pub fn validate(&self) -> Result<(), CudaError> {
        let bad = |why: String| Err(CudaError::invalid("attention dims", why));
        if self.max_seqs == 0 || self.max_seqs > MAX_SEQS {
            return bad(format!("max_seqs {} outside 1..={MAX_SEQS}", self.max_seqs));
        }
        if self.num_kv_heads == 0 || self.num_q_heads == 0 {
            return bad("zero heads".into());
        }
        if self.num_q_heads % self.num_kv_heads != 0 {
            return bad(format!(
                "num_q_heads {} is not a multiple of num_kv_heads {}",
                self.num_q_heads, self.num_kv_heads
            ));
        }
        if self.head_dim == 0 || self.head_dim > MAX_HEAD_DIM || self.head_dim % 16 != 0 {
            return bad(format!(
                "head_dim {} (the GPU kernel takes multiples of 16 up to {MAX_HEAD_DIM})",
                self.head_dim
            ));
        }
        if self.block_size == 0 || self.tile_capacity == 0 {
            return bad("zero block_size or tile_capacity".into());
        }
        let tokens = self.block_size.checked_mul(self.tile_capacity);
        if tokens.is_none_or(|t| t > i32::MAX as usize / 2) {
            return bad("block_size * tile_capacity overflows".into());
        }
        let kv_groups = self.num_kv_heads * self.group().div_ceil(16);
        if kv_groups > 65_535 {
            return bad(format!(
                "{kv_groups} kv-head groups exceed a grid dimension"
            ));
        }
        Ok(())
    }

    /// Query heads per KV head.
    #[must_use]
    pub fn group(&self) -> usize {
        self.num_q_heads / self.num_kv_heads.max(1)
    }
}

impl From<&AttnDims> for KvShape {
    fn from(d: &AttnDims) -> Self {
        Self {
            num_kv_heads: d.num_kv_heads,
            block_tokens: d.block_size,
            head_dim: d.head_dim,
        }
    }
}

/// One tile of KV blocks per sequence, on the device and validated.
#[derive(Debug)]
pub struct TileTable {
    pub(super) blocks: CudaSlice<i32>,
    pub(super) tokens: CudaSlice<i32>,
    pub(super) num_seqs: usize,
    pub(super) max_tokens: usize,
    pub(super) max_block: usize,
}

impl TileTable {
    /// Sequences in this tile.
    #[must_use]
    pub fn num_seqs(&self) -> usize {
        self.num_seqs
    }
    /// Most tokens of one sequence in this tile.
    #[must_use]
    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }
}

pub(super) fn tile_tokens(
    d: &AttnDims,
    seq: usize,
    count: usize,
    last: usize,
) -> Result<usize, CudaError> {
    if count > d.tile_capacity {
        return Err(CudaError::invalid(
            "tile",
            format!(
                "sequence {seq}: {count} blocks exceed tile_capacity {}",
                d.tile_capacity
            ),
        ));
    }
    if count == 0 {
        return Ok(0);
    }
    if last == 0 || last > d.block_size {
        return Err(CudaError::invalid(
            "tile",
            format!(
                "sequence {seq}: last_block_valid_slots {last} outside 1..={}",
                d.block_size
            ),
        ));
    }
    Ok((count - 1) * d.block_size + last)
}
