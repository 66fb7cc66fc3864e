//! The KV tier: offload KV-cache blocks to a store file, restore them tile by
//! tile into a scratch pool, and the tiled decode attention that consumes
//! the tiles (CPU reference).
//!
//! - [`swap::KvSwap`] owns one KV store file per (model, rank) (layout in
//!   `docs/kv-format.md`), its per-block generation/checksum table and a
//!   scratch [`flashtier_io::blocks::SlotPool`] of slots laid out
//!   `[slot, K|V, kv_head, token, dim]`. Creating one replaces only a KV
//!   store of the same layout and owner ([`existing`]), through a temp
//!   file renamed into place.
//! - [`restore`]: the pipelined restore, where tile `i + 1..i + depth` land
//!   while tile `i` is consumed.
//! - [`attention`]: `begin_step` / `step_tile` / `finalize`, GQA, both KV
//!   layouts, log-sum-exp state merges.
//!
//! # Durability policy
//! KV blocks are a cache of state the model can recompute; they are never
//! served wrong. Concretely:
//! - an offload clears the block's table entry BEFORE it writes and seals it
//!   (generation + xxh3-64 checksum seeded by the block id and generation)
//!   only AFTER the write completed, so a failed or torn write leaves the
//!   block "not resident", never "valid";
//! - every restore checks, for every block, that the table holds the
//!   generation the caller offloaded (else `Stale`) and that the landed bytes
//!   match the checksum (else `Corrupt`); only then is the slot handed to
//!   attention. A failed read marks its slots failed; attention never runs
//!   over them;
//! - offload does not fsync. [`swap::KvSwap::persist`] syncs the data, then
//!   writes and syncs the table, so a reopened store never claims a block
//!   whose bytes were not durable; whatever a crash tears is caught by the
//!   checksum on restore and reported, and the caller recomputes.
//!
//! ```
//! use flashtier::kv::swap::{KvSwap, SwapOptions};
//! use flashtier_format::kv::{BlockId, BlockOrder, GroupLayout, KvGeometry};
//! use flashtier_io::{AlignedBuf, PosixBackend};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = tempfile::tempdir()?;
//! let geometry = KvGeometry { num_layers: 2, num_blocks: 4, num_kv_heads: 2, block_tokens: 16, head_dim: 64, dtype_bytes: 2 };
//! let layout = GroupLayout::new(geometry, BlockOrder::BlockMajor)?;
//! let backend = std::sync::Arc::new(PosixBackend::new(4)?);
//! let mut swap = KvSwap::create(backend, &dir.path().join("kv.store"), layout, SwapOptions::default())?;
//! let mut block = AlignedBuf::zeroed(layout.block_bytes() as usize);
//! block.fill(0x3f);
//! let version = swap.offload_block(BlockId::new(1, 2), &block)?;
//! let mut seen = 0;
//! swap.restore_tiles(&[vec![version]], |_tile, landed| {
//!     assert!(landed.block_bytes(0)?.iter().all(|&b| b == 0x3f));
//!     seen += 1;
//!     Ok(())
//! })?;
//! assert_eq!(seen, 1);
//! # Ok(()) }
//! ```

pub mod attention;
pub mod error;
pub mod existing;
pub mod restore;
pub mod swap;
pub mod verify;

pub use error::KvError;
