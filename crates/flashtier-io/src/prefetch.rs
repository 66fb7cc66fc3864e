//! A software prefetch hint, for hot loops that know their next addresses
//! (the row cache's batched probe). On targets without a prefetch
//! instruction it does nothing.

/// Ask the CPU to start loading the cache line holding `value` into all
/// cache levels. Purely a hint: no architectural effect, never faults.
#[inline(always)]
pub fn prefetch_read<T: ?Sized>(value: &T) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        let p: *const i8 = std::ptr::from_ref(value).cast();
        // SAFETY: `p` comes from a live reference, so it points into mapped
        // memory; `prefetcht0` reads nothing architecturally and cannot fault.
        // SSE is part of the x86_64 baseline, so the instruction exists.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = value;
}

#[cfg(test)]
mod tests {
    #[test]
    fn prefetch_is_harmless() {
        let v = vec![1u64; 1024];
        for x in &v {
            super::prefetch_read(x);
        }
        super::prefetch_read(&v[..]);
        assert_eq!(v.iter().sum::<u64>(), 1024);
    }
}
