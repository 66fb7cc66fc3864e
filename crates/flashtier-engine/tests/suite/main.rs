//! Every CPU integration test of this crate in one binary: one link and
//! one build of the generic code instead of one per file (the GPU tests,
//! `gpu_*.rs`, stay binaries of their own for `scripts/gpu-test`).
//! Run one file's tests with `cargo test -p flashtier-engine --test suite FILE::`.

#[path = "../common/mod.rs"]
mod common;

mod batch_decode;
mod checkpoint;
mod config_bounds;
mod engine_errors;
mod engine_fixtures;
mod engine_streaming;
mod pairing;
mod prefill_chunks;
mod qwen4_fixture;
mod qwen4_rows;
