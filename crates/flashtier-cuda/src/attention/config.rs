//! Compile-time configuration of the split kernel: pipeline depth, shared
//! memory, and the tuning switches read from the environment.

use crate::plan::WARPS;

/// Most cp.async stages per warp.
pub(super) const MAX_STAGES: usize = 6;

/// Whether K is loaded straight into registers (`KREG` in attention_ptx.cu):
/// opt-in with `FLASHTIER_ATTN_KREG=1`, for head dims that are multiples of
/// 32 up to 128 (at 256 the fragments would spill). Correct (the GPU tests
/// pass with it) but measured 10% slower on the H200 than staging K in
/// shared memory, so off by default.
pub(crate) fn use_kreg(head_dim: usize) -> bool {
    head_dim % 32 == 0
        && head_dim <= 128
        && std::env::var("FLASHTIER_ATTN_KREG").is_ok_and(|v| v == "1")
}
/// Shared memory of one pipeline stage of one warp: K and V rows, or V
/// alone with `kreg`.
fn stage_bytes(head_dim: usize, kreg: bool) -> usize {
    (if kreg { 1 } else { 2 }) * 16 * (head_dim * 2 + 16)
}

/// Pipeline depth for `head_dim`.
///
/// - `head_dim >= 128`: 4 stages where they fit in one CTA's shared memory
///   (one split CTA of 4 warps per SM, 4 x 8.5 KB in flight per warp at
///   d = 128). Measured on the H200 with balanced splits, the L2 hints and
///   PDL: 39.6 µs at batch 1 / 64K against 40.3 µs for 3 stages at two
///   CTAs per SM (fewer splits to merge), batch 16 within 1 %.
/// - Otherwise as deep as fits while two split CTAs (8 warps) stay resident
///   per SM, 2..=6 (4 warps at 6 stages ran 25 % slower than 8 warps at 3
///   before the changes above).
pub(crate) fn split_stages(
    head_dim: usize,
    kreg: bool,
    smem_per_sm: usize,
    smem_optin: usize,
) -> usize {
    let per_stage = WARPS * stage_bytes(head_dim, kreg);
    let one_cta = smem_per_sm.saturating_sub(1024).min(smem_optin);
    if head_dim >= 128 && 4 * per_stage <= one_cta {
        return 4;
    }
    let budget = (smem_per_sm / 2).saturating_sub(1024).min(smem_optin);
    (budget / per_stage.max(1)).clamp(2, MAX_STAGES)
}

pub(super) fn split_smem_bytes(head_dim: usize, kreg: bool, stages: usize) -> usize {
    let staging = WARPS * stages * stage_bytes(head_dim, kreg);
    let merge = 4 * (2 * WARPS * 16 + WARPS * 16 * head_dim);
    staging.max(merge)
}

/// A small integer tuning switch from the environment (`default` when unset
/// or not a number 0..=2); tuning runs only.
pub(super) fn env_flag_or(name: &str, default: u8) -> String {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse::<u8>().ok())
        .filter(|v| *v <= 2)
        .unwrap_or(default)
        .to_string()
}
