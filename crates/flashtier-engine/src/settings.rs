//! The engine's settings from the environment: every variable this crate
//! reads, read here only, through the workspace's one reader
//! ([`flashtier_io::settings`]). A bad value is an
//! [`EngineError::Setting`](crate::error::EngineError::Setting) naming the
//! variable, returned where the setting is taken: opening a CUDA device
//! ([`CudaSettings`]), opening a model on the CPU or making a CPU KV cache
//! (the instruction set, [`cpu_isa`]).
//!
//! None of them changes a result bit (but [`PROMPT_ROWS`], only where a
//! prompt's cut leaves a short step; see there). The CUDA ones exist for measuring
//! (their defaults measured fastest on the H200); code that wants another
//! value calls [`crate::device::cuda::CudaDevice::set_chain`] and the like
//! instead.

use std::path::PathBuf;

use flashtier_io::settings::{Env, Setting, SettingError};

/// `FLASHTIER_CHAIN`: `0` has a greedy decode on the GPU read each token
/// back before it issues the next step (default `1`: the next step embeds
/// the pick on the device and is issued first; a step issued on a stop
/// token is undone).
pub const CHAIN: &str = "FLASHTIER_CHAIN";
/// `FLASHTIER_PREFETCH`: `0` leaves the L2 prefetch hints out of recorded
/// GPU steps (default `1`).
pub const PREFETCH: &str = "FLASHTIER_PREFETCH";
/// `FLASHTIER_FUSED_ROUTER`: `0` runs a one-row softmax router's product
/// and its top-k as two launches (default `1`: one).
pub const FUSED_ROUTER: &str = "FLASHTIER_FUSED_ROUTER";
/// `FLASHTIER_ROWS_ATTN`: `0` attends each sequence of a batched GPU
/// decode step alone (default `1`: the decode rows of every sequence whose
/// KV is all in HBM in one launch per kernel; the same bits either way).
pub const ROWS_ATTN: &str = "FLASHTIER_ROWS_ATTN";
/// `FLASHTIER_MOE_PAIRS_FAST`: `0` runs a GPU decode step of 2 to 8 rows'
/// expert blocks pair by pair (default `1`: the same output rows of every
/// pair side by side, so rows sharing an expert read it from L2; the same
/// bits either way).
pub const MOE_PAIRS_FAST: &str = "FLASHTIER_MOE_PAIRS_FAST";
/// `FLASHTIER_PROMPT_ROWS`: the most rows of one prompt step on the GPU,
/// [`crate::model::PREFILL_CHUNK`] to [`MAX_PROMPT_ROWS`], in whole
/// chunks (default [`crate::device::cuda::PROMPT_ROWS`]). A row's bits
/// depend on how its prompt is cut only where a cut leaves a step of
/// under 16 rows (the GEMV and per-row attention kernels).
pub const PROMPT_ROWS: &str = "FLASHTIER_PROMPT_ROWS";
/// Most rows [`PROMPT_ROWS`] may ask for.
pub const MAX_PROMPT_ROWS: usize = 4096;
/// Fewest rows [`PROMPT_ROWS`] may ask for: one chunk
/// ([`crate::model::PREFILL_CHUNK`]).
pub const MIN_PROMPT_ROWS: usize = 256;
/// [`PROMPT_ROWS`]' default (see [`crate::device::cuda::PROMPT_ROWS`]).
pub const DEFAULT_PROMPT_ROWS: usize = 1024;
/// `FLASHTIER_CPU_ISA`: the CPU kernels' instruction set, `scalar`,
/// `avx2`, `avx512` or `neon`, one this CPU runs (default: the widest it
/// runs). Every one gives the same bits.
pub const CPU_ISA: &str = "FLASHTIER_CPU_ISA";
/// `FLASHTIER_CACHE`: the folder of the stores packed from checkpoints for
/// runs without `--store` (default `$XDG_CACHE_HOME/flashtier`, else
/// `$HOME/.cache/flashtier`; see [`crate::store_cache`]).
pub const CACHE: &str = "FLASHTIER_CACHE";

/// This crate's variables.
pub const SETTINGS: &[Setting] = &[
    Setting {
        name: CHAIN,
        default: "1",
        doc: "0: a greedy GPU decode reads each token back before it issues the next step",
    },
    Setting {
        name: PREFETCH,
        default: "1",
        doc: "0: no L2 prefetch hints in recorded GPU steps",
    },
    Setting {
        name: FUSED_ROUTER,
        default: "1",
        doc: "0: a one-row softmax router's product and top-k as two launches",
    },
    Setting {
        name: ROWS_ATTN,
        default: "1",
        doc: "0: each sequence of a batched GPU decode step attends alone",
    },
    Setting {
        name: MOE_PAIRS_FAST,
        default: "1",
        doc: "0: a GPU decode step of 2 to 8 rows runs its expert blocks pair by pair",
    },
    Setting {
        name: PROMPT_ROWS,
        default: "1024",
        doc: "most rows of one GPU prompt step (256 to 4096, in whole 256-row chunks)",
    },
    Setting {
        name: CPU_ISA,
        default: "detected",
        doc: "the CPU kernels' instruction set: scalar, avx2, avx512 or neon (one this CPU runs)",
    },
    Setting {
        name: CACHE,
        default: "$XDG_CACHE_HOME/flashtier",
        doc: "the store cache folder for runs without --store (else $HOME/.cache/flashtier)",
    },
];

/// How the CUDA device runs a step (see
/// [`crate::device::cuda::CudaDevice`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CudaSettings {
    /// Greedy steps chain on the device ([`CHAIN`]).
    pub chain: bool,
    /// L2 prefetch hints in recorded steps ([`PREFETCH`]).
    pub prefetch: bool,
    /// A one-row softmax router in one launch ([`FUSED_ROUTER`]).
    pub fused_router: bool,
    /// A batched decode step's sequences attend in one launch
    /// ([`ROWS_ATTN`]).
    pub rows_attn: bool,
    /// A step of 2 to 8 rows runs its expert blocks pair-fastest
    /// ([`MOE_PAIRS_FAST`]).
    pub moe_pairs_fast: bool,
    /// Most rows of one prompt step ([`PROMPT_ROWS`]).
    pub prompt_rows: usize,
}

impl Default for CudaSettings {
    fn default() -> Self {
        Self {
            chain: true,
            prefetch: true,
            fused_router: true,
            rows_attn: true,
            moe_pairs_fast: true,
            prompt_rows: DEFAULT_PROMPT_ROWS,
        }
    }
}

impl CudaSettings {
    /// The defaults, each overridden by its variable in `env`.
    pub fn read(env: &Env<'_>) -> Result<Self, SettingError> {
        let d = Self::default();
        Ok(Self {
            chain: env.flag(CHAIN, d.chain)?,
            prefetch: env.flag(PREFETCH, d.prefetch)?,
            fused_router: env.flag(FUSED_ROUTER, d.fused_router)?,
            rows_attn: env.flag(ROWS_ATTN, d.rows_attn)?,
            moe_pairs_fast: env.flag(MOE_PAIRS_FAST, d.moe_pairs_fast)?,
            prompt_rows: env.int(
                PROMPT_ROWS,
                MIN_PROMPT_ROWS..=MAX_PROMPT_ROWS,
                d.prompt_rows,
            )?,
        })
    }
}

/// The store cache folder from `env`: [`CACHE`], else `XDG_CACHE_HOME`'s
/// `flashtier`, else `HOME`'s `.cache/flashtier`; `None` when none is set.
#[must_use]
pub fn cache_dir(env: &Env<'_>) -> Option<PathBuf> {
    env.path(CACHE)
        .or_else(|| env.path("XDG_CACHE_HOME").map(|d| d.join("flashtier")))
        .or_else(|| env.path("HOME").map(|d| d.join(".cache").join("flashtier")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_settings_default_and_read() {
        assert_eq!(
            CudaSettings::read(&Env::from_pairs(&[])),
            Ok(CudaSettings::default())
        );
        let env = Env::from_pairs(&[
            (CHAIN, "0"),
            (PREFETCH, "0"),
            (FUSED_ROUTER, "0"),
            (ROWS_ATTN, "0"),
            (MOE_PAIRS_FAST, "0"),
            (PROMPT_ROWS, "2048"),
        ]);
        assert_eq!(
            CudaSettings::read(&env),
            Ok(CudaSettings {
                chain: false,
                prefetch: false,
                fused_router: false,
                rows_attn: false,
                moe_pairs_fast: false,
                prompt_rows: 2048,
            })
        );
        for var in [
            CHAIN,
            PREFETCH,
            FUSED_ROUTER,
            ROWS_ATTN,
            MOE_PAIRS_FAST,
            PROMPT_ROWS,
        ] {
            let pairs = [(var, "off")];
            let e = CudaSettings::read(&Env::from_pairs(&pairs)).unwrap_err();
            assert_eq!(e.var, var);
        }
        for bad in ["255", "4097"] {
            let pairs = [(PROMPT_ROWS, bad)];
            let e = CudaSettings::read(&Env::from_pairs(&pairs)).unwrap_err();
            assert_eq!(e.var, PROMPT_ROWS, "{bad}");
        }
    }

    #[test]
    fn prompt_rows_start_at_one_chunk() {
        assert_eq!(MIN_PROMPT_ROWS, crate::model::PREFILL_CHUNK);
        assert_eq!(DEFAULT_PROMPT_ROWS, crate::device::cuda::PROMPT_ROWS);
        assert_eq!(DEFAULT_PROMPT_ROWS % MIN_PROMPT_ROWS, 0);
    }

    #[test]
    fn the_cache_falls_back_in_order() {
        let dir = |pairs: &[(&str, &str)]| cache_dir(&Env::from_pairs(pairs));
        assert_eq!(dir(&[]), None);
        assert_eq!(
            dir(&[("HOME", "/h")]),
            Some(PathBuf::from("/h/.cache/flashtier"))
        );
        assert_eq!(
            dir(&[("HOME", "/h"), ("XDG_CACHE_HOME", "/x")]),
            Some(PathBuf::from("/x/flashtier"))
        );
        assert_eq!(
            dir(&[("HOME", "/h"), (CACHE, "/c"), ("XDG_CACHE_HOME", "")]),
            Some(PathBuf::from("/c"))
        );
    }

    #[test]
    fn the_table_matches_the_defaults() {
        let d = CudaSettings::default();
        let flag = |b: bool| if b { "1" } else { "0" };
        let rows = d.prompt_rows.to_string();
        for (name, want) in [
            (CHAIN, flag(d.chain)),
            (PREFETCH, flag(d.prefetch)),
            (FUSED_ROUTER, flag(d.fused_router)),
            (ROWS_ATTN, flag(d.rows_attn)),
            (MOE_PAIRS_FAST, flag(d.moe_pairs_fast)),
            (PROMPT_ROWS, rows.as_str()),
        ] {
            let s = SETTINGS.iter().find(|s| s.name == name);
            assert_eq!(s.map(|s| s.default), Some(want), "{name}");
        }
        assert!(SETTINGS.iter().any(|s| s.name == CPU_ISA));
        assert!(SETTINGS.iter().any(|s| s.name == CACHE));
    }
}
