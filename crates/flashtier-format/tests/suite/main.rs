//! Every CPU integration test of this crate in one binary: one link and
//! one build of the generic code instead of one per file (the GPU tests,
//! `gpu_*.rs`, stay binaries of their own for `scripts/gpu-test`).
//! Run one file's tests with `cargo test -p flashtier-format --test suite FILE::`.

mod fixtures;
mod header;
mod manifest;
mod row_shard;
mod safetensors;
mod store;
