//! Every CPU integration test of this crate in one binary: one link and
//! one build of the generic code instead of one per file (the GPU tests,
//! `gpu_*.rs`, stay binaries of their own for `scripts/gpu-test`).
//! Run one file's tests with `cargo test -p flashtier-serve --test suite FILE::`.

#[path = "../common/mod.rs"]
mod common;

mod http;
mod load;
mod qwen4;
mod spill;
