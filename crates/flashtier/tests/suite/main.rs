//! Every CPU integration test of this crate in one binary: one link and
//! one build of the generic code instead of one per file (the GPU tests,
//! `gpu_*.rs`, stay binaries of their own for `scripts/gpu-test`).
//! Run one file's tests with `cargo test -p flashtier --test suite FILE::`.

#[path = "../rows_support/mod.rs"]
mod rows_support;
#[path = "../store_faults/mod.rs"]
mod store_faults;

mod experts_lowbit;
mod experts_mapped;
mod experts_pool;
mod experts_replay;
mod fault_matrix;
mod kv_attention;
mod kv_attention_order;
mod kv_swap;
mod pack_outputs;
mod plain_messages;
mod rows_concurrent;
mod rows_exact;
mod rows_faults;
mod rows_packed;
mod rows_unscaled;
