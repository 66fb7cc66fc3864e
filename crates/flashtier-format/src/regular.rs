//! Opening a file that must be a regular file (a store, a safetensors file,
//! a `config.json`) without ever blocking on a FIFO or opening a device.
//!
//! Invariants of [`open_regular`]:
//! - the path's metadata is read first, and a FIFO, device node, socket or
//!   directory there is refused without an `open(2)` at all (opening a FIFO
//!   for reading blocks until a writer appears; opening some devices has
//!   side effects, a tape rewinds);
//! - the open adds `O_NONBLOCK | O_NOCTTY`, and the opened descriptor's type
//!   is checked again, so a path swapped for a FIFO or a device between the
//!   two steps is refused too instead of blocking;
//! - a path that does not exist passes the first check, so an open that
//!   creates the file works; the second check still applies.
//!
//! The file comes back with `O_NONBLOCK` still set. Linux ignores it for
//! `read`/`pread`/`write` of regular files, so `std::fs` reads behave as
//! usual; io_uring honours it (a read that would wait ends with EAGAIN),
//! which is why `flashtier-io` clears it before a ring sees the file.

use std::fs::{File, FileType, OpenOptions};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Why a file that must be regular could not be opened.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpenError {
    /// The path names a FIFO, device, socket or directory.
    #[error("{path} is {what}, not a regular file")]
    NotRegular {
        /// The path.
        path: PathBuf,
        /// What it is instead (`a FIFO (named pipe)`, `a character device`...).
        what: &'static str,
    },
    /// The operating system refused the open (missing file, permissions...).
    #[error("open {path}: {source}")]
    Os {
        /// The path.
        path: PathBuf,
        /// OS error.
        source: std::io::Error,
    },
}

impl OpenError {
    /// The path that could not be opened.
    #[must_use]
    pub fn path(&self) -> &Path {
        match self {
            Self::NotRegular { path, .. } | Self::Os { path, .. } => path,
        }
    }

    /// What went wrong, without the path (for a message that names it).
    #[must_use]
    pub fn reason(&self) -> String {
        match self {
            Self::NotRegular { what, .. } => format!("{what}, not a regular file"),
            Self::Os { source, .. } => format!("open: {source}"),
        }
    }
}

/// What a file of type `t` is, in words, when it is not a regular file.
#[must_use]
pub fn not_regular(t: FileType) -> Option<&'static str> {
    Some(if t.is_file() {
        return None;
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
        "neither a regular file nor a directory"
    })
}

/// Open `path` with `opts` and the extra `custom_flags` (`O_DIRECT`, or 0),
/// refusing anything but a regular file; see the module docs.
pub fn open_regular(path: &Path, opts: &OpenOptions, custom_flags: i32) -> Result<File, OpenError> {
    let refuse = |what| OpenError::NotRegular {
        path: path.to_path_buf(),
        what,
    };
    let os = |source| OpenError::Os {
        path: path.to_path_buf(),
        source,
    };
    if let Some(what) = std::fs::metadata(path)
        .ok()
        .and_then(|m| not_regular(m.file_type()))
    {
        return Err(refuse(what));
    }
    let file = opts
        .clone()
        .custom_flags(custom_flags | libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(os)?;
    let opened = file.metadata().map_err(os)?;
    if let Some(what) = not_regular(opened.file_type()) {
        return Err(refuse(what));
    }
    Ok(file)
}

/// [`open_regular`] for reading.
pub fn open_regular_read(path: &Path) -> Result<File, OpenError> {
    open_regular(path, OpenOptions::new().read(true), 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_regular_file_opens_and_a_directory_is_refused() {
        let dir = std::env::temp_dir();
        let err = open_regular_read(&dir).expect_err("a directory");
        assert!(matches!(
            err,
            OpenError::NotRegular {
                what: "a directory",
                ..
            }
        ));
        assert!(
            err.to_string()
                .ends_with("is a directory, not a regular file")
        );
        let missing = dir.join("flashtier-format-no-such-file");
        assert!(matches!(
            open_regular_read(&missing),
            Err(OpenError::Os { .. })
        ));
        let err = open_regular_read(Path::new("/dev/null")).expect_err("a device");
        assert!(err.to_string().contains("a character device"), "{err}");
    }
}
