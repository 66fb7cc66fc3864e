//! The pool's public configuration and report types: the backing, how to
//! build a pool, where a ready record lives, and the counters.

use crate::experts::Precision;
use crate::experts::policy::PolicyKind;
use crate::experts::tracking::ReadRow;

/// Which backing holds the resident records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Backing {
    /// The store is memory-mapped; records are used in place.
    Mapped,
    /// Records are read directly into arena slots.
    #[default]
    Slots,
}

impl std::str::FromStr for Backing {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "mapped" => Ok(Self::Mapped),
            "slots" => Ok(Self::Slots),
            o => Err(format!("unknown backing {o} (mapped | slots)")),
        }
    }
}

/// How to build a pool.
#[derive(Debug, Clone, Copy)]
pub struct PoolConfig {
    /// Backing.
    pub backing: Backing,
    /// Memory budget for resident records, in bytes.
    pub budget_bytes: u64,
    /// Eviction policy.
    pub policy: PolicyKind,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            backing: Backing::Slots,
            budget_bytes: 256 << 20,
            policy: PolicyKind::default(),
        }
    }
}

/// Where a ready record lives, and which copy it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct RecordAddr {
    /// Record index.
    pub record: usize,
    /// Which copy (exact, 3-bit, 2-bit): pick the GEMM by this.
    pub precision: Precision,
    /// Host address of the first payload byte.
    pub host_addr: u64,
    /// Device address, where the memory is device-visible.
    pub device_addr: Option<u64>,
    /// Payload bytes.
    pub len_bytes: usize,
}

/// Counters of the pool.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct PoolStats {
    /// Capacity in records.
    pub capacity_records: usize,
    /// Records resident or being read.
    pub resident_records: usize,
    /// Record uses.
    pub accesses: u64,
    /// Uses that found the record resident (or its read already in flight).
    pub hits: u64,
    /// Bytes read from the drive (misses and prefetches, whole strides).
    pub bytes_read: u64,
    /// Bytes read by prefetches.
    pub prefetch_bytes: u64,
    /// Bytes read by prefetches whose record was then used.
    pub prefetch_used_bytes: u64,
    /// Reads that failed (I/O error or checksum).
    pub failed_reads: u64,
    /// Mapped: ready records verified again before reuse because their map's
    /// epoch advanced (the store changed, or was written moments ago).
    pub rechecked_hits: u64,
    /// Per (layer, precision, source) rows.
    pub reads: Vec<ReadRow>,
}
