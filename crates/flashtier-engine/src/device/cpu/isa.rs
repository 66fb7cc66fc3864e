//! Run-time choice of the CPU's vector instruction set for the kernels.
//!
//! The binaries are built for the baseline of their target (no
//! `target-cpu=native`: they run on other machines than the one that built
//! them), so the kernels are compiled once per instruction set and one is
//! picked when the process starts. [`pulp`]'s tokens carry the proof that
//! the CPU has the features; a kernel body runs under [`Isa::run`], which
//! enables them for that body so LLVM vectorises it for the chosen width.
//!
//! Every instruction set runs the same body: fused multiply-adds into the
//! same lanes, reduced in the same tree. A fused multiply-add rounds once
//! whether the hardware or the software fallback computes it, so every
//! path gives bit-identical results (the tests compare each available one
//! with [`Isa::Scalar`]). The scalar path is the reference; on a CPU without
//! FMA it is correct but slow.
//!
//! `FLASHTIER_CPU_ISA=scalar|avx2|avx512|neon` overrides the choice (for
//! measurements and tests; [`crate::settings::CPU_ISA`]). A name that is
//! not one this CPU runs is an error where the choice is taken: opening a
//! model on the CPU and making a CPU KV cache call [`Isa::configured`].
//! The kernels themselves cannot return it: [`Isa::current`] then runs
//! the detected best and logs a warning, once.

use std::sync::{Once, OnceLock};

use flashtier_io::settings::{Env, SettingError};

/// A vector instruction set the kernels can run on.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub enum Isa {
    /// No vector extensions beyond the target's baseline.
    Scalar,
    /// x86-64-v3: AVX2, FMA, F16C.
    #[cfg(target_arch = "x86_64")]
    Avx2(pulp::x86::V3),
    /// x86-64-v4: AVX-512 F/BW/CD/DQ/VL on top of v3.
    #[cfg(target_arch = "x86_64")]
    Avx512(pulp::x86::V4),
    /// AArch64 Advanced SIMD (Grace, Apple silicon).
    #[cfg(target_arch = "aarch64")]
    Neon(pulp::aarch64::Neon),
}

impl Isa {
    /// The widest instruction set this CPU runs.
    pub fn detect() -> Isa {
        Isa::available().into_iter().last().unwrap_or(Isa::Scalar)
    }

    /// Every instruction set this CPU runs, narrowest first (`Scalar` always).
    pub fn available() -> Vec<Isa> {
        let mut all = vec![Isa::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            all.extend(pulp::x86::V3::try_new().map(Isa::Avx2));
            all.extend(pulp::x86::V4::try_new().map(Isa::Avx512));
        }
        #[cfg(target_arch = "aarch64")]
        all.extend(pulp::aarch64::Neon::try_new().map(Isa::Neon));
        all
    }

    /// The process-wide choice, decided once: `FLASHTIER_CPU_ISA` if set,
    /// else [`Isa::detect`]; an error when the variable names no
    /// instruction set this CPU runs.
    pub fn configured() -> Result<Isa, SettingError> {
        static CHOICE: OnceLock<Result<Isa, SettingError>> = OnceLock::new();
        CHOICE
            .get_or_init(|| from_setting(&Env::process()).map(|c| c.unwrap_or_else(Isa::detect)))
            .clone()
    }

    /// [`Isa::configured`] for the kernels, which cannot return an error:
    /// with a bad setting, the detected best (and a warning, once; the
    /// entry points have returned the error already).
    pub fn current() -> Isa {
        Isa::configured().unwrap_or_else(|e| {
            static WARNED: Once = Once::new();
            let best = Isa::detect();
            WARNED.call_once(|| tracing::warn!(using = best.name(), "{e}"));
            best
        })
    }

    /// Its name, as `FLASHTIER_CPU_ISA` spells it.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2(_) => "avx2",
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512(_) => "avx512",
            #[cfg(target_arch = "aarch64")]
            Isa::Neon(_) => "neon",
        }
    }

    /// Run `body` with this instruction set's features enabled. The body
    /// (a [`pulp::NullaryFnOnce`] whose `call` is `#[inline(always)]`; a
    /// closure is not reliably inlined) and everything it calls must be
    /// `#[inline(always)]` to be compiled for them.
    #[inline(always)]
    pub fn run<F: pulp::NullaryFnOnce>(self, body: F) -> F::Output {
        match self {
            Isa::Scalar => body.call(),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2(simd) => simd.vectorize(body),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512(simd) => simd.vectorize(body),
            #[cfg(target_arch = "aarch64")]
            Isa::Neon(simd) => simd.vectorize(body),
        }
    }
}

/// [`crate::settings::CPU_ISA`] from `env`: `None` when unset, an error for a name that is
/// not an instruction set this CPU runs.
pub fn from_setting(env: &Env<'_>) -> Result<Option<Isa>, SettingError> {
    let runs = Isa::available();
    let names: Vec<&str> = runs.iter().map(|i| i.name()).collect();
    let expected = format!("an instruction set this CPU runs ({})", names.join(", "));
    env.optional(crate::settings::CPU_ISA, &expected, |v| {
        runs.iter().copied().find(|i| i.name() == v)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scalar_is_always_available_and_detect_is_the_widest() {
        let all = Isa::available();
        assert_eq!(all[0].name(), "scalar");
        assert_eq!(Isa::detect().name(), all[all.len() - 1].name());
        assert_eq!(Isa::Scalar.run(|| 41 + 1), 42);
        for isa in all {
            assert_eq!(isa.run(|| 6 * 7), 42, "{}", isa.name());
        }
    }

    #[test]
    fn cpu_isa_names_what_this_cpu_runs() {
        assert!(matches!(from_setting(&Env::from_pairs(&[])), Ok(None)));
        let got = from_setting(&Env::from_pairs(&[(crate::settings::CPU_ISA, "scalar")]));
        assert!(matches!(got, Ok(Some(Isa::Scalar))), "{got:?}");
        let e = from_setting(&Env::from_pairs(&[(crate::settings::CPU_ISA, "sse9")])).unwrap_err();
        assert_eq!(e.var, crate::settings::CPU_ISA);
        assert!(e.to_string().contains("scalar"), "{e}");
    }
}
