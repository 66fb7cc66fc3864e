//! The decode engine: runs Qwen3-MoE and Mixtral checkpoints at batch 1 on
//! the CPU, with the experts streamed from an [`ExpertSource`] under a memory
//! budget, and output identical to HF transformers (f32 compute from the
//! checkpoint's bf16/f16/f32 weights).
//!
//! - [`ModelConfig`]: `config.json` in transformers 4.x and 5.x spellings;
//!   anything unsupported is an [`EngineError::Config`] naming the field.
//! - [`Checkpoint`]: single or sharded safetensors, headers validated, tensors
//!   read on demand.
//! - [`ModelWeights`]: the non-expert tensors, widened to f32 at load.
//! - [`ExpertSource`]: gate/up/down of (layer, expert); [`CheckpointExperts`]
//!   reads them from the safetensors under a byte budget.
//! - [`Model`]: the forward pass and greedy [`Model::generate`].
//!
//! Streaming never changes results: the kernels reduce in an order fixed by
//! the shapes alone, and every source serves the checkpoint's exact bytes.
//!
//! ```no_run
//! use flashtier::engine::Model;
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let mut model = Model::load(std::path::Path::new("qwen3-moe-dir"), Some(64 << 20))?;
//! let out = model.generate(&[1, 2, 3], 8, &[], false, |t| println!("{t}"))?;
//! println!("{:?} at {:.1} tok/s", out.generated_ids, out.tokens_per_sec());
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
mod pool_source;
mod weights;

pub use attention::{BLOCK_TOKENS, KvCache, KvPrecision, TILE_BLOCKS};
pub use checkpoint::{Checkpoint, DType, ShardFile, TensorInfo, to_f32};
pub use config::{Arch, ModelConfig};
pub use demo_replay::{RecordingBackend, replay};
pub use error::EngineError;
pub use experts::{CheckpointExperts, ExpertSource, ExpertStats, ExpertView, UseExpert};
pub use model::{Generation, Model};
pub use pool_source::{PoolExperts, StreamOptions, open_pool, open_pool_with};
pub use weights::{DenseMlp, LayerWeights, Mlp, ModelWeights};
