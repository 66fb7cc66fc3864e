//! Page-aligned, zero-initialised host buffers.
//!
//! Invariants: the pointer is aligned to [`ALIGN`] (4096 bytes, enough for
//! O_DIRECT on every drive we target and for io_uring fixed buffers), the
//! capacity is a multiple of [`ALIGN`], and every byte is initialised (zeroed
//! on allocation). No safe function here hands out uninitialised memory.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ptr::NonNull;

/// Alignment of every buffer and landing region, in bytes.
pub const ALIGN: usize = 4096;

/// Round `len` up to the next multiple of [`ALIGN`].
#[must_use]
pub const fn round_up(len: usize) -> usize {
    len.div_ceil(ALIGN) * ALIGN
}

/// An owned, 4096-aligned, zeroed byte buffer.
///
/// `len()` is the logical length; the allocation is `capacity()` bytes, a
/// multiple of 4096 so a direct read of the whole capacity is always legal.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    cap: usize,
}

// SAFETY: AlignedBuf owns its allocation exclusively, like Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only yields &[u8]; mutation needs &mut self.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of logical length `len` (capacity rounded up to 4096,
    /// at least 4096).
    ///
    /// # Panics
    /// Only if the allocator fails (as `Vec` does) or `len` overflows `isize`.
    #[must_use]
    pub fn zeroed(len: usize) -> Self {
        let cap = round_up(len.max(1));
        let layout = Layout::from_size_align(cap, ALIGN).expect("buffer size overflows isize");
        // SAFETY: layout has non-zero size (cap >= 4096).
        let raw = unsafe { alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            std::alloc::handle_alloc_error(layout)
        };
        Self { ptr, len, cap }
    }

    /// Logical length in bytes.
    #[must_use]
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the logical length is zero.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Allocated bytes (a multiple of 4096, `>= len`).
    #[must_use]
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Set the logical length; it must not exceed the capacity. Bytes past the
    /// old length keep whatever was last written there (initialised memory).
    ///
    /// # Panics
    /// If `len > capacity()`.
    pub fn set_len(&mut self, len: usize) {
        assert!(
            len <= self.cap,
            "set_len {len} beyond capacity {}",
            self.cap
        );
        self.len = len;
    }

    /// The whole capacity as a mutable slice (for direct reads that must cover
    /// whole 4096-byte units).
    pub fn as_full_mut(&mut self) -> &mut [u8] {
        // SAFETY: ptr is valid for cap initialised bytes and uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.cap) }
    }

    /// Raw pointer to the first byte (for handing to the kernel).
    #[must_use]
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// Raw mutable pointer to the first byte.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is valid for cap >= len initialised bytes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: ptr is valid for cap >= len initialised bytes, uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with exactly this layout.
        unsafe {
            dealloc(
                self.ptr.as_ptr(),
                Layout::from_size_align_unchecked(self.cap, ALIGN),
            )
        }
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .field("cap", &self.cap)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeroed_is_aligned_and_zero() {
        for len in [0, 1, 4095, 4096, 4097, 1 << 20] {
            let b = AlignedBuf::zeroed(len);
            assert_eq!(b.as_ptr() as usize % ALIGN, 0);
            assert_eq!(b.len(), len);
            assert!(b.capacity() >= len.max(1) && b.capacity() % ALIGN == 0);
            assert!(b.iter().all(|&x| x == 0));
        }
    }

    #[test]
    fn set_len_within_capacity() {
        let mut b = AlignedBuf::zeroed(10);
        b.as_full_mut()[4000] = 7;
        b.set_len(4001);
        assert_eq!(b[4000], 7);
    }
}
