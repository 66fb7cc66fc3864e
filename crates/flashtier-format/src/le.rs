//! Fixed-width little-endian fields of the on-disk headers, read and
//! written at a byte offset.
//!
//! Bounds: a field that does not fit in the buffer reads as zero and is not
//! written; every decoder checks that it holds a whole header before it
//! reads a field, and every encoder writes into a whole header, so neither
//! case arises from a file.

/// The `u32` at `b[at..at + 4]`.
pub(crate) fn get_u32(b: &[u8], at: usize) -> u32 {
    let mut w = [0u8; 4];
    if let Some(src) = b.get(at..at + 4) {
        w.copy_from_slice(src);
    }
    u32::from_le_bytes(w)
}

/// The `u64` at `b[at..at + 8]`.
pub(crate) fn get_u64(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    if let Some(src) = b.get(at..at + 8) {
        w.copy_from_slice(src);
    }
    u64::from_le_bytes(w)
}

/// Write `v` at `b[at..at + 4]`.
pub(crate) fn put_u32(b: &mut [u8], at: usize, v: u32) {
    if let Some(dst) = b.get_mut(at..at + 4) {
        dst.copy_from_slice(&v.to_le_bytes());
    }
}

/// Write `v` at `b[at..at + 8]`.
pub(crate) fn put_u64(b: &mut [u8], at: usize, v: u64) {
    if let Some(dst) = b.get_mut(at..at + 8) {
        dst.copy_from_slice(&v.to_le_bytes());
    }
}
