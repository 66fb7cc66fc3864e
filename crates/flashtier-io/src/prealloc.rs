//! Preallocating a store file before it is written with direct I/O.
//!
//! File systems such as ext4 take the inode lock exclusively for a direct
//! write that is not an overwrite (extending the file, or filling a hole), so
//! parallel direct writes into a fresh or sparse file run one at a time.
//! Allocating the extents first (`fallocate`, mode 0: allocated, reads as
//! zeros, file size set) turns every later write into an overwrite that can
//! run in parallel, which is how fio measures a drive's sequential write
//! bandwidth. Where the file system cannot preallocate, the file is sized with
//! `ftruncate` instead and the caller is told.

use crate::error::IoError;
use crate::file::StoreFile;

impl StoreFile {
    /// Allocate `len_bytes` from offset 0 and set the file size to at least
    /// that. Returns `false` (after sizing the file sparsely) where the file
    /// system does not support preallocation.
    pub fn preallocate(&self, len_bytes: u64) -> Result<bool, IoError> {
        let r = rustix::fs::fallocate(
            self.file(),
            rustix::fs::FallocateFlags::empty(),
            0,
            len_bytes,
        );
        match r {
            Ok(()) => Ok(true),
            Err(e) if e == rustix::io::Errno::OPNOTSUPP || e == rustix::io::Errno::NOSYS => {
                self.set_len(len_bytes)?;
                Ok(false)
            }
            Err(e) => Err(IoError::Write {
                path: self.path().to_path_buf(),
                offset: 0,
                len: usize::try_from(len_bytes).unwrap_or(usize::MAX),
                source: std::io::Error::from_raw_os_error(e.raw_os_error()),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::file::{DirectMode, StoreFile};

    #[test]
    fn preallocated_files_have_their_size_and_read_as_zeros() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("p.bin");
        let f = StoreFile::open_rw(&path, DirectMode::Off, true).expect("open");
        let allocated = f.preallocate(3 * 4096).expect("preallocate");
        if !allocated {
            eprintln!("skip: this file system cannot preallocate; the file was sized sparsely");
        }
        assert_eq!(f.len_bytes().expect("len"), 3 * 4096);
        assert_eq!(std::fs::read(&path).expect("read"), vec![0u8; 3 * 4096]);
    }
}
