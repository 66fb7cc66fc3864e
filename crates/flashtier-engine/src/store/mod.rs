//! The packed expert store as the engine reads it: which tensors of a
//! checkpoint are routed experts and how a record lays them out
//! ([`layout`]), and the check that a store was packed from the checkpoint
//! it is opened with ([`check_pairing`]: config checksum, file lengths,
//! header checksums, every record's tensor layout).
//!
//! Writing stores (the packer, the store cache) lives in `flashtier-pack`;
//! both sides share these definitions, so a store the packer writes is one
//! the engine accepts and nothing else is.

pub mod error;
pub mod layout;
mod pairing;

pub use error::PackError;
pub use layout::{
    ExpertFamily, ExpertLayout, ExpertTensors, TENSOR_ALIGN_BYTES, expert_layout, source_name,
};
pub use pairing::check_pairing;
