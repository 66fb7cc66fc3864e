//! The expert tier: which MoE expert records are resident, how misses are
//! read, and how little the decode waits.
//!
//! - [`ExpertArena`]: slabs x slots in one allocation (host here; pinned or
//!   unified memory from the CUDA layer through [`arena::ArenaMemory`]).
//! - [`ExpertPool`]: one interface over two backings, **mapped** (the store
//!   is memory-mapped, `mincore` finds records still in the page cache, cold
//!   records are read in parallel before use) and **slots** (direct reads
//!   through a `StorageBackend` at queue depth into arena slots). Per step:
//!   [`ExpertPool::acquire`] -> [`ExpertPool::plan`] -> [`ExpertPool::run`] or
//!   [`ExpertPool::run_tracked`] -> [`ExpertPool::finish`]; a record's bytes
//!   are handed out ([`ExpertPool::addr`], [`ExpertPool::bytes`]) only after
//!   its read landed and its checksum matched.
//! - [`policy`]: O(1) eviction policies (LRU, SIEVE, S3-FIFO, and the layer-aware
//!   `layer-clock`, the default).
//! - [`trace`], [`tracegen`], [`sim`], [`replay`]: routing traces, synthetic
//!   families, Belady's MIN, and the replay of a trace against a real store.
//! - [`lowbit`]: 3-bit and 2-bit group-quantized companions of every record.
//!
//! ```
//! use flashtier::experts::{Backing, ExpertPool, PoolConfig, StoreSet};
//! use flashtier::experts::testing::write_store;
//! use flashtier_io::PosixBackend;
//! use std::sync::Arc;
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = tempfile::tempdir()?;
//! let path = dir.path().join("e.ftstore");
//! write_store(&path, 2, 4, 5000)?; // 2 layers x 4 experts, 5000-byte records
//! let stores = StoreSet::open(&path, false)?;
//! let config = PoolConfig { backing: Backing::Slots, budget_bytes: 4 * 8192, ..PoolConfig::default() };
//! let mut pool = ExpertPool::new(stores, Arc::new(PosixBackend::new(4)?), config)?;
//! let recs = [pool.index_of(0, 1)?, pool.index_of(0, 3)?];
//! let need = pool.acquire(&recs)?;
//! let plan = pool.plan(&need)?;
//! pool.run(plan)?;
//! let addr = pool.addr(recs[0])?;
//! assert_eq!(addr.precision, flashtier::experts::Precision::Full);
//! assert_eq!(pool.bytes(recs[0])?.len(), 5000);
//! pool.finish()?;
//! # Ok(()) }
//! ```

pub mod arena;
pub mod lowbit;
pub mod lowbit_pack;
pub mod policy;
pub mod pool;
pub mod replay;
pub mod sim;
pub mod store;
pub mod testing;
pub mod trace;
pub mod tracegen;
pub mod tracking;
pub mod verify;

pub use arena::{ArenaError, ExpertArena, HostMemory};
pub use policy::PolicyKind;
pub use pool::{Backing, ExpertPool, PoolConfig, PoolStats, ReadPlan, RecordAddr};
pub use store::StoreSet;
pub use tracking::{ReadRow, ReadSource};

use std::path::PathBuf;

/// Which copy of a record a slot holds. It travels with every address, so
/// compressed bytes can never be taken for the exact record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Precision {
    /// The exact record as packed.
    #[default]
    Full,
    /// The 3-bit group-quantized companion.
    Q3,
    /// The 2-bit group-quantized companion.
    Q2,
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Full => "exact",
            Self::Q3 => "3-bit",
            Self::Q2 => "2-bit",
        })
    }
}

impl Precision {
    /// Bits per weight of a low-bit companion (`None` for the exact record).
    #[must_use]
    pub const fn bits(self) -> Option<u32> {
        match self {
            Self::Full => None,
            Self::Q3 => Some(3),
            Self::Q2 => Some(2),
        }
    }
}

/// A failure of the expert tier, naming the record at fault.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExpertsError {
    /// A store file is invalid.
    #[error(transparent)]
    Format(#[from] flashtier_format::FormatError),
    /// Opening or setting up I/O failed.
    #[error(transparent)]
    Io(#[from] flashtier_io::IoError),
    /// The arena could not be built.
    #[error(transparent)]
    Arena(#[from] ArenaError),
    /// Reading a record failed; the record is not resident.
    #[error("expert record {record} ({key}): {source}")]
    Read {
        /// Record index.
        record: usize,
        /// Key, rendered.
        key: String,
        /// The I/O error (names file, offset, length).
        source: flashtier_io::IoError,
    },
    /// A record's bytes did not match its checksum; the record is not resident.
    #[error("expert record {record} at offset {offset} length {len}: {source}")]
    Checksum {
        /// Record index.
        record: usize,
        /// File offset of the record.
        offset: u64,
        /// Payload bytes checked.
        len: usize,
        /// The format layer's checksum error (names file, index, key).
        source: flashtier_format::FormatError,
    },
    /// The pool cannot hold one step's records.
    #[error("expert pool of {capacity} records is too small for a step of {needed}")]
    PoolTooSmall {
        /// Capacity in records.
        capacity: usize,
        /// Records the step needs.
        needed: usize,
    },
    /// A record index outside the store.
    #[error("expert record {record} out of range (store has {records})")]
    RecordOutOfRange {
        /// Record asked for.
        record: usize,
        /// Records in the store.
        records: usize,
    },
    /// The record is not resident (never acquired, evicted, or its read failed).
    #[error("expert record {record} is not resident")]
    NotResident {
        /// Record index.
        record: usize,
    },
    /// The record's read has not landed yet.
    #[error("expert record {record}: read still in flight")]
    NotLanded {
        /// Record index.
        record: usize,
    },
    /// The lifecycle was used out of order.
    #[error("expert pool: {0}")]
    Lifecycle(&'static str),
    /// No companion store of that precision is attached.
    #[error("expert pool: no {0} store attached")]
    NoStore(Precision),
    /// A companion store does not match the exact store.
    #[error("{path}: {what}")]
    StoreMismatch {
        /// The companion's path.
        path: PathBuf,
        /// What differs.
        what: String,
    },
}
