//! Qwen4-Exp (transformers 5.17 `qwen4_exp`): work in progress.

pub mod ngram;
