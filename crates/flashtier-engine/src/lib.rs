//! flashtier's decode engine: the consumer of the tiers. It runs Qwen3-MoE, Qwen2-MoE, Mixtral and DeepSeek-V3 (BF16 or FP8 blocks) checkpoints at batch 1 on
//! the CPU, with the experts streamed from an [`ExpertSource`] under a memory
//! budget, and output identical to HF transformers (f32 compute from the
//! checkpoint's bf16/f16/f32 weights).
//!
//! - [`ModelConfig`]: `config.json` in transformers 4.x and 5.x spellings;
//!   anything unsupported is an [`EngineError::Config`] naming the field.
//! - [`Checkpoint`]: single or sharded safetensors, headers validated, tensors
//!   read on demand (hub per-expert tensors and the transformers-5 fused
//!   `experts.gate_up_proj` / `experts.down_proj` layout).
//! - [`ModelWeights`]: the non-expert tensors, matrices kept as stored
//!   (BF16/F16/F32, or FP8 codes with block scales; see [`Matrix`]),
//!   norms and biases widened to f32.
//! - [`ExpertSource`]: gate/up/down of (layer, expert), served one step at a
//!   time. [`CheckpointExperts`] reads them from the safetensors under a byte
//!   budget; [`PoolExperts`] serves them from a packed expert store through
//!   the expert tier's pool (slots or mapped backing), resident records
//!   first and the others as their reads land, prefetching the next layer's
//!   predicted experts (pre-gating) behind the current misses.
//! - [`KvCache`]: BF16 KV blocks in the KV tier's paged layout; attention
//!   runs through the KV tier's tiled decode attention.
//! - [`Model`]: the forward pass and greedy [`Model::generate`].
//! - [`demo`]: the streamed-vs-I/O-bound demo on a synthetic Qwen3-MoE.
//!
//! Streaming never changes results: the kernels reduce in an order fixed by
//! the shapes alone, expert outputs are summed in ascending expert order
//! whatever order they arrive in, and every source serves the checkpoint's
//! exact bytes.
//!
//! ```
//! use flashtier_engine::Model;
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/engine/mixtral");
//! // Room for the two experts of one step: every other use is a read.
//! let mut model = Model::load(std::path::Path::new(dir), Some(2 * 3 * 64 * 40 * 2))?;
//! let out = model.generate(&[138, 33, 283, 311, 155, 290], 8, &[], false, |t| print!("{t} "))?;
//! assert_eq!(out.generated_ids, [22, 63, 215, 26, 312, 119, 70, 15]);
//! println!("{:.1} tok/s, hit rate {:.2}", out.tokens_per_sec(), out.decode_experts.hit_rate());
//! # Ok(()) }
//! ```

mod attention;
mod checkpoint;
mod config;
pub mod demo;
mod demo_replay;
mod error;
mod experts;
pub mod kernels;
mod model;
pub mod pack;
mod pool_source;
pub mod source;
pub mod synth;
mod weights;

pub use attention::{BLOCK_TOKENS, KvCache, KvPrecision, TILE_BLOCKS};
pub use checkpoint::{Checkpoint, DType, to_f32};
pub use config::{Arch, ModelConfig};
pub use demo_replay::{RecordingBackend, replay};
pub use error::EngineError;
pub use experts::{CheckpointExperts, ExpertSource, ExpertStats, ExpertView, UseExpert};
pub use model::{Generation, Model};
pub use pool_source::{PoolExperts, StreamOptions, open_pool, open_pool_with};
pub use weights::{DenseMlp, LayerWeights, Matrix, Mlp, ModelWeights};
