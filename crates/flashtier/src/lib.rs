//! flashtier's tiers: the expert pool, the row store, KV swap with tiled
//! decode attention, routing traces and replay, and the decode engine.
//!
//! Policy and data structures live here; every byte from disk arrives through
//! a `flashtier_io::StorageBackend`, and this crate makes no raw syscalls.
#![deny(unsafe_code)]

pub mod checkpoint;
pub mod engine;
pub mod experts;
pub mod kv;
pub mod pack;
pub mod rows;
pub mod synth;
