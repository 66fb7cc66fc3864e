//! Bulk copies out of atomic words for seqlock readers.
//!
//! A seqlock reader copies a record that a writer may be rewriting at that
//! moment, then re-reads the sequence counter and throws the copy away if a
//! write overlapped it. The copy must not be undefined behaviour even when it
//! races: a plain `memcpy` of memory another thread writes is a data race in
//! the Rust memory model, and copying word by word through
//! [`AtomicU64::load`] is race-free but cannot be vectorised (each load is
//! its own 8-byte move, plus the 8-byte store of its bytes).
//!
//! [`copy_words`] copies with 16-byte SSE2 moves in inline assembly on
//! x86_64 (64 bytes per loop turn), and with relaxed atomic loads elsewhere
//! and for the sub-16-byte tail. The source is `&[AtomicU64]`, so every Rust
//! access to it is atomic; the assembly is opaque to the compiler and behaves
//! as a sequence of relaxed loads of the source words (x86_64 reads each
//! naturally aligned 8-byte word of an 8-byte-aligned 16-byte load in one
//! piece), followed by writes into the caller's exclusively borrowed
//! destination. The values read while a writer is inside may be any mix of
//! old and new words: that is exactly the torn copy the seqlock's sequence
//! check detects and discards, so the caller never returns it.
//!
//! No buffer is allocated; the copy length is `min(dst.len(), 8 * src.len())`.
//!
//! [`prefetch_word`] hints the CPU to pull a word's cache line in ahead of
//! use, so a batch of lookups overlaps the memory latency of later rows'
//! probes with the copies of earlier ones.

use std::sync::atomic::{AtomicU64, Ordering};

/// Copy `min(dst.len(), 8 * src.len())` bytes of `src` (its words
/// little-endian) into `dst`. Races with atomic writers to `src` are
/// allowed; the bytes are then unspecified (see the module docs).
#[inline]
pub fn copy_words(src: &[AtomicU64], dst: &mut [u8]) {
    if let ([word, ..], 8) = (src, dst.len()) {
        // One word (a row's scale): a plain relaxed load, no vector setup.
        dst.copy_from_slice(&word.load(Ordering::Relaxed).to_le_bytes());
        return;
    }
    let len = dst.len().min(src.len() * 8);
    let bulk = bulk_copy(src, &mut dst[..len]);
    let (done_words, rest) = (bulk / 8, &mut dst[bulk..len]);
    let mut chunks = rest.chunks_exact_mut(8);
    let mut words = src.get(done_words..).unwrap_or(&[]).iter();
    for (chunk, w) in (&mut chunks).zip(&mut words) {
        chunk.copy_from_slice(&w.load(Ordering::Relaxed).to_le_bytes());
    }
    let tail = chunks.into_remainder();
    if let (false, Some(w)) = (tail.is_empty(), words.next()) {
        let v = w.load(Ordering::Relaxed).to_le_bytes();
        tail.copy_from_slice(&v[..tail.len()]);
    }
}

/// Copy the leading multiple of 16 bytes of `dst` from `src`
/// (`dst.len() <= 8 * src.len()`); returns the bytes copied.
#[cfg(target_arch = "x86_64")]
#[inline]
fn bulk_copy(src: &[AtomicU64], dst: &mut [u8]) -> usize {
    let n16 = dst.len() / 16;
    if n16 == 0 || !cfg!(target_endian = "little") {
        return 0;
    }
    let blocks = n16 / 4;
    let singles = n16 % 4;
    // SAFETY: `src` covers at least `dst.len()` bytes (the caller's
    // bound), and `n16 * 16 <= dst.len()`, so every load reads inside
    // `src` and every store writes inside `dst`, which we borrow
    // exclusively. `movdqu` needs no alignment. The source is only ever
    // accessed atomically by Rust code; these loads behave as relaxed loads
    // of its words (module docs), and a torn result is discarded by the
    // seqlock caller. Only xmm0..xmm3 and the pointer / counter registers
    // declared below are modified; no stack is used.
    unsafe {
        std::arch::asm!(
            "test {blocks}, {blocks}",
            "jz 3f",
            "2:",
            "movdqu xmm0, [{s}]",
            "movdqu xmm1, [{s} + 16]",
            "movdqu xmm2, [{s} + 32]",
            "movdqu xmm3, [{s} + 48]",
            "movdqu [{d}], xmm0",
            "movdqu [{d} + 16], xmm1",
            "movdqu [{d} + 32], xmm2",
            "movdqu [{d} + 48], xmm3",
            "add {s}, 64",
            "add {d}, 64",
            "dec {blocks}",
            "jnz 2b",
            "3:",
            "test {singles}, {singles}",
            "jz 5f",
            "4:",
            "movdqu xmm0, [{s}]",
            "movdqu [{d}], xmm0",
            "add {s}, 16",
            "add {d}, 16",
            "dec {singles}",
            "jnz 4b",
            "5:",
            s = inout(reg) src.as_ptr() => _,
            d = inout(reg) dst.as_mut_ptr() => _,
            blocks = inout(reg) blocks => _,
            singles = inout(reg) singles => _,
            out("xmm0") _,
            out("xmm1") _,
            out("xmm2") _,
            out("xmm3") _,
            options(nostack),
        );
    }
    n16 * 16
}

/// Elsewhere the word loop in [`copy_words`] does all of it.
#[cfg(not(target_arch = "x86_64"))]
#[inline]
fn bulk_copy(_src: &[AtomicU64], _dst: &mut [u8]) -> usize {
    0
}

/// Hint the CPU to pull the cache line holding `word` towards L1. Only a
/// hint: it has no effect on the program's values.
#[inline(always)]
pub fn prefetch_word(word: &AtomicU64) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `prefetcht0` neither faults nor changes memory, registers or
    // flags; the address comes from a live reference.
    unsafe {
        std::arch::asm!(
            "prefetcht0 [{p}]",
            p = in(reg) std::ptr::from_ref(word),
            options(nostack, readonly, preserves_flags),
        );
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = word;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::fence;

    fn words_of(bytes: &[u8]) -> Vec<AtomicU64> {
        bytes
            .chunks(8)
            .map(|c| {
                let mut v = [0u8; 8];
                v[..c.len()].copy_from_slice(c);
                AtomicU64::new(u64::from_le_bytes(v))
            })
            .collect()
    }

    #[test]
    fn copies_every_length_exactly() {
        let bytes: Vec<u8> = (0..300u32).map(|i| (i * 7 + 3) as u8).collect();
        for len in 0..=bytes.len() {
            let src = words_of(&bytes[..len]);
            let mut dst = vec![0xAAu8; len + 5];
            copy_words(&src, &mut dst[..len]);
            assert_eq!(&dst[..len], &bytes[..len], "len {len}");
            assert!(dst[len..].iter().all(|&b| b == 0xAA), "len {len}");
        }
    }

    #[test]
    fn short_source_bounds_the_copy() {
        let src = words_of(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]);
        let mut dst = [0u8; 40];
        copy_words(&src, &mut dst);
        assert_eq!(dst[15], 16);
        assert!(dst[16..].iter().all(|&b| b == 0));
    }

    /// A seqlock stress: a writer fills every word with its generation;
    /// readers copying concurrently accept a copy only when the sequence
    /// did not move, and an accepted copy must be one generation throughout.
    #[test]
    fn seqlock_readers_never_accept_a_torn_copy() {
        const WORDS: usize = 33;
        let seq = AtomicU64::new(0);
        let data: Vec<AtomicU64> = (0..WORDS).map(|_| AtomicU64::new(0)).collect();
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                for generation in 1..20_000u64 {
                    let v = seq.load(Ordering::Relaxed);
                    seq.store(v + 1, Ordering::Relaxed);
                    fence(Ordering::Release);
                    for w in &data {
                        w.store(generation, Ordering::Relaxed);
                    }
                    seq.store(v + 2, Ordering::Release);
                }
                stop.store(true, Ordering::Relaxed);
            });
            for _ in 0..3 {
                s.spawn(|| {
                    let mut out = [0u8; WORDS * 8];
                    let mut accepted = 0u64;
                    while !stop.load(Ordering::Relaxed) || accepted == 0 {
                        let before = seq.load(Ordering::Acquire);
                        if before & 1 == 1 {
                            continue;
                        }
                        copy_words(&data, &mut out);
                        fence(Ordering::Acquire);
                        if seq.load(Ordering::Relaxed) != before {
                            continue;
                        }
                        accepted += 1;
                        let first = &out[..8];
                        assert!(out.chunks(8).all(|c| c == first), "torn copy accepted");
                    }
                });
            }
        });
    }
}
