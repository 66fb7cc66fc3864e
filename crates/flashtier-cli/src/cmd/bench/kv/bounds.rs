//! Limits on what the flags of `flashtier bench kv` set, checked by
//! [`check_bounds`] before anything is allocated (a [`Limit`] error naming
//! the flags): `--layers` at most [`MAX_LAYERS`]; `--block-tokens` at most
//! [`MAX_BLOCK_TOKENS`]; one block (`--block-tokens x --kv-heads x
//! --head-dim` BF16 values of K and of V) at most [`MAX_BLOCK_BYTES`], so
//! the write bank of [`SPAN_BLOCKS`] blocks stays within 1 GiB; the restore
//! ring (`--ring x --tile-blocks x --layers` blocks) at most
//! [`MAX_RING_BYTES`]; the queries (`--layers x --q-heads x --head-dim`
//! f32) at most [`MAX_QUERY_BYTES`].

use super::Args;
use crate::kit::limit::{Limit, at_most};

/// Blocks written per offload op (a 4 MiB span at 64 KiB blocks).
pub const SPAN_BLOCKS: u64 = 64;

/// Most layers.
pub const MAX_LAYERS: u64 = 4096;

/// Most tokens per block.
pub const MAX_BLOCK_TOKENS: u64 = 4096;

/// Most bytes of one block (K and V of every KV head).
pub const MAX_BLOCK_BYTES: u64 = 16 << 20;

/// Most bytes of the restore ring's tiles.
pub const MAX_RING_BYTES: u64 = 16 << 30;

/// Most bytes of the per-layer queries.
pub const MAX_QUERY_BYTES: u64 = 1 << 30;

/// The limits of the module docs.
pub fn check_bounds(args: &Args) -> Result<(), Limit> {
    let layers = u64::from(args.layers);
    at_most("--layers", &[layers], MAX_LAYERS, "layers")?;
    let bt = u64::from(args.block_tokens);
    at_most("--block-tokens", &[bt], MAX_BLOCK_TOKENS, "tokens")?;
    let block = at_most(
        "one KV block (--block-tokens x --kv-heads x --head-dim, BF16 K and V)",
        &[
            bt,
            u64::from(args.kv_heads),
            u64::from(args.head_dim),
            2 * 2,
        ],
        MAX_BLOCK_BYTES,
        "bytes",
    )?;
    at_most(
        "the restore ring (--ring x --tile-blocks x --layers blocks)",
        &[
            args.ring.max(1) as u64,
            u64::from(args.tile_blocks.max(1)),
            layers,
            block,
        ],
        MAX_RING_BYTES,
        "bytes",
    )?;
    at_most(
        "the queries (--layers x --q-heads x --head-dim f32)",
        &[layers, u64::from(args.q_heads), u64::from(args.head_dim), 4],
        MAX_QUERY_BYTES,
        "bytes",
    )?;
    Ok(())
}
