//! A read-only memory map of a store file, for the mapped expert backing:
//! records are used in place (no copy), `mincore` tells which records' pages
//! are in the page cache, and `madvise(WILLNEED)` asks the kernel to start
//! reading pages ahead.
//!
//! What a mapped store requires: it is not modified in place (written,
//! truncated, punched) while it is mapped. Replacing it by rename is safe: the
//! map and this value's descriptor keep the old inode, whose bytes do not
//! change. Bytes in the map are untrusted all the same; this module gives the
//! pool what it needs to check them before use:
//! - [`MappedFile::bytes_within`] checks (fstat) that the file's current
//!   length still covers an extent before handing out its bytes, so a
//!   truncated store is an [`IoError::Truncated`] naming file, offset, length
//!   and the file's size, not a SIGBUS on the first touch;
//! - [`MappedFile::check_epoch`] compares the file's length, modification and
//!   change times (fstat) with the last check and advances the *epoch* when
//!   any differs, or when the change time is less than [`SETTLE`] old (a
//!   write in the same timestamp granule would leave the times unchanged).
//!   The pool verifies a record's checksum again before it serves a record
//!   verified in an older epoch.
//!
//! Remaining windows (not closed here): a truncation that lands between the
//! length check and the touch of the pages still raises SIGBUS; bytes
//! rewritten in place between a check and their use are seen as rewritten
//! (the pool checks the epoch once per step and the length at every
//! hand-out, not per byte read); writes
//! through another process's shared writable map update the times only when
//! the kernel notices the page going dirty; and a drive error on a page the
//! kernel dropped and reads back on use is delivered as SIGBUS, which a
//! mapping cannot turn into an error (the slots backing reads every record
//! with `pread` and has none of these windows). A cold record's first touch
//! goes through `pread` (the pool reads it into scratch first), so drive errors
//! of that read are typed errors.
//!
//! Bounds: one mapping of the whole file (virtual address space, not memory);
//! `is_resident` allocates one byte per page of the queried extent; every
//! check is one `fstat`.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use memmap2::{Advice, Mmap};

use crate::error::IoError;

/// How old a file's change time must be before equal timestamps are taken to
/// mean "unchanged": longer than the coarsest timestamp granule of common
/// Linux file systems (1 s on ext4 with small inodes, 2 s on FAT).
pub const SETTLE: Duration = Duration::from_millis(2100);

/// What fstat says about the file, compared between checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    len_bytes: u64,
    mtime_ns: i128,
    ctime_ns: i128,
}

fn time_ns(secs: i64, nsecs: i64) -> i128 {
    i128::from(secs) * 1_000_000_000 + i128::from(nsecs)
}

/// Whether a file whose change time is `ctime_ns` can no longer be changed
/// without its timestamps changing, at wall time `now_ns`.
fn settled(ctime_ns: i128, now_ns: i128) -> bool {
    now_ns - ctime_ns > SETTLE.as_nanos() as i128
}

fn now_ns() -> i128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i128)
}

/// A read-only map of a whole file.
pub struct MappedFile {
    map: Mmap,
    file: std::fs::File,
    path: PathBuf,
    page_bytes: usize,
    /// The stamp at the last [`MappedFile::check_epoch`] (or open).
    last: Stamp,
    epoch: u64,
}

impl std::fmt::Debug for MappedFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MappedFile")
            .field("path", &self.path)
            .field("len_bytes", &self.map.len())
            .finish()
    }
}

fn stamp_of(meta: &std::fs::Metadata) -> Stamp {
    Stamp {
        len_bytes: meta.len(),
        mtime_ns: time_ns(meta.mtime(), meta.mtime_nsec()),
        ctime_ns: time_ns(meta.ctime(), meta.ctime_nsec()),
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
        let file = flashtier_format::open_regular_read(path)?;
        let meta = file.metadata().map_err(open_err)?;
        // SAFETY: the mapping is read-only and private to this value, and
        // lives no longer than it. Modifying a mapped file in place breaks the
        // store contract (module docs); if it happens anyway, the mapped bytes
        // change under the slices this value hands out (no memory is freed or
        // reused: the pages stay mapped), truncated pages would fault, which
        // `bytes_within` checks against before handing out an extent, and the
        // pool verifies every record's checksum before it serves it.
        let map = unsafe { Mmap::map(&file) }.map_err(open_err)?;
        Ok(Self {
            map,
            file,
            path: path.to_path_buf(),
            page_bytes: page_bytes(),
            last: stamp_of(&meta),
            epoch: 0,
        })
    }

    /// Path, for error messages.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Mapped length in bytes (the file's length when it was mapped).
    #[must_use]
    pub fn len_bytes(&self) -> usize {
        self.map.len()
    }

    fn stat_err(&self, offset: usize, len: usize, source: std::io::Error) -> IoError {
        IoError::Read {
            path: self.path.clone(),
            offset: offset as u64,
            len,
            source,
        }
    }

    fn stamp(&self, offset: usize, len: usize) -> Result<Stamp, IoError> {
        let meta = self
            .file
            .metadata()
            .map_err(|e| self.stat_err(offset, len, e))?;
        Ok(stamp_of(&meta))
    }

    /// The bytes of `[offset, offset + len)` after checking (fstat) that the
    /// file still covers them: [`IoError::Truncated`] when it has shrunk
    /// below the extent's end, [`IoError::Landing`] when the extent lies
    /// outside the map. Checking costs one `fstat`; a truncation racing
    /// between the check and the touch is the window the module docs name.
    pub fn bytes_within(&self, offset: usize, len: usize) -> Result<&[u8], IoError> {
        let Some(bytes) = self.bytes(offset, len) else {
            return Err(self.extent_err(offset, len, "out of bounds"));
        };
        let file_bytes = self.stamp(offset, len)?.len_bytes;
        if ((offset + len) as u64) > file_bytes {
            return Err(IoError::Truncated {
                path: self.path.clone(),
                offset: offset as u64,
                len,
                file_bytes,
            });
        }
        Ok(bytes)
    }

    /// Check (fstat) whether the file may have changed since the last check
    /// and return the epoch: it advances when the length, modification time
    /// or change time differs from the last check's, or when the change time
    /// is less than [`SETTLE`] old. Bytes verified in an older epoch must be
    /// verified again before use.
    pub fn check_epoch(&mut self) -> Result<u64, IoError> {
        let now = self.stamp(0, self.map.len())?;
        if now != self.last || !settled(now.ctime_ns, now_ns()) {
            self.epoch += 1;
        }
        self.last = now;
        Ok(self.epoch)
    }

    /// The epoch of the last [`MappedFile::check_epoch`] (no system call).
    #[must_use]
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The bytes of `[offset, offset + len)`, or `None` when outside the map.
    /// Unchecked against the file's length (touching them faults if the file
    /// was truncated since): callers go through [`MappedFile::bytes_within`].
    fn bytes(&self, offset: usize, len: usize) -> Option<&[u8]> {
        self.map.get(offset..offset.checked_add(len)?)
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

    #[test]
    fn a_truncated_extent_is_a_typed_error_not_a_fault() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("t.bin");
        std::fs::write(&path, vec![5u8; 4 * 4096]).expect("write");
        let m = MappedFile::open(&path).expect("map");
        assert_eq!(m.bytes_within(4096, 100).expect("covered"), &[5u8; 100]);
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .expect("open rw");
        f.set_len(4096 + 50).expect("truncate");
        match m.bytes_within(4096, 100) {
            Err(IoError::Truncated {
                offset,
                len,
                file_bytes,
                ..
            }) => assert_eq!((offset, len, file_bytes), (4096, 100, 4146)),
            other => panic!("expected Truncated, got {other:?}"),
        }
        let err = m.bytes_within(3 * 4096, 10).expect_err("past the end");
        let msg = err.to_string();
        assert!(
            msg.contains("t.bin") && msg.contains("offset 12288") && msg.contains("4146 bytes"),
            "{msg}"
        );
        // Bytes still inside the file are served.
        assert_eq!(m.bytes_within(4096, 50).expect("covered"), &[5u8; 50]);
        assert!(m.bytes_within(4 * 4096, 1).is_err(), "outside the map");
    }

    #[test]
    fn the_epoch_advances_on_a_change_and_while_the_file_is_fresh() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("e.bin");
        std::fs::write(&path, vec![1u8; 8192]).expect("write");
        let mut m = MappedFile::open(&path).expect("map");
        // Just written: its change time is inside the settle window.
        let e1 = m.check_epoch().expect("fstat");
        let e2 = m.check_epoch().expect("fstat");
        assert!(e2 > e1, "a fresh file is re-checked every time");
        assert_eq!(m.epoch(), e2);
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .expect("open rw");
        f.set_len(4096).expect("truncate");
        assert!(m.check_epoch().expect("fstat") > e2);
    }

    #[test]
    fn equal_times_mean_unchanged_only_once_settled() {
        let s = SETTLE.as_nanos() as i128;
        assert!(!settled(1_000, 1_000));
        assert!(!settled(1_000, 1_000 + s));
        assert!(settled(1_000, 1_000 + s + 1));
        // A change time in the future (clock skew) is never settled.
        assert!(!settled(1_000 + s, 1_000));
    }
}
