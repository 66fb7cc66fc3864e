//! Writing a user-visible file so that it is never lost, never half-written
//! under its name, and never interleaved with another writer's bytes.
//!
//! Every flashtier writer of a final file by name (the expert packer, the
//! low-bit companion writer, the row-shard packer) goes through an
//! [`Output`]:
//!
//! 1. [`refuse_inputs`]: the output must not be, or resolve to (through
//!    symlinks, or hard links: the device and inode are compared as well as
//!    the canonical paths), a file the writer reads.
//! 2. [`Output::lock`]: an advisory `flock` on a lock file beside the output
//!    (`.NAME.lock` in the output's folder), held until the `Output` is
//!    dropped. A second writer of the same output waits (saying once, on the
//!    `tracing` warn level, "waiting for another writer of X"), or with
//!    [`Wait::Fail`] gets [`PersistError::Busy`] at once. Flashtier writers
//!    in threads of one process exclude each other too (each lock is its own
//!    open file description). The lock file is unlinked by its holder before
//!    release; a waiter that then gets the lock on the unlinked file notices
//!    (its inode no longer has the name) and locks the new one.
//! 3. [`Output::existing`]: under the lock, the file already at the output
//!    is absent, or a regular file that starts with the writer's magic;
//!    anything else (a text file, a directory, another kind of flashtier
//!    file) is [`PersistError::NotReplaceable`], and is left alone. A writer
//!    may decide here to reuse a complete output another writer just made.
//! 4. [`Output::create_temp`]: a new file with a unique name
//!    (`.NAME.XXXXXX.tmp`, created `O_EXCL`, mode 0666 less the umask) in
//!    the output's folder, so the final rename never crosses a file system.
//!    The caller writes it through any handle it likes (buffered, or
//!    reopened by path with O_DIRECT).
//! 5. [`Output::commit`]: `fsync` the temp file, `rename` it over the
//!    output, `fsync` the folder. Readers see the old file or the complete
//!    new one, never a part; after `commit` returns, both the bytes and the
//!    name survive a crash.
//!
//! Cleanup: an `Output` dropped without a successful commit (an error
//! return, a panic unwinding, a failed fsync or rename) removes its temp
//! file, so a failed write leaves neither a temp file nor a new output. A
//! process killed by a signal cannot run that cleanup; the next writer of
//! the same output removes such stale `.NAME.XXXXXX.tmp` files once it
//! holds the lock (no other flashtier writer of that output can be active
//! then).
//!
//! Bounds: one lock file and at most one temp file per `Output`; taking the
//! lock retries at most [`LOCK_ATTEMPTS`] times when the lock file is
//! replaced under a waiter.
//!
//! ```
//! use flashtier_io::persist::{FileKind, Output, Wait};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = tempfile::tempdir()?;
//! let path = dir.path().join("data.bin");
//! let kind = FileKind { name: "example file", magic: b"EXAMPLE1" };
//! let mut out = Output::lock(&path, Wait::Block)?;
//! out.existing(kind)?; // absent, or an older EXAMPLE1 file
//! let tmp = out.create_temp()?.to_path_buf();
//! std::fs::write(&tmp, b"EXAMPLE1 payload")?;
//! out.commit()?;
//! assert_eq!(std::fs::read(&path)?, b"EXAMPLE1 payload");
//! assert_eq!(std::fs::read_dir(dir.path())?.count(), 1); // no temp, no lock file
//! # Ok(()) }
//! ```

use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use rustix::fs::FlockOperation;

mod error;
pub use error::PersistError;

/// Times [`Output::lock`] retries when the lock file it locked was unlinked
/// by its previous holder (each retry follows another writer's release).
pub const LOCK_ATTEMPTS: u32 = 10_000;

/// What a writer does when another writer holds the output's lock.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Wait {
    /// Wait for the other writer to finish.
    #[default]
    Block,
    /// Fail at once with [`PersistError::Busy`].
    Fail,
}

/// The kind of file a writer may replace: a regular file beginning with
/// `magic`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileKind {
    /// What the file is, for messages ("flashtier expert store").
    pub name: &'static str,
    /// Its first bytes.
    pub magic: &'static [u8],
}

/// What [`Output::existing`] found at the output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Existing {
    /// Nothing.
    Absent,
    /// A regular file with the kind's magic (it may still be damaged).
    SameKind,
}

/// Where the output's bytes will land: the canonical path of the file (its
/// symlinks followed), or of its folder joined with its name when absent.
pub fn resolve(out: &Path) -> Result<PathBuf, PersistError> {
    let err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| PersistError::Resolve { path, source }
    };
    match std::fs::canonicalize(out) {
        Ok(p) => return Ok(p),
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(err(out)(e)),
        Err(_) if out.symlink_metadata().is_ok() => {
            return Err(err(out)(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "a symlink to a file that does not exist",
            )));
        }
        Err(_) => {}
    }
    let name = out.file_name().ok_or_else(|| {
        err(out)(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "the path names no file",
        ))
    })?;
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let dir = std::fs::canonicalize(parent).map_err(err(parent))?;
    Ok(dir.join(name))
}

/// Refuse an output that is, or resolves to, one of `inputs`: the same
/// canonical path (symlinks followed) or the same device and inode (hard
/// links). Inputs that do not exist are skipped.
pub fn refuse_inputs(out: &Path, inputs: &[PathBuf]) -> Result<(), PersistError> {
    let target = resolve(out)?;
    let target_id = std::fs::metadata(&target).ok().map(|m| (m.dev(), m.ino()));
    for input in inputs {
        let Ok(meta) = std::fs::metadata(input) else {
            continue;
        };
        let canonical = std::fs::canonicalize(input).unwrap_or_else(|_| input.clone());
        let how = if canonical == target {
            let linked = out.symlink_metadata().is_ok_and(|m| m.is_symlink());
            if linked {
                "it is a symlink to"
            } else {
                "it is"
            }
        } else if target_id == Some((meta.dev(), meta.ino())) {
            "it is a hard link to"
        } else {
            continue;
        };
        return Err(PersistError::OutputIsInput {
            out: out.to_path_buf(),
            input: input.clone(),
            how,
        });
    }
    Ok(())
}

/// What is at `path`: absent, or a regular file beginning with `kind`'s
/// magic; anything else (a directory, a file without the magic) is
/// [`PersistError::NotReplaceable`]. Without the lock this is an early check
/// only; [`Output::existing`] is the one that counts.
pub fn existing(path: &Path, kind: FileKind) -> Result<Existing, PersistError> {
    let inspect = |source| PersistError::Inspect {
        path: path.to_path_buf(),
        source,
    };
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Existing::Absent),
        Err(e) => return Err(inspect(e)),
    };
    let refuse = |found: String| PersistError::NotReplaceable {
        path: path.to_path_buf(),
        expected: kind.name,
        found,
    };
    if meta.is_dir() {
        return Err(refuse("it is a directory".into()));
    }
    if !meta.is_file() {
        return Err(refuse("it is not a regular file".into()));
    }
    let mut head = Vec::with_capacity(kind.magic.len());
    File::open(path)
        .and_then(|f| f.take(kind.magic.len() as u64).read_to_end(&mut head))
        .map_err(inspect)?;
    if head != kind.magic {
        let magic = String::from_utf8_lossy(kind.magic);
        return Err(refuse(format!(
            "a {}-byte file that does not start with the magic {}",
            meta.len(),
            magic.trim_end_matches('\0')
        )));
    }
    Ok(Existing::SameKind)
}

/// A locked output being written; see the module docs.
#[derive(Debug)]
pub struct Output {
    target: PathBuf,
    lock_path: PathBuf,
    // Held (flock) for the life of the Output; closed after `Drop::drop`
    // has removed the temp file and unlinked the lock file.
    lock: File,
    temp: Option<Temp>,
}

#[derive(Debug)]
struct Temp {
    file: File,
    // Removes the file when dropped, unless persisted.
    path: tempfile::TempPath,
}

fn file_name_of(target: &Path) -> String {
    target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

fn folder_of(target: &Path) -> &Path {
    target.parent().unwrap_or_else(|| Path::new("/"))
}

impl Output {
    /// Take the writer's lock of `out` (resolved through symlinks), waiting
    /// or failing per `wait`, and remove stale temp files of killed writers.
    pub fn lock(out: &Path, wait: Wait) -> Result<Self, PersistError> {
        let target = resolve(out)?;
        let lock_path = folder_of(&target).join(format!(".{}.lock", file_name_of(&target)));
        let lock = lock_file(&target, &lock_path, wait)?;
        let output = Self {
            target,
            lock_path,
            lock,
            temp: None,
        };
        output.sweep_stale_temps();
        Ok(output)
    }

    /// The resolved path the output is written to.
    #[must_use]
    pub fn target(&self) -> &Path {
        &self.target
    }

    /// What is at the output now: see [`existing`].
    pub fn existing(&self, kind: FileKind) -> Result<Existing, PersistError> {
        existing(&self.target, kind)
    }

    /// Create the temp file (replacing an earlier one of this `Output`) and
    /// return its path.
    pub fn create_temp(&mut self) -> Result<&Path, PersistError> {
        self.temp = None;
        let dir = folder_of(&self.target);
        let prefix = format!(".{}.", file_name_of(&self.target));
        let named = tempfile::Builder::new()
            .prefix(&prefix)
            .suffix(".tmp")
            .rand_bytes(TEMP_RAND_CHARS)
            .permissions(std::fs::Permissions::from_mode(0o666))
            .tempfile_in(dir)
            .map_err(|source| PersistError::Temp {
                path: self.target.clone(),
                dir: dir.to_path_buf(),
                source,
            })?;
        let (file, path) = named.into_parts();
        let temp = self.temp.insert(Temp { file, path });
        Ok(&temp.path)
    }

    /// `fsync` the temp file, rename it over the output, `fsync` the folder,
    /// release the lock. On error the temp file is removed.
    pub fn commit(mut self) -> Result<(), PersistError> {
        let temp = self.temp.take().ok_or_else(|| PersistError::NoTemp {
            path: self.target.clone(),
        })?;
        let from = temp.path.to_path_buf();
        temp.file.sync_all().map_err(|source| PersistError::Sync {
            path: from.clone(),
            source,
        })?;
        drop(temp.file);
        // On failure the error hands the TempPath back; dropping it removes the file.
        temp.path
            .persist(&self.target)
            .map_err(|e| PersistError::Rename {
                from,
                to: self.target.clone(),
                source: e.error,
            })?;
        sync_dir(folder_of(&self.target))
    }

    /// Remove `.NAME.XXXXXX.tmp` files left by writers that were killed.
    fn sweep_stale_temps(&self) {
        let prefix = format!(".{}.", file_name_of(&self.target));
        let Ok(entries) = std::fs::read_dir(folder_of(&self.target)) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            let middle = name
                .strip_prefix(&prefix)
                .and_then(|rest| rest.strip_suffix(".tmp"));
            let ours = middle.is_some_and(|m| {
                m.len() == TEMP_RAND_CHARS && m.bytes().all(|b| b.is_ascii_alphanumeric())
            });
            if ours && std::fs::remove_file(entry.path()).is_ok() {
                tracing::info!(path = %entry.path().display(), "removed a stale temp file of a killed writer");
            }
        }
    }
}

/// Random characters in a temp file's name.
const TEMP_RAND_CHARS: usize = 6;

impl Drop for Output {
    fn drop(&mut self) {
        // Removes the temp file unless it was committed.
        self.temp = None;
        // Still holding the lock: a waiter on this inode re-checks the name
        // after it gets the lock and moves on to a fresh lock file.
        let _ = std::fs::remove_file(&self.lock_path);
        let _ = rustix::fs::flock(&self.lock, FlockOperation::Unlock);
    }
}

/// Open and lock `lock_path`, retrying while the locked inode is not the
/// one the name points at (its holder unlinked it on release).
fn lock_file(target: &Path, lock_path: &Path, wait: Wait) -> Result<File, PersistError> {
    let lock_err = |source: std::io::Error| PersistError::Lock {
        path: target.to_path_buf(),
        lock: lock_path.to_path_buf(),
        source,
    };
    let mut told = false;
    for _ in 0..LOCK_ATTEMPTS {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(lock_path)
            .map_err(lock_err)?;
        match rustix::fs::flock(&file, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => {}
            Err(e) if e == rustix::io::Errno::WOULDBLOCK && wait == Wait::Fail => {
                return Err(PersistError::Busy {
                    path: target.to_path_buf(),
                    lock: lock_path.to_path_buf(),
                });
            }
            Err(e) if e == rustix::io::Errno::WOULDBLOCK => {
                if !told {
                    tracing::warn!("waiting for another writer of {}", target.display());
                    told = true;
                }
                flock_blocking(&file).map_err(lock_err)?;
            }
            Err(e) => return Err(lock_err(e.into())),
        }
        let held = file.metadata().map_err(lock_err)?;
        let named = std::fs::metadata(lock_path);
        if named.is_ok_and(|n| (n.dev(), n.ino()) == (held.dev(), held.ino())) {
            return Ok(file);
        }
    }
    Err(lock_err(std::io::Error::other(format!(
        "the lock file was replaced {LOCK_ATTEMPTS} times while waiting"
    ))))
}

fn flock_blocking(file: &File) -> std::io::Result<()> {
    loop {
        match rustix::fs::flock(file, FlockOperation::LockExclusive) {
            Err(e) if e == rustix::io::Errno::INTR => {}
            r => return r.map_err(Into::into),
        }
    }
}

/// Write `bytes` as the whole of `path` through an [`Output`] (lock, temp
/// file, fsync, rename, folder fsync): no partial file is ever visible
/// under `path` and a failure leaves no temp file. No kind check: for
/// outputs such as JSON reports that the caller may replace whatever they
/// hold (refuse the caller's inputs with [`refuse_inputs`] first).
pub fn write_file(path: &Path, bytes: &[u8], wait: Wait) -> Result<(), PersistError> {
    use std::io::Write as _;
    let mut out = Output::lock(path, wait)?;
    out.create_temp()?;
    if let Some(temp) = out.temp.as_mut() {
        temp.file
            .write_all(bytes)
            .map_err(|source| PersistError::Write {
                path: temp.path.to_path_buf(),
                source,
            })?;
    }
    out.commit()
}

/// `fsync` a folder so a rename in it is durable. File systems that cannot
/// sync a folder (EINVAL) are accepted.
fn sync_dir(dir: &Path) -> Result<(), PersistError> {
    let synced = File::open(dir).and_then(|d| d.sync_all());
    match synced {
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(()),
        r => r.map_err(|source| PersistError::Sync {
            path: dir.to_path_buf(),
            source,
        }),
    }
}
