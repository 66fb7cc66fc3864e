//! Landing regions: long-lived memory that reads land in by offset (expert
//! arenas, KV scratch pools, pinned staging).
//!
//! A region is shared (`Arc`) between its owner (a tier) and the backend
//! while reads are in flight, so its memory outlives every read that targets
//! it. Who may touch which bytes when is the owner's protocol (a slot is not
//! read before its ticket lands, not reused while a read is in flight); the
//! byte accessors are therefore `unsafe` and state that contract.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::buf::{ALIGN, AlignedBuf};

/// Memory a landing region is made of: aligned host memory here, pinned or
/// unified memory when `flashtier-cuda` provides it.
///
/// # Safety
/// Implementors guarantee that `base_ptr()` is non-null, aligned to 4096,
/// valid for reads and writes of `len_bytes()` initialised bytes, and stable
/// (never moved or freed) until the value is dropped.
pub unsafe trait RegionMemory: Send + Sync + 'static {
    /// First byte.
    fn base_ptr(&self) -> *mut u8;
    /// Size in bytes.
    fn len_bytes(&self) -> usize;
    /// The device address of the first byte where the device can read this
    /// memory directly (unified or mapped pinned memory); `None` for plain
    /// host memory.
    fn device_ptr(&self) -> Option<u64> {
        None
    }
}

// SAFETY: AlignedBuf's pointer is 4096-aligned, valid for `capacity()` zeroed
// bytes, and never moves while the buffer lives.
unsafe impl RegionMemory for AlignedBuf {
    fn base_ptr(&self) -> *mut u8 {
        self.as_ptr().cast_mut()
    }
    fn len_bytes(&self) -> usize {
        self.capacity()
    }
}

static NEXT_REGION_ID: AtomicU64 = AtomicU64::new(1);

/// A landing region. See the module docs for the access protocol.
pub struct LandingRegion {
    mem: Box<dyn RegionMemory>,
    id: u64,
}

impl LandingRegion {
    /// A zeroed host region of at least `len` bytes (rounded up to 4096).
    #[must_use]
    pub fn host(len: usize) -> Arc<Self> {
        Self::from_memory(Box::new(AlignedBuf::zeroed(len)))
    }

    /// Wrap memory provided by another layer (pinned, unified).
    #[must_use]
    pub fn from_memory(mem: Box<dyn RegionMemory>) -> Arc<Self> {
        debug_assert_eq!(mem.base_ptr() as usize % ALIGN, 0);
        Arc::new(Self {
            mem,
            id: NEXT_REGION_ID.fetch_add(1, Ordering::Relaxed),
        })
    }

    /// Process-unique id (backends key registrations by it).
    #[must_use]
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Size in bytes.
    #[must_use]
    pub fn len_bytes(&self) -> usize {
        self.mem.len_bytes()
    }

    /// First byte, for registration with the kernel or a device.
    #[must_use]
    pub fn base_ptr(&self) -> *mut u8 {
        self.mem.base_ptr()
    }

    /// Device address of the first byte when the device can read this memory
    /// in place.
    #[must_use]
    pub fn device_ptr(&self) -> Option<u64> {
        self.mem.device_ptr()
    }

    /// Whether `[offset, offset + len)` lies inside the region.
    #[must_use]
    pub fn contains(&self, offset: usize, len: usize) -> bool {
        offset
            .checked_add(len)
            .is_some_and(|end| end <= self.len_bytes())
    }

    /// Pointer to `offset`, or `None` when `[offset, offset+len)` is outside.
    #[must_use]
    pub fn ptr_at(&self, offset: usize, len: usize) -> Option<*mut u8> {
        // SAFETY: offset + len <= region length, so the pointer stays in bounds.
        self.contains(offset, len)
            .then(|| unsafe { self.base_ptr().add(offset) })
    }

    /// Shared view of `[offset, offset + len)`.
    ///
    /// # Safety
    /// No read may be in flight into these bytes and no `&mut` view of them
    /// may exist for the lifetime of the returned slice.
    ///
    /// # Panics
    /// If the range is outside the region.
    #[must_use]
    pub unsafe fn slice(&self, offset: usize, len: usize) -> &[u8] {
        let p = self
            .ptr_at(offset, len)
            .expect("landing region slice out of bounds");
        // SAFETY: in bounds (checked), initialised (RegionMemory contract), and
        // the caller guarantees no concurrent writer.
        unsafe { std::slice::from_raw_parts(p, len) }
    }

    /// Exclusive view of `[offset, offset + len)`.
    ///
    /// # Safety
    /// No read may be in flight into these bytes and no other view of them may
    /// exist for the lifetime of the returned slice.
    ///
    /// # Panics
    /// If the range is outside the region.
    #[expect(
        clippy::mut_from_ref,
        reason = "interior memory; exclusivity is the caller's contract"
    )]
    #[must_use]
    pub unsafe fn slice_mut(&self, offset: usize, len: usize) -> &mut [u8] {
        let p = self
            .ptr_at(offset, len)
            .expect("landing region slice out of bounds");
        // SAFETY: in bounds (checked), initialised, exclusive by the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(p, len) }
    }
}

impl std::fmt::Debug for LandingRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LandingRegion")
            .field("id", &self.id)
            .field("len_bytes", &self.len_bytes())
            .finish()
    }
}
