//! flashtier's I/O seam.
//!
//! Every tier reads through [`StorageBackend`]: a request names a
//! [`StoreFile`] extent and a [`Landing`] (an owned [`AlignedBuf`], a slice of a
//! [`LandingRegion`], or device memory behind a [`DeviceSink`]). Backends:
//! [`PosixBackend`] (pread on worker threads), [`UringBackend`] (one ring,
//! registered files and fixed buffers, reaped by a ring thread),
//! [`UringLocal`] (the same ring reaped on the waiting caller's thread) and the seeded fault-injecting
//! [`SimBackend`]; [`open_backend`] picks one by [`BackendKind`] and falls back
//! from io_uring to posix where the kernel refuses io_uring. The thread-pool
//! backends meter their reads ([`StorageBackend::activity`]: how long the
//! drive had a read in flight, and how many on average). All `unsafe` of the I/O path lives in this
//! crate, each block with a `// SAFETY:` comment.
//!
//! ```
//! use flashtier_io::{AlignedBuf, DirectMode, Landing, PosixBackend, ReadReq, StorageBackend, StoreFile};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = tempfile::tempdir()?;
//! let path = dir.path().join("data.bin");
//! std::fs::write(&path, vec![7u8; 8192])?;
//! let file = StoreFile::open_read(&path, DirectMode::Prefer)?;
//! let backend = PosixBackend::new(4)?;
//! let req = ReadReq { file, offset: 4096, len: 4096, landing: Landing::Host(AlignedBuf::zeroed(4096)), tag: 1 };
//! let landed = backend.read(vec![req])?;
//! assert!(landed[0].buf.as_ref().unwrap().iter().all(|&b| b == 7));
//! # Ok(()) }
//! ```

// Kept apart from the list below so parallel branches that extend it merge cleanly.
pub mod persist;
pub mod prealloc;
pub mod seqcopy;

pub mod activity;
pub mod backend;
pub mod blocks;
pub mod buf;
pub mod done;
pub mod error;
pub mod file;
pub mod loadgen;
pub mod locked;
pub mod mapped;
pub mod measure;
pub mod open;
pub mod posix;
pub mod probe;
mod queue;
pub mod region;
pub mod settings;
pub mod sim;
mod sim_plan;
pub mod skip;
pub mod slots;
pub mod uring;
mod workers;

pub use activity::DriveActivity;
pub use backend::{
    Completer, DeviceSink, Drive, Landed, Landing, ReadReq, StorageBackend, Ticket, landing_ptr,
    read_blocking, read_blocking_with,
};
pub use buf::{ALIGN, AlignedBuf, round_up};
pub use done::DoneQueue;
pub use error::IoError;
pub use file::{DirectMode, StoreFile};
pub use locked::{LockError, LockedMap, memlock_limit_bytes};
pub use mapped::MappedFile;
pub use open::{BackendKind, open_backend};
pub use persist::{Output, PersistError, Wait};
pub use posix::PosixBackend;
pub use probe::{
    Extent, ExtentRead, LoggingBackend, Refill, read_extents, read_extents_on, record_extents,
};
pub use region::{LandingRegion, RegionMemory};
pub use sim::{FaultPlan, SimBackend};
pub use slots::{LandedFlag, SlotTable};
pub use uring::{UringBackend, UringLocal};
