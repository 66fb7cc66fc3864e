//! Block-granular KV I/O over any [`StorageBackend`].
//!
//! A KV block (all kv heads' K then V groups of one layer, see
//! `flashtier_format::kv`) is read or written as ONE contiguous op instead
//! of `2 * num_kv_heads` per-group ops. The per-group path stays available
//! ([`BlockPath::PerHead`]) for backends or callers that address groups; its
//! ops come from [`expand_block_to_groups`], the single source of the block
//! to per-head fan-out, and tests pin that both paths give identical bytes on
//! disk and in memory.
//!
//! Reads land in a [`SlotPool`]: slots of `block_bytes` in one
//! [`LandingRegion`], laid out `[slot, K|V, kv_head, token, dim]`, with a state
//! per slot so a slot whose read has not landed (or failed) can never be
//! viewed. Spans ([`BlockSpan`]) read several blocks that are consecutive in
//! file order (a run of one layer in the per-layer order, one block of every
//! layer in the block-major order) as one op into consecutive slots.
//!
//! Bounds: one op per span (Coalesced) or `2 * num_kv_heads` ops per block
//! (PerHead); the backend bounds what is in flight (its queue depth); a pool
//! holds at most [`MAX_POOL_BYTES`].

use std::sync::Arc;

use flashtier_format::kv::{BlockId, GroupKey, GroupLayout, KvFormatError, KvKind};

use crate::backend::{Landing, ReadReq, StorageBackend, Ticket};
use crate::error::IoError;
use crate::file::StoreFile;
use crate::region::LandingRegion;

mod pool;

pub use pool::{BatchId, MAX_POOL_BYTES, SlotPool, SlotState};

/// How a block op reaches the backend.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BlockPath {
    /// One contiguous op per block (or per span / run).
    #[default]
    Coalesced,
    /// `2 * num_kv_heads` group ops per block, from [`expand_block_to_groups`].
    PerHead,
}

/// One group op of a fanned-out block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupOp {
    /// The group.
    pub key: GroupKey,
    /// Byte offset of the group in the store file.
    pub file_offset: u64,
    /// Byte offset of the group inside the block image (and inside a slot).
    pub block_offset: usize,
    /// Bytes (`group_stride`, padding included).
    pub len: usize,
}

/// A read of `count` blocks consecutive in file order, starting at `first`,
/// landing in consecutive slots starting at `slot`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockSpan {
    /// First block of the span.
    pub first: BlockId,
    /// Blocks in the span (>= 1).
    pub count: u32,
    /// First slot the span lands in.
    pub slot: usize,
}

pub(crate) fn layout_err(e: &KvFormatError) -> IoError {
    IoError::Invalid(format!("KV layout: {e}"))
}

fn to_usize(x: u64) -> Result<usize, IoError> {
    usize::try_from(x).map_err(|_| IoError::Invalid(format!("{x} bytes exceed usize")))
}

/// The per-head fan-out of one block: its `2 * num_kv_heads` group ops in the
/// order the per-head path issues them (`K(h), V(h)` for `h` in
/// `0..num_kv_heads`), each with its file offset and its offset inside the
/// block image. The single source of this mapping.
pub fn expand_block_to_groups(layout: &GroupLayout, id: BlockId) -> Result<Vec<GroupOp>, IoError> {
    let nkv = layout.geometry().num_kv_heads;
    let len = to_usize(layout.group_stride())?;
    let block = layout.block_extent(id).map_err(|e| layout_err(&e))?;
    let mut ops = Vec::with_capacity(2 * nkv as usize);
    for kv_head in 0..nkv {
        for kind in [KvKind::K, KvKind::V] {
            let key = GroupKey::new(id.layer, id.block, kv_head, kind);
            let ext = layout.group_extent(key).map_err(|e| layout_err(&e))?;
            ops.push(GroupOp {
                key,
                file_offset: ext.offset,
                block_offset: to_usize(ext.offset - block.offset)?,
                len,
            });
        }
    }
    Ok(ops)
}

/// The blocks of a span, in file order, each with its slot.
fn span_blocks(layout: &GroupLayout, span: &BlockSpan) -> Result<Vec<(BlockId, usize)>, IoError> {
    if span.count == 0 {
        return Err(IoError::Invalid("block span of 0 blocks".into()));
    }
    let first = layout.file_index(span.first).map_err(|e| layout_err(&e))?;
    (0..span.count)
        .map(|i| {
            let id = layout
                .block_at(first + u64::from(i))
                .map_err(|e| layout_err(&e))?;
            Ok((id, span.slot + i as usize))
        })
        .collect()
}

/// The read requests for `spans` landing in `region` at `slot_bytes` pitch
/// (slot `s` at byte `s * slot_bytes`). Tags are span indexes.
pub fn span_read_reqs(
    file: &Arc<StoreFile>,
    layout: &GroupLayout,
    region: &Arc<LandingRegion>,
    spans: &[BlockSpan],
    path: BlockPath,
) -> Result<Vec<ReadReq>, IoError> {
    let block_bytes = to_usize(layout.block_bytes())?;
    let mut reqs = Vec::new();
    for (tag, span) in spans.iter().enumerate() {
        let tag = tag as u64;
        let blocks = span_blocks(layout, span)?;
        let landing_at = |slot: usize, extra: usize| Landing::Region {
            region: region.clone(),
            offset: slot * block_bytes + extra,
        };
        match path {
            BlockPath::Coalesced => {
                let ext = layout
                    .block_extent(span.first)
                    .map_err(|e| layout_err(&e))?;
                reqs.push(ReadReq {
                    file: file.clone(),
                    offset: ext.offset,
                    len: block_bytes * blocks.len(),
                    landing: landing_at(span.slot, 0),
                    tag,
                });
            }
            BlockPath::PerHead => {
                for (id, slot) in blocks {
                    for op in expand_block_to_groups(layout, id)? {
                        reqs.push(ReadReq {
                            file: file.clone(),
                            offset: op.file_offset,
                            len: op.len,
                            landing: landing_at(slot, op.block_offset),
                            tag,
                        });
                    }
                }
            }
        }
    }
    Ok(reqs)
}

/// Write one block image (`block_bytes`, `[K heads.., V heads..]` at
/// `group_stride` pitch): one op, or the per-head fan-out. Both give the
/// same on-disk image.
pub fn write_block<B: StorageBackend + ?Sized>(
    backend: &B,
    file: &StoreFile,
    layout: &GroupLayout,
    id: BlockId,
    src: &[u8],
    path: BlockPath,
) -> Result<(), IoError> {
    let block_bytes = to_usize(layout.block_bytes())?;
    if src.len() != block_bytes {
        return Err(IoError::Invalid(format!(
            "write_block ({}, {}): source holds {} bytes, a block is {block_bytes}",
            id.layer,
            id.block,
            src.len()
        )));
    }
    match path {
        BlockPath::Coalesced => {
            let ext = layout.block_extent(id).map_err(|e| layout_err(&e))?;
            backend.write(file, ext.offset, src)
        }
        BlockPath::PerHead => {
            for op in expand_block_to_groups(layout, id)? {
                let part = src
                    .get(op.block_offset..op.block_offset + op.len)
                    .ok_or_else(|| IoError::Invalid("group outside its block".into()))?;
                backend.write(file, op.file_offset, part)?;
            }
            Ok(())
        }
    }
}

/// Write `run_len` consecutive blocks of one layer from `first`. With
/// [`BlockPath::Coalesced`] and a layout that makes the run contiguous
/// (per-layer order) it is ONE op; otherwise it is exactly the ops of
/// `run_len` [`write_block`] calls, in block order. Returns the ops issued.
pub fn write_blocks_run<B: StorageBackend + ?Sized>(
    backend: &B,
    file: &StoreFile,
    layout: &GroupLayout,
    first: BlockId,
    run_len: u32,
    src: &[u8],
    path: BlockPath,
) -> Result<usize, IoError> {
    let block_bytes = to_usize(layout.block_bytes())?;
    let run = layout
        .run_extent(first, run_len)
        .map_err(|e| layout_err(&e))?;
    let want = block_bytes * run_len as usize;
    if src.len() != want {
        return Err(IoError::Invalid(format!(
            "write_blocks_run ({}, {}) x {run_len}: source holds {} bytes, the run is {want}",
            first.layer,
            first.block,
            src.len()
        )));
    }
    if let (BlockPath::Coalesced, Some(ext)) = (path, run) {
        backend.write(file, ext.offset, src)?;
        return Ok(1);
    }
    let per_block = match path {
        BlockPath::Coalesced => 1,
        BlockPath::PerHead => 2 * layout.geometry().num_kv_heads as usize,
    };
    for (i, chunk) in src.chunks_exact(block_bytes).enumerate() {
        let id = BlockId::new(first.layer, first.block + i as u32);
        write_block(backend, file, layout, id, chunk, path)?;
    }
    Ok(per_block * run_len as usize)
}

/// Write `count` blocks consecutive in FILE order from `first` (a run of one
/// layer in the per-layer order; whole columns of every layer in the
/// block-major order). Coalesced: ONE op; per-head: the fan-out of every
/// block. Returns the ops issued.
pub fn write_span<B: StorageBackend + ?Sized>(
    backend: &B,
    file: &StoreFile,
    layout: &GroupLayout,
    first: BlockId,
    count: u32,
    src: &[u8],
    path: BlockPath,
) -> Result<usize, IoError> {
    let block_bytes = to_usize(layout.block_bytes())?;
    let span = BlockSpan {
        first,
        count,
        slot: 0,
    };
    let blocks = span_blocks(layout, &span)?;
    if src.len() != block_bytes * blocks.len() {
        return Err(IoError::Invalid(format!(
            "write_span ({}, {}) x {count}: source holds {} bytes, the span is {}",
            first.layer,
            first.block,
            src.len(),
            block_bytes * blocks.len()
        )));
    }
    if path == BlockPath::Coalesced {
        let ext = layout.block_extent(first).map_err(|e| layout_err(&e))?;
        backend.write(file, ext.offset, src)?;
        return Ok(1);
    }
    for ((id, _), chunk) in blocks.iter().zip(src.chunks_exact(block_bytes)) {
        write_block(backend, file, layout, *id, chunk, path)?;
    }
    Ok(blocks.len() * 2 * layout.geometry().num_kv_heads as usize)
}

/// Start reading `spans` into `region` at `block_bytes` pitch. The caller owns
/// the region protocol (no view of a landing slot before the ticket lands);
/// [`SlotPool`] wraps this with per-slot state.
pub fn read_blocks_async<B: StorageBackend + ?Sized>(
    backend: &B,
    file: &Arc<StoreFile>,
    layout: &GroupLayout,
    region: &Arc<LandingRegion>,
    spans: &[BlockSpan],
    path: BlockPath,
) -> Result<Ticket, IoError> {
    let reqs = span_read_reqs(file, layout, region, spans, path)?;
    backend.read_async(reqs)
}

/// [`read_blocks_async`] and wait.
pub fn read_blocks<B: StorageBackend + ?Sized>(
    backend: &B,
    file: &Arc<StoreFile>,
    layout: &GroupLayout,
    region: &Arc<LandingRegion>,
    spans: &[BlockSpan],
    path: BlockPath,
) -> Result<(), IoError> {
    read_blocks_async(backend, file, layout, region, spans, path)?
        .wait()
        .map(|_| ())
}
