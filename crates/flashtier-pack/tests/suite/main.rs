//! Every CPU integration test of this crate in one binary: one link and
//! one build of the generic code instead of one per file (the GPU tests,
//! `gpu_*.rs`, stay binaries of their own for `scripts/gpu-test`).
//! Run one file's tests with `cargo test -p flashtier-pack --test suite FILE::`.

mod pack;
mod pack_outputs;
mod session;
mod synth_qwen4;
