//! flashtier's tiers: the expert pool, the row store, KV swap with tiled
//! decode attention, and routing traces with their replay.
//!
//! Policy and data structures live here, free of model code (the decode
//! engine, checkpoints and the packer are `flashtier-engine`); every byte
//! from disk arrives through a `flashtier_io::StorageBackend`, and this crate
//! makes no raw syscalls.
#![deny(unsafe_code)]

pub mod experts;
pub mod kv;
pub mod rows;
pub mod settings;
pub mod verify;
