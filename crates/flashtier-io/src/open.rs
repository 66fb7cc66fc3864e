//! Choosing a backend by name: the factory the CLI and the tiers use.

use crate::backend::StorageBackend;
use crate::error::IoError;
use crate::posix::PosixBackend;
use crate::sim::{FaultPlan, SimBackend};
use crate::uring::{UringBackend, UringLocal};

/// The backends [`open_backend`] can build.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum BackendKind {
    /// io_uring, falling back to posix (with a one-line notice) where the
    /// kernel refuses it.
    #[default]
    Uring,
    /// io_uring reaped on the waiting caller's thread ([`UringLocal`]),
    /// falling back to posix like `Uring`.
    UringLocal,
    /// pread/pwrite on worker threads.
    Posix,
    /// The simulator with faults off (seed printed; faults through
    /// [`SimBackend::new`]).
    Sim,
}

impl BackendKind {
    /// The name `open_backend` and the CLI use.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Uring => "uring",
            Self::UringLocal => "uring-local",
            Self::Posix => "posix",
            Self::Sim => "sim",
        }
    }
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for BackendKind {
    type Err = IoError;
    fn from_str(s: &str) -> Result<Self, IoError> {
        match s {
            "uring" | "io_uring" | "io-uring" => Ok(Self::Uring),
            "uring-local" | "uring_local" => Ok(Self::UringLocal),
            "posix" | "pread" => Ok(Self::Posix),
            "sim" => Ok(Self::Sim),
            other => Err(IoError::Invalid(format!(
                "unknown backend {other} (uring | uring-local | posix | sim)"
            ))),
        }
    }
}

/// Build a backend of `kind` keeping `queue_depth` (1..=256) reads in flight.
/// `Uring` falls back to posix, saying so in one line on stderr, where
/// io_uring is unavailable (old kernel, seccomp, gVisor); check
/// [`StorageBackend::name`] for what was built.
pub fn open_backend(
    kind: BackendKind,
    queue_depth: usize,
) -> Result<Box<dyn StorageBackend>, IoError> {
    match kind {
        BackendKind::Uring => or_posix(UringBackend::new(queue_depth), queue_depth),
        BackendKind::UringLocal => or_posix(UringLocal::new(queue_depth), queue_depth),
        BackendKind::Posix => Ok(Box::new(PosixBackend::new(queue_depth)?)),
        BackendKind::Sim => Ok(Box::new(SimBackend::new(FaultPlan::off(), queue_depth)?)),
    }
}

/// An io_uring backend as opened, or posix at `queue_depth` where the ring
/// could not be opened for any reason but invalid arguments.
fn or_posix<B: StorageBackend + 'static>(
    ring: Result<B, IoError>,
    queue_depth: usize,
) -> Result<Box<dyn StorageBackend>, IoError> {
    match ring {
        Ok(b) => Ok(Box::new(b)),
        Err(IoError::Invalid(what)) => Err(IoError::Invalid(what)),
        Err(e) => {
            eprintln!("flashtier: io_uring unavailable ({e}); using the posix backend");
            Ok(Box::new(PosixBackend::new(queue_depth)?))
        }
    }
}
