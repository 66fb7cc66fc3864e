//! Opening store files under the O_DIRECT policy.
//!
//! Direct I/O is the default: cold numbers must not come from the page cache.
//! Alignment comes from `statx` (`STATX_DIOALIGN`) where the kernel reports
//! it, else 4096. Where the file system refuses O_DIRECT (tmpfs, NFS, SSHFS)
//! the file is opened buffered and a one-line warning says so, once per
//! file system; with [`DirectMode::Require`] that refusal is an error.
//!
//! Only regular files open: a FIFO, device, socket or directory is refused
//! with [`IoError::NotRegular`] before any `open(2)` that could block
//! ([`flashtier_format::regular`]), and the `O_NONBLOCK` the open uses is
//! cleared again before a backend sees the file.
//!
//! Reads: [`StoreFile::read_exact_at`] needs an aligned range on a direct
//! file; [`StoreFile::read_exact_at_staged`] takes any range, landing the
//! aligned window around it in a caller-owned staging buffer. Both retry
//! EINTR and short reads and name the caller's path, offset and length in
//! every error.

use std::collections::HashSet;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use flashtier_format::{OpenError, open_regular};

use crate::buf::{ALIGN, AlignedBuf};
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
                "unknown direct mode {other} (prefer | require | off)"
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
    /// Take an exclusive advisory lock (`flock`) on the file, held until
    /// this handle is dropped: while it is held, the same call on any other
    /// open of the file (another process, or another handle here) fails at
    /// once with [`IoError::InUse`]. For files one owner writes for its
    /// whole life (a KV store), so two writers never mix.
    pub fn lock_exclusive(&self) -> Result<(), IoError> {
        use rustix::fs::{FlockOperation, flock};
        match flock(&self.file, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => Ok(()),
            Err(e) if e == rustix::io::Errno::WOULDBLOCK => Err(IoError::InUse {
                path: self.path.clone(),
            }),
            Err(e) => Err(IoError::Lock {
                path: self.path.clone(),
                source: e.into(),
            }),
        }
    }

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
        let direct_file = if mode == DirectMode::Off {
            None
        } else {
            match open_regular(path, opts, libc::O_DIRECT) {
                Ok(f) => Some(f),
                Err(OpenError::Os { source, .. })
                    if source.raw_os_error() == Some(libc::EINVAL) =>
                {
                    None
                }
                Err(e) => return Err(e.into()),
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
                let f = open_regular(path, opts, 0)?;
                if mode == DirectMode::Prefer {
                    warn_buffered_once(&f, path);
                }
                (f, false)
            }
        };
        clear_nonblock(&file).map_err(|source| IoError::Open {
            path: path.to_path_buf(),
            source,
        })?;
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
    /// On a direct file `offset`, `dst.len()` and `dst` must be aligned
    /// ([`StoreFile::read_exact_at_staged`] takes any range).
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
        ask: impl FnMut(usize) -> usize,
    ) -> Result<(), IoError> {
        let len = dst.len();
        self.check_aligned(offset, len, dst.as_ptr())?;
        self.fill_at(dst, offset, len, ask)
            .map_err(|fault| self.read_fault(fault, offset, len, 0))
    }

    /// [`StoreFile::read_exact_at`] of any range, aligned or not: on a
    /// direct file the aligned window around the bytes lands in `staging`
    /// (replaced by a larger buffer when too small, so it never grows past
    /// the largest read plus twice the alignment), then they are copied to
    /// `dst`; a buffered file reads straight into `dst`. The window may run
    /// past the end of the file: only the bytes asked for must exist. Errors
    /// name `offset` and `dst.len()`, not the window.
    pub fn read_exact_at_staged(
        &self,
        dst: &mut [u8],
        offset: u64,
        staging: &mut AlignedBuf,
    ) -> Result<(), IoError> {
        if !self.direct {
            return self.read_exact_at(dst, offset);
        }
        let len = dst.len();
        let align = self.offset_align as u64;
        let start = offset - offset % align;
        // Below `align` (at most 4096): fits a usize.
        let head = (offset - start) as usize;
        let need = head + len;
        let window = need.next_multiple_of(self.offset_align);
        if staging.capacity() < window {
            *staging = AlignedBuf::zeroed(window);
        }
        let Some(buf) = staging.as_full_mut().get_mut(..window) else {
            return Err(IoError::Invalid(format!(
                "staging buffer of {} bytes for a {window}-byte window",
                staging.capacity()
            )));
        };
        self.check_aligned(start, window, buf.as_ptr())?;
        self.fill_at(buf, start, need, |rest| rest)
            .map_err(|fault| self.read_fault(fault, offset, len, head))?;
        let landed = buf.get(head..need).ok_or_else(|| {
            IoError::Invalid(format!("window of {window} bytes holds no {len} at {head}"))
        })?;
        dst.copy_from_slice(landed);
        Ok(())
    }

    /// Read into `buf` from `offset` until at least `need` bytes landed
    /// (`buf` may be longer: a direct window past the bytes wanted),
    /// retrying EINTR and short reads; each `read_at` asks for `ask(rest)`
    /// bytes (clamped to `1..=rest`) of the `rest` of `buf`. At most one
    /// read per byte of `buf`.
    fn fill_at(
        &self,
        buf: &mut [u8],
        offset: u64,
        need: usize,
        mut ask: impl FnMut(usize) -> usize,
    ) -> Result<(), ReadFault> {
        let mut done = 0usize;
        while done < need {
            let rest = buf.len() - done;
            let want = ask(rest).clamp(1, rest);
            let Some(part) = buf.get_mut(done..done + want) else {
                return Err(ReadFault::Eof(done));
            };
            match self.file.read_at(part, offset + done as u64) {
                Ok(0) => return Err(ReadFault::Eof(done)),
                Ok(n) => {
                    done += n;
                    // Direct I/O stops short of an aligned boundary only at
                    // end of file; asking again would fail with EINVAL.
                    let next = offset + done as u64;
                    if done < need && self.direct && next % self.offset_align as u64 != 0 {
                        return Err(ReadFault::Eof(done));
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(ReadFault::Os(e)),
            }
        }
        Ok(())
    }

    /// The error of a failed [`StoreFile::fill_at`] for the caller's range
    /// (`len` bytes at `offset`, found `head` bytes into what was read).
    fn read_fault(&self, fault: ReadFault, offset: u64, len: usize, head: usize) -> IoError {
        match fault {
            ReadFault::Eof(done) => IoError::ShortRead {
                path: self.path.clone(),
                offset,
                len,
                got: done.saturating_sub(head).min(len),
            },
            ReadFault::Os(source) => IoError::Read {
                path: self.path.clone(),
                offset,
                len,
                source,
            },
        }
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

/// A store's header and tables (and, for tools and tests, its records) read
/// through this handle: [`flashtier_format::Store::read_from`] and
/// [`flashtier_format::Store::read_record`] take it. Any range is allowed,
/// direct or not ([`StoreFile::read_exact_at_staged`]).
impl flashtier_format::ByteSource for StoreFile {
    fn len_bytes(&self) -> std::io::Result<u64> {
        Ok(self.file.metadata()?.len())
    }

    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        let mut staging = AlignedBuf::zeroed(0);
        // The caller's error (FormatError::Io) names the path, offset and
        // length; the source keeps the kind and what happened.
        self.read_exact_at_staged(buf, offset, &mut staging)
            .map_err(|e| match e {
                IoError::Read { source, .. } => source,
                IoError::ShortRead { got, .. } => std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!("the file ended after {got} of the bytes"),
                ),
                other => std::io::Error::other(other.to_string()),
            })
    }
}

/// How a positional read fell short.
enum ReadFault {
    /// End of file after this many bytes.
    Eof(usize),
    /// The kernel failed the read.
    Os(std::io::Error),
}

/// Clear the `O_NONBLOCK` that [`open_regular`] opens with: io_uring would
/// honour it and end a read that has to wait for the drive with EAGAIN.
fn clear_nonblock(file: &File) -> std::io::Result<()> {
    use rustix::fs::{OFlags, fcntl_getfl, fcntl_setfl};
    let flags = fcntl_getfl(file)?;
    fcntl_setfl(file, flags - OFlags::NONBLOCK)?;
    Ok(())
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
