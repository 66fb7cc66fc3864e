//! Opening store files under the O_DIRECT policy.
//!
//! Direct I/O is the default: cold numbers must not come from the page cache.
//! Alignment comes from `statx` (`STATX_DIOALIGN`) where the kernel reports
//! it, else 4096. Where the file system refuses O_DIRECT (tmpfs, NFS, SSHFS)
//! the file is opened buffered and a one-line warning says so, once per
//! file system; with [`DirectMode::Require`] that refusal is an error.

use std::collections::HashSet;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::buf::ALIGN;
use crate::error::IoError;

/// How to treat O_DIRECT.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DirectMode {
    /// Direct where the file system allows it, buffered with a warning elsewhere.
    #[default]
    Prefer,
    /// Direct or an error.
    Require,
    /// Buffered (page cache), e.g. for the mapped expert backing.
    Off,
}

impl std::str::FromStr for DirectMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "prefer" | "auto" => Ok(Self::Prefer),
            "require" => Ok(Self::Require),
            "off" | "buffered" => Ok(Self::Off),
            other => Err(format!(
                "unknown direct mode {other:?} (prefer | require | off)"
            )),
        }
    }
}

static NEXT_FILE_ID: AtomicU64 = AtomicU64::new(1);
static WARNED_DEVS: Mutex<Option<HashSet<u64>>> = Mutex::new(None);

/// An open store file with its I/O properties.
#[derive(Debug)]
pub struct StoreFile {
    file: File,
    path: PathBuf,
    direct: bool,
    offset_align: usize,
    mem_align: usize,
    id: u64,
}

impl StoreFile {
    /// Open for reading.
    pub fn open_read(path: &Path, mode: DirectMode) -> Result<Arc<Self>, IoError> {
        Self::open_with(path, mode, OpenOptions::new().read(true))
    }

    /// Open for reading and writing, creating the file when `create`.
    pub fn open_rw(path: &Path, mode: DirectMode, create: bool) -> Result<Arc<Self>, IoError> {
        Self::open_with(
            path,
            mode,
            OpenOptions::new().read(true).write(true).create(create),
        )
    }

    fn open_with(path: &Path, mode: DirectMode, opts: &OpenOptions) -> Result<Arc<Self>, IoError> {
        let open_err = |source| IoError::Open {
            path: path.to_path_buf(),
            source,
        };
        refuse_special(path).map_err(open_err)?;
        let direct_file = if mode == DirectMode::Off {
            None
        } else {
            match opts.clone().custom_flags(libc::O_DIRECT).open(path) {
                Ok(f) => Some(f),
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => None,
                Err(e) => return Err(open_err(e)),
            }
        };
        let (file, direct) = match direct_file {
            Some(f) => (f, true),
            None if mode == DirectMode::Require => {
                return Err(IoError::DirectRefused {
                    path: path.to_path_buf(),
                });
            }
            None => {
                let f = opts.open(path).map_err(open_err)?;
                if mode == DirectMode::Prefer {
                    warn_buffered_once(&f, path);
                }
                (f, false)
            }
        };
        let (mem_align, offset_align) = if direct { dio_alignment(&file) } else { (1, 1) };
        Ok(Arc::new(Self {
            file,
            path: path.to_path_buf(),
            direct,
            offset_align,
            mem_align,
            id: NEXT_FILE_ID.fetch_add(1, Ordering::Relaxed),
        }))
    }

    /// Path, for error messages.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether reads bypass the page cache.
    #[must_use]
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// Required alignment of offsets and lengths (1 when buffered).
    #[must_use]
    pub fn offset_align(&self) -> usize {
        self.offset_align
    }

    /// Required alignment of memory (1 when buffered).
    #[must_use]
    pub fn mem_align(&self) -> usize {
        self.mem_align
    }

    /// Process-unique id (backends key registrations by it).
    #[must_use]
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The underlying file.
    #[must_use]
    pub fn file(&self) -> &File {
        &self.file
    }

    /// Current length of the file in bytes.
    pub fn len_bytes(&self) -> Result<u64, IoError> {
        self.file
            .metadata()
            .map(|m| m.len())
            .map_err(|source| IoError::Open {
                path: self.path.clone(),
                source,
            })
    }

    /// Check a request against the direct-I/O alignment rules.
    pub fn check_aligned(&self, offset: u64, len: usize, mem: *const u8) -> Result<(), IoError> {
        let oa = self.offset_align as u64;
        let bad = offset % oa != 0 || len as u64 % oa != 0 || (mem as usize) % self.mem_align != 0;
        if bad {
            return Err(IoError::Misaligned {
                path: self.path.clone(),
                offset,
                len,
                align: self.offset_align.max(self.mem_align),
            });
        }
        Ok(())
    }

    /// Blocking positional read of exactly `dst.len()` bytes at `offset`,
    /// retrying EINTR and short reads; EOF before the end is [`IoError::ShortRead`].
    pub fn read_exact_at(&self, dst: &mut [u8], offset: u64) -> Result<(), IoError> {
        self.read_exact_at_parts(dst, offset, |rest| rest)
    }

    /// [`StoreFile::read_exact_at`], each `read_at` asking for `ask(rest)`
    /// bytes (clamped to `1..=rest`) of the `rest` still to read: the
    /// seeded simulator asks for less, as a kernel may return less, so the
    /// same loop meets its short reads.
    pub(crate) fn read_exact_at_parts(
        &self,
        dst: &mut [u8],
        offset: u64,
        mut ask: impl FnMut(usize) -> usize,
    ) -> Result<(), IoError> {
        let len = dst.len();
        self.check_aligned(offset, len, dst.as_ptr())?;
        let mut done = 0usize;
        while done < len {
            let want = ask(len - done).clamp(1, len - done);
            let Some(rest) = dst.get_mut(done..done + want) else {
                break;
            };
            let short = |got: usize| IoError::ShortRead {
                path: self.path.clone(),
                offset,
                len,
                got,
            };
            match self.file.read_at(rest, offset + done as u64) {
                Ok(0) => return Err(short(done)),
                Ok(n) => {
                    done += n;
                    // Direct I/O stops short of an aligned boundary only at
                    // end of file; asking again would fail with EINVAL.
                    let next = offset + done as u64;
                    if done < len && self.direct && next % self.offset_align as u64 != 0 {
                        return Err(short(done));
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(source) => {
                    return Err(IoError::Read {
                        path: self.path.clone(),
                        offset,
                        len,
                        source,
                    });
                }
            }
        }
        Ok(())
    }

    /// Blocking positional write of all of `src` at `offset`, retrying EINTR
    /// and short writes.
    pub fn write_all_at(&self, src: &[u8], offset: u64) -> Result<(), IoError> {
        let len = src.len();
        self.check_aligned(offset, len, src.as_ptr())?;
        let mut done = 0usize;
        while done < len {
            let Some(rest) = src.get(done..) else { break };
            match self.file.write_at(rest, offset + done as u64) {
                Ok(n) if n > 0 => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                failed => {
                    // A write of nothing would never finish: WriteZero.
                    let source = failed
                        .err()
                        .unwrap_or_else(|| std::io::ErrorKind::WriteZero.into());
                    return Err(IoError::Write {
                        path: self.path.clone(),
                        offset,
                        len,
                        source,
                    });
                }
            }
        }
        Ok(())
    }

    /// Grow or shrink the file to `len` bytes.
    pub fn set_len(&self, len: u64) -> Result<(), IoError> {
        self.file.set_len(len).map_err(|source| IoError::Write {
            path: self.path.clone(),
            offset: len,
            len: 0,
            source,
        })
    }

    /// Flush data to stable storage.
    pub fn sync_data(&self) -> Result<(), IoError> {
        self.file.sync_data().map_err(|source| IoError::Write {
            path: self.path.clone(),
            offset: 0,
            len: 0,
            source,
        })
    }
}

/// Refuse a path that exists and is not a regular file, from its metadata
/// alone: opening a FIFO for reading blocks until a writer appears, and a
/// device node, socket or directory is no store. A missing path passes (the
/// open reports it, or creates the file).
fn refuse_special(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::FileTypeExt;
    let Ok(meta) = std::fs::metadata(path) else {
        return Ok(());
    };
    let t = meta.file_type();
    let what = if t.is_file() {
        return Ok(());
    } else if t.is_fifo() {
        "a FIFO (named pipe)"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_dir() {
        "a directory"
    } else {
        "not a regular file"
    };
    Err(std::io::Error::new(
        std::io::ErrorKind::InvalidInput,
        format!("{what}; a store must be a regular file"),
    ))
}

/// `(mem_align, offset_align)` for direct I/O on `file`.
fn dio_alignment(file: &File) -> (usize, usize) {
    use rustix::fs::{AtFlags, StatxFlags, statx};
    match statx(file, "", AtFlags::EMPTY_PATH, StatxFlags::DIOALIGN) {
        Ok(st) if st.stx_mask & StatxFlags::DIOALIGN.bits() != 0 && st.stx_dio_offset_align > 0 => {
            let mem = (st.stx_dio_mem_align as usize).clamp(1, ALIGN);
            let off = (st.stx_dio_offset_align as usize).clamp(1, ALIGN);
            (mem, off)
        }
        _ => (ALIGN, ALIGN),
    }
}

fn warn_buffered_once(file: &File, path: &Path) {
    use std::os::unix::fs::MetadataExt;
    let dev = file.metadata().map(|m| m.dev()).unwrap_or(0);
    let mut guard = WARNED_DEVS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if guard.get_or_insert_with(HashSet::new).insert(dev) {
        eprintln!(
            "flashtier: warning: {} is on a file system that refuses O_DIRECT; using buffered I/O (page cache) for it",
            path.display()
        );
        tracing::warn!(path = %path.display(), "O_DIRECT refused; buffered I/O");
    }
}
