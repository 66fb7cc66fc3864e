//! Qwen4-Exp (transformers 5.17 `qwen4_exp`, text model) on the CPU:
//! GatedDeltaNet ([`gdn`]) and QSA sparse attention ([`qsa`]) layers on
//! `hc_count` hyper-connection streams ([`hyper`]), Per-Layer Embedding
//! ([`ple`]) from hashed n-gram ids ([`ngram`]), and the 512-expert MoE
//! through the expert tier ([`model`]). The forward pass is host f32 code
//! ([`ops`]) that calls the CPU device for matrix products and the routed
//! experts, so expert budgets and backings work as for the other families;
//! it is not yet written over [`crate::device::Device`] (no GPU path), and
//! PLE rows are read from the checkpoint, not yet from the row store.

pub mod gdn;
pub mod hyper;
pub mod model;
pub mod ngram;
pub mod ops;
pub mod ple;
pub mod qsa;

pub use model::Qwen4Model;
