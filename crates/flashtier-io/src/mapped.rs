//! A read-only memory map of a store file, for the mapped expert backing:
//! records are used in place (no copy), `mincore` tells which records' pages
//! are in the page cache, and `madvise(WILLNEED)` asks the kernel to start
//! reading pages ahead.
//!
//! Contract: store files are immutable once packed. Truncating or rewriting a
//! mapped store while it is mapped is outside this contract (the kernel would
//! deliver SIGBUS on access to truncated pages, and rewritten bytes would be
//! seen); the expert pool checks each record's checksum when it is first
//! admitted from disk.
//!
//! Bounds: one mapping of the whole file (virtual address space, not memory);
//! `residency` allocates one byte per page of the queried extent.

use std::path::{Path, PathBuf};

use memmap2::{Advice, Mmap};

use crate::error::IoError;

/// A read-only map of a whole file.
pub struct MappedFile {
    map: Mmap,
    file: std::fs::File,
    path: PathBuf,
    page_bytes: usize,
}

impl std::fmt::Debug for MappedFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MappedFile")
            .field("path", &self.path)
            .field("len_bytes", &self.map.len())
            .finish()
    }
}

fn page_bytes() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p).ok().filter(|&p| p > 0).unwrap_or(4096)
}

impl MappedFile {
    /// Map `path` read-only.
    pub fn open(path: &Path) -> Result<Self, IoError> {
        let open_err = |source| IoError::Open {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::open(path).map_err(open_err)?;
        // SAFETY: the mapping is read-only and private to this value; the
        // store-file contract (module docs) is that nobody truncates or
        // rewrites the file while it is mapped, so every byte of the map stays
        // valid and unchanged for the map's lifetime.
        let map = unsafe { Mmap::map(&file) }.map_err(open_err)?;
        Ok(Self {
            map,
            file,
            path: path.to_path_buf(),
            page_bytes: page_bytes(),
        })
    }

    /// Path, for error messages.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Mapped length in bytes.
    #[must_use]
    pub fn len_bytes(&self) -> usize {
        self.map.len()
    }

    /// The bytes of `[offset, offset + len)`, or `None` when outside the map.
    #[must_use]
    pub fn bytes(&self, offset: usize, len: usize) -> Option<&[u8]> {
        self.map.get(offset..offset.checked_add(len)?)
    }

    /// Address of the byte at `offset` (for handing to a device that reads
    /// host memory), or `None` when outside the map.
    #[must_use]
    pub fn addr(&self, offset: usize) -> Option<u64> {
        self.bytes(offset, 0).map(|b| b.as_ptr() as u64)
    }

    fn extent_err(&self, offset: usize, len: usize, what: &str) -> IoError {
        IoError::Landing {
            path: self.path.clone(),
            offset: offset as u64,
            len,
            what: format!("mapped extent {what} (map of {} bytes)", self.map.len()),
        }
    }

    /// Page-aligned `(start, len)` covering `[offset, offset + len)`.
    fn page_span(&self, offset: usize, len: usize) -> Result<(usize, usize), IoError> {
        let end = offset
            .checked_add(len)
            .filter(|&e| e <= self.map.len())
            .ok_or_else(|| self.extent_err(offset, len, "out of bounds"))?;
        let start = offset - offset % self.page_bytes;
        Ok((start, end - start))
    }

    /// Whether every page of `[offset, offset + len)` is in memory (page
    /// cache), by `mincore`.
    pub fn is_resident(&self, offset: usize, len: usize) -> Result<bool, IoError> {
        if len == 0 {
            return Ok(true);
        }
        let (start, span) = self.page_span(offset, len)?;
        let pages = span.div_ceil(self.page_bytes);
        let mut vec = vec![0u8; pages];
        // SAFETY: `start` is page-aligned and `[start, start + span)` lies in
        // the live mapping (checked by page_span); `vec` has one byte per page
        // of that span, as mincore requires.
        let rc = unsafe {
            libc::mincore(
                self.map.as_ptr().add(start).cast_mut().cast(),
                span,
                vec.as_mut_ptr().cast(),
            )
        };
        if rc != 0 {
            return Err(IoError::Read {
                path: self.path.clone(),
                offset: offset as u64,
                len,
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(vec.iter().all(|v| v & 1 == 1))
    }

    /// Ask the kernel to drop the clean cached pages of `[offset, offset +
    /// len)` (`posix_fadvise(DONTNEED)`), so the next use reads the drive:
    /// for cold-read benchmarks and tests. Advisory: pages in use may stay.
    pub fn drop_cached(&self, offset: usize, len: usize) -> Result<(), IoError> {
        use std::os::fd::AsRawFd;
        let (start, span) = self.page_span(offset, len)?;
        let as_off = |v: usize| libc::off_t::try_from(v).unwrap_or(libc::off_t::MAX);
        // SAFETY: posix_fadvise only reads its integer arguments; the fd is
        // owned by `self.file` and open for the call's duration.
        let rc = unsafe {
            libc::posix_fadvise(
                self.file.as_raw_fd(),
                as_off(start),
                as_off(span),
                libc::POSIX_FADV_DONTNEED,
            )
        };
        if rc != 0 {
            return Err(IoError::Read {
                path: self.path.clone(),
                offset: offset as u64,
                len,
                source: std::io::Error::from_raw_os_error(rc),
            });
        }
        Ok(())
    }

    /// Ask the kernel to read `[offset, offset + len)` ahead (non-blocking).
    pub fn will_need(&self, offset: usize, len: usize) -> Result<(), IoError> {
        let (start, span) = self.page_span(offset, len)?;
        self.map
            .advise_range(Advice::WillNeed, start, span)
            .map_err(|source| IoError::Read {
                path: self.path.clone(),
                offset: offset as u64,
                len,
                source,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_reads_and_reports_residency() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("m.bin");
        let data: Vec<u8> = (0..3 * 4096u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &data).expect("write");
        let m = MappedFile::open(&path).expect("map");
        assert_eq!(m.len_bytes(), data.len());
        assert_eq!(m.bytes(4096, 10), Some(&data[4096..4106]));
        assert!(m.bytes(3 * 4096 - 1, 2).is_none());
        m.will_need(0, 8192).expect("advise");
        // Touch every page: then all are resident.
        let sum: u64 = m
            .bytes(0, data.len())
            .expect("in range")
            .iter()
            .map(|&b| u64::from(b))
            .sum();
        assert!(sum > 0);
        assert!(m.is_resident(100, 8000).expect("mincore"));
        assert!(m.is_resident(0, 3 * 4096 + 1).is_err());
    }
}
