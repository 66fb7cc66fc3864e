//! flashtier's decode engine, the consumer of the tiers: Qwen3-MoE,
//! Qwen2-MoE, Mixtral and DeepSeek-V3 (BF16, or the hub's FP8 blocks)
//! checkpoints decoded at batch 1, with the experts streamed from a packed
//! store through the expert pool under a memory budget, and output matching
//! HF transformers (f32 activations and accumulation over the checkpoint's
//! stored weights).
//!
//! Shape: model families x devices. A family ([`family`]) describes its
//! forward pass once as [`device::Device`] operations; a device supplies
//! kernels and memory ([`device::cpu::CpuDevice`], the reference; the CUDA
//! device implements the same trait). The tiers feed both.
//!
//! - [`config::ModelConfig`]: `config.json` in transformers 4.x and 5.x
//!   spellings; anything unsupported is an [`EngineError::Config`] naming
//!   the field.
//! - [`checkpoint::Checkpoint`]: single or sharded safetensors, tensors
//!   checked against the config and read on demand through the I/O seam,
//!   over the validated files and headers of [`checkpoint::files::CheckpointFiles`].
//! - [`matrix::Matrix`]: weights kept in their stored form (BF16/F16/F32,
//!   or FP8 codes with block scales).
//! - [`store`]: the packed expert store as the engine reads it (which
//!   tensors are experts, the record layout, the pairing check);
//!   [`experts`]: the expert counters and the pool over a store.
//! - [`model::Model`]: the forward pass and greedy [`model::Model::generate`];
//!   [`engine::Engine`] over every device and family, [`sample`] for
//!   sampled decoding.
//!
//! Writing stores (the packer, the store cache), synthetic checkpoints and
//! the demo live in `flashtier-pack`, outside the decode path.
//!
//! Streaming never changes results: the kernels reduce in an order fixed by
//! the shapes alone, expert outputs are summed in ascending expert order
//! whatever order they arrive in, and every record is checked against its
//! checksum before a kernel sees it.
//!
//! ```
//! use flashtier_engine::load::{LoadOptions, load_cpu};
//! use flashtier_pack::pack::{PackOptions, pack_experts};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/engine/mixtral"));
//! let tmp = tempfile::tempdir()?;
//! let store = tmp.path().join("experts.ftstore");
//! let packed = pack_experts(&PackOptions::new(dir, &store), &|_bytes| {})?;
//! // Room for the two experts of one step: every other use is a read.
//! let mut model = load_cpu(dir, &LoadOptions::store(&store).budget(2 * packed.stride_bytes))?;
//! let out = model.generate(&[138, 33, 283, 311, 155, 290], 8, &[], false, |t| print!("{t} "))?;
//! assert_eq!(out.generated_ids, [22, 63, 215, 26, 312, 119, 70, 15]);
//! println!("{:.1} tok/s, hit rate {:.2}", out.tokens_per_sec(), out.decode_experts.hit_rate());
//! # Ok(()) }
//! ```

pub mod checkpoint;
pub mod config;
pub mod device;
pub mod engine;
pub mod error;
pub mod experts;
pub mod family;
pub mod hint;
pub mod load;
pub mod math;
pub mod matrix;
pub mod model;
pub mod sample;
pub mod settings;
pub mod store;
pub mod topk;

pub use config::{Arch, ModelConfig};
pub use error::EngineError;
pub use model::{Generation, Model};
