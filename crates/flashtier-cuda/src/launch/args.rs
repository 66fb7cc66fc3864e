//! A kernel's arguments as owned bytes, so a launch can be queued, compared
//! with the launch a graph node holds, and issued later.

use std::ffi::c_void;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaSlice, DevicePtr};

/// Most arguments one kernel takes here.
pub const MAX_ARGS: usize = 16;

/// A type whose bytes are a kernel argument: plain old data with no
/// padding, so every byte is initialised and two equal values have equal
/// bytes.
///
/// # Safety
/// The type must have no padding and no invalid bit patterns, and its C
/// layout must be what the kernel's parameter expects.
pub unsafe trait KernelArg: Copy {}

// SAFETY: primitive numbers: no padding, every bit pattern valid.
unsafe impl KernelArg for i32 {}
// SAFETY: as above.
unsafe impl KernelArg for u32 {}
// SAFETY: as above.
unsafe impl KernelArg for i64 {}
// SAFETY: as above.
unsafe impl KernelArg for u64 {}
// SAFETY: as above.
unsafe impl KernelArg for f32 {}

/// The arguments of one launch: each value's bytes at its natural
/// alignment in 8-byte words, and where each starts.
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct Args {
    words: Vec<u64>,
    starts: Vec<u32>,
    end: usize,
}

impl std::fmt::Debug for Args {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Args({} values, {} bytes)", self.starts.len(), self.end)
    }
}

impl Args {
    /// No arguments yet.
    #[must_use]
    pub fn new() -> Self {
        Self {
            words: Vec::with_capacity(12),
            starts: Vec::with_capacity(MAX_ARGS),
            end: 0,
        }
    }

    /// Append `value` (aligned to at most 8 bytes).
    pub fn push<T: KernelArg>(&mut self, value: T) -> &mut Self {
        let (size, align) = (std::mem::size_of::<T>(), std::mem::align_of::<T>().min(8));
        let at = self.end.next_multiple_of(align);
        let end = at + size;
        self.words.resize(end.div_ceil(8), 0);
        // SAFETY: `T: KernelArg` has no padding, so its `size` bytes are all
        // initialised; the destination `at..end` lies inside `words` (resized
        // to cover `end` bytes) and does not overlap `value`.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (&raw const value).cast::<u8>(),
                self.words.as_mut_ptr().cast::<u8>().add(at),
                size,
            );
        }
        self.starts.push(at as u32);
        self.end = end;
        self
    }

    /// Append the device address of `buf`'s first element, as seen from
    /// `on`'s stream.
    pub fn buf<T>(&mut self, on: &impl OnStream, buf: &CudaSlice<T>) -> &mut Self {
        let (ptr, _sync) = buf.device_ptr(on.stream());
        self.push(ptr as CUdeviceptr)
    }

    /// Values pushed.
    #[must_use]
    pub fn len(&self) -> usize {
        self.starts.len()
    }

    /// None pushed?
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.starts.is_empty()
    }

    /// Pointers to each value, as `cuLaunchKernel`'s `kernelParams` wants
    /// them (the driver only reads through them); valid while `self` is
    /// neither moved nor changed.
    pub(crate) fn pointers(&self) -> Vec<*mut c_void> {
        let base = self.words.as_ptr().cast::<u8>();
        self.starts
            .iter()
            // SAFETY: each start lies inside `words` (see `push`).
            .map(|&s| unsafe { base.add(s as usize) }.cast_mut().cast::<c_void>())
            .collect()
    }
}

/// What owns the stream a launch's buffers are addressed on (the
/// [`crate::Gpu`]); kept as a trait so that the arguments need not know the
/// context that launches them.
pub trait OnStream {
    /// The stream.
    fn stream(&self) -> &std::sync::Arc<cudarc::driver::CudaStream>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_sit_at_their_alignment() {
        let mut a = Args::new();
        a.push(7i32).push(9u64).push(1.5f32);
        assert_eq!(a.starts, vec![0, 8, 16]);
        assert_eq!(a.end, 20);
        assert_eq!(a.words[0] & 0xffff_ffff, 7);
        assert_eq!(a.words[1], 9);
        assert_eq!(a.words[2] as u32, 1.5f32.to_bits());
        let mut b = Args::new();
        b.push(7i32).push(9u64).push(1.5f32);
        assert_eq!(a, b, "equal values give equal bytes");
        b = Args::new();
        b.push(7i32).push(9u64).push(2.5f32);
        assert_ne!(a, b);
    }
}
