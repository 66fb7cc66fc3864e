//! The CPU's own limit for the matrix kernels: a streaming read of a buffer
//! bigger than the caches, across the same thread pool and instruction set
//! the kernels use. Benchmarks divide a kernel's weight bytes per second by
//! this to give its share of memory bandwidth.

use rayon::prelude::*;

use super::isa::Isa;

/// Bytes per rayon task of the streaming read.
const CHUNK_BYTES: usize = 512 << 10;

/// Sequential streams per task.
const STREAMS: usize = 16;

/// Read every byte of `buf` once on the pool's threads; the value (a sum
/// of its 64-bit words) only keeps the reads from being optimised away.
pub fn stream_read(isa: Isa, buf: &[u8]) -> u64 {
    buf.par_chunks(CHUNK_BYTES)
        .map(|chunk| isa.run(Words(chunk)))
        .reduce(|| 0, u64::wrapping_add)
}

struct Words<'a>(&'a [u8]);

impl pulp::NullaryFnOnce for Words<'_> {
    type Output = u64;
    #[inline(always)]
    fn call(self) -> u64 {
        sum_words(self.0)
    }
}

/// The sum of `chunk`'s words, read as [`STREAMS`] interleaved sequential
/// streams (one stream per core leaves the memory system idle; the matrix
/// kernels read several rows at once for the same reason).
#[inline(always)]
fn sum_words(chunk: &[u8]) -> u64 {
    const WORDS: usize = 8;
    const BLOCK: usize = 8 * WORDS;
    let blocks = chunk.len() / BLOCK;
    let per_stream = blocks / STREAMS;
    let mut acc = [[0u64; WORDS]; STREAMS];
    for b in 0..per_stream {
        for (s, acc_s) in acc.iter_mut().enumerate() {
            let at = (s * per_stream + b) * BLOCK;
            let block = &chunk[at..at + BLOCK];
            for (l, a) in acc_s.iter_mut().enumerate() {
                let w = &block[8 * l..8 * l + 8];
                let word = u64::from_le_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]);
                *a = a.wrapping_add(word);
            }
        }
    }
    let tail = chunk[STREAMS * per_stream * BLOCK..]
        .iter()
        .fold(0u64, |s, b| s.wrapping_add(u64::from(*b)));
    acc.iter().flatten().fold(tail, |s, a| s.wrapping_add(*a))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Per chunk: the whole 64-byte blocks the streams cover as 64-bit
    /// words, the rest byte by byte.
    fn reference(buf: &[u8]) -> u64 {
        let mut sum = 0u64;
        for chunk in buf.chunks(CHUNK_BYTES) {
            let blocks = chunk.len() / 64 / STREAMS * STREAMS * 64;
            for w in chunk[..blocks].chunks_exact(8) {
                sum = sum.wrapping_add(u64::from_le_bytes(w.try_into().expect("8 bytes")));
            }
            for b in &chunk[blocks..] {
                sum = sum.wrapping_add(u64::from(*b));
            }
        }
        sum
    }

    #[test]
    fn the_sum_covers_every_word_and_the_tail() {
        let buf: Vec<u8> = (0..(3 * CHUNK_BYTES + 77))
            .map(|i| (i * 7 % 251) as u8)
            .collect();
        for isa in Isa::available() {
            assert_eq!(stream_read(isa, &buf), reference(&buf), "{}", isa.name());
        }
    }
}
