//! SplitMix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number
//! generators", 2014; the `splitmix64.c` of Vigna's reference generators):
//! the one home of it in the workspace.
//!
//! Its outputs are part of what stored data means: the multipliers of the
//! Engram n-gram hash (`flashtier::rows::ngram`) and of Qwen4-Exp's
//! PLE ids (`flashtier_engine::family::qwen4::ngram`) derive from it, so a
//! packed row shard is only read at the right rows while these values stay
//! fixed; the fault-injecting backend derives its per-operation seeds from
//! it. It lives here, below every crate that uses it.

/// The generator's increment, `2^64 / phi` rounded to odd.
pub const SPLITMIX64_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// The output of the generator whose state is `state` before the step: the
/// state advanced by [`SPLITMIX64_GAMMA`], then mixed. A pure function, so
/// element `i` of a stream can be computed without the ones before it.
#[must_use]
#[inline]
pub const fn splitmix64(state: u64) -> u64 {
    let mut z = state.wrapping_add(SPLITMIX64_GAMMA);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Step the generator at `state`: its next output ([`splitmix64`] of the
/// state), with `state` advanced by [`SPLITMIX64_GAMMA`].
#[inline]
pub fn splitmix64_next(state: &mut u64) -> u64 {
    let out = splitmix64(*state);
    *state = state.wrapping_add(SPLITMIX64_GAMMA);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first outputs of the reference `splitmix64.c` seeded with 0.
    const FROM_ZERO: [u64; 3] = [
        0xE220_A839_7B1D_CDAF,
        0x6E78_9E6A_A1B9_65F4,
        0x06C4_5D18_8009_454F,
    ];

    #[test]
    fn known_values_from_state_zero() {
        let mut state = 0;
        let got = FROM_ZERO.map(|_| splitmix64_next(&mut state));
        assert_eq!(got, FROM_ZERO);
        assert_eq!(state, 3u64.wrapping_mul(SPLITMIX64_GAMMA));
    }

    #[test]
    fn the_pure_form_is_the_stream_at_any_step() {
        for (i, want) in FROM_ZERO.iter().enumerate() {
            assert_eq!(splitmix64((i as u64).wrapping_mul(SPLITMIX64_GAMMA)), *want);
        }
        // Wrapping arithmetic at the top of the range.
        let mut state = u64::MAX;
        assert_eq!(splitmix64_next(&mut state), splitmix64(u64::MAX));
        assert_eq!(state, u64::MAX.wrapping_add(SPLITMIX64_GAMMA));
    }
}
