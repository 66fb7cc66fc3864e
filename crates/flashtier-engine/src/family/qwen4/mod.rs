//! Qwen4-Exp (transformers 5.17 `qwen4_exp`, text model): GatedDeltaNet
//! ([`gdn`]) and QSA sparse attention ([`qsa`]) layers on `hc_count`
//! hyper-connection streams ([`hyper`]), Per-Layer Embedding ([`ple`]) from
//! hashed n-gram ids ([`ngram`]), and the 512-expert MoE through the expert
//! tier ([`model`]). The forward pass is written once over
//! [`crate::device::hybrid::HybridOps`] (the [`crate::device::Device`]
//! operations plus the recurrences, the sparse attention and the stream
//! mixers), so the CPU and the GPU run the same decoder and expert budgets
//! and backings work as for the other families. PLE rows are read from the
//! checkpoint, or from the row store ([`rows`], `--rows-budget`), on the
//! host, and handed to the device with the step.
//!
//! The multimodal `qwen4_exp` config loads its `text_config` (resident
//! tensors under `model.language_model.`; the vision tower is not run, and
//! loading says so); the expert packer packs its experts from the text
//! part ([`crate::checkpoint::files::CheckpointFiles::text_part`]). The checkpoint
//! is checked against the config where it can be: tensor shapes, the PLE
//! tables' row counts, and transformers' saved hash buffers.
//!
//! Checked against transformers 5.17 by `tests/qwen4_fixture.rs` and the
//! unit tests here, on fixtures made by `tools/make_qwen4_fixtures.py`.

pub mod gdn;
pub mod hyper;
pub mod model;
pub mod ngram;
pub mod ops;
pub mod ple;
pub mod qsa;
pub mod rows;

pub use model::Qwen4Model;
pub use rows::{PleRowOptions, PleRowStats, PleShard, pack_ple_rows, ple_shards};
