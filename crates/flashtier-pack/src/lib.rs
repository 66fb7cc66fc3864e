//! What flashtier builds outside the decode path, for the CLI, the tests
//! and library users:
//!
//! - [`pack`]: a checkpoint's routed experts packed into an expert store
//!   (one record per layer and expert, checksummed), through a bounded
//!   pipeline, never over the checkpoint's own files.
//! - [`cache`]: the store cache, one store per checkpoint packed on first
//!   use and reused while it pairs with the checkpoint.
//! - [`synth`]: synthetic checkpoints in real models' proportions
//!   (Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3, Qwen4-Exp), written as
//!   transformers writes safetensors.
//! - [`session`]: a model opened for decoding the one way `run`,
//!   `serve`, the benches and library users open it: the checkpoint once,
//!   the store given or cached (packed first when missing), the engine on
//!   its device under the budgets.
//! - [`demo`]: `flashtier demo`, a synthetic model decoded with its experts
//!   streamed under a memory budget, held against the drive's bound.
//!
//! The decode engine (`flashtier-engine`) reads what this crate writes:
//! the record layout and the pairing check are the engine's
//! (`flashtier_engine::store`), so a store packed here is exactly one the
//! engine accepts.

pub mod cache;
pub mod demo;
pub mod error;
pub mod pack;
pub mod session;
pub mod synth;

pub use error::DemoError;
