//! The stats snapshot of a row store the SPEC asks for (the counters behind
//! it live in `state`).

/// Counters and geometry of a store (the SPEC's stats).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct RowStats {
    /// Ids served from the cache (or from RAM in RAM mode).
    pub hits: u64,
    /// Distinct rows read from storage.
    pub misses: u64,
    /// Read operations issued (one per read unit; rows sharing a block share a read).
    pub reads: u64,
    /// Batch positions served by another position's read (repeated ids).
    pub deduplicated: u64,
    /// Bytes of the cache.
    pub cache_bytes: u64,
    /// Cache slots.
    pub slots: u64,
    /// Cache sets.
    pub sets: u64,
    /// Cache ways.
    pub ways: u64,
    /// Threads serving misses (the caller included).
    pub threads: u64,
    /// Whether misses come from a packed shard.
    pub packed: bool,
    /// Bytes of owned scales pinned in RAM.
    pub scales_bytes: u64,
    /// Whether the table is mapped and locked in RAM.
    pub ram_mode: bool,
    /// Whether row reads bypass the page cache.
    pub direct: bool,
    /// Owned range start.
    pub lo: u64,
    /// Owned range end.
    pub hi: u64,
    /// Rows in the table.
    pub rows: u64,
}
