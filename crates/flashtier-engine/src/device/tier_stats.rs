//! What a KV tier did for a cache, cumulative: the counters a device's KV
//! state reports through [`crate::device::KvState::tier_stats`], whatever
//! the device (today only the CUDA device offloads KV).

/// What the KV tier did, cumulative.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct KvTierStats {
    /// Chunks offloaded (blocks written).
    pub offloaded_blocks: u64,
    /// Bytes written.
    pub offloaded_bytes: u64,
    /// Time offloading: the copy out of the device and the write.
    pub offload_ns: u64,
    /// Chunks restored (blocks read and checked).
    pub restored_blocks: u64,
    /// Bytes restored.
    pub restored_bytes: u64,
    /// Tiles restored.
    pub restored_tiles: u64,
    /// Time waiting for reads to land.
    pub read_wait_ns: u64,
    /// Time checking landed blocks.
    pub verify_ns: u64,
    /// Time in the device's consumer (copy to the device, launches).
    pub consume_ns: u64,
    /// Wall time of every restore.
    pub restore_ns: u64,
}

impl KvTierStats {
    /// Counters since `earlier`.
    #[must_use]
    pub fn since(&self, earlier: &Self) -> Self {
        Self {
            offloaded_blocks: self.offloaded_blocks - earlier.offloaded_blocks,
            offloaded_bytes: self.offloaded_bytes - earlier.offloaded_bytes,
            offload_ns: self.offload_ns - earlier.offload_ns,
            restored_blocks: self.restored_blocks - earlier.restored_blocks,
            restored_bytes: self.restored_bytes - earlier.restored_bytes,
            restored_tiles: self.restored_tiles - earlier.restored_tiles,
            read_wait_ns: self.read_wait_ns - earlier.read_wait_ns,
            verify_ns: self.verify_ns - earlier.verify_ns,
            consume_ns: self.consume_ns - earlier.consume_ns,
            restore_ns: self.restore_ns - earlier.restore_ns,
        }
    }

    /// Time the step spent on KV I/O instead of issuing compute: offloads,
    /// waits for reads, checks.
    #[must_use]
    pub fn stall_ns(&self) -> u64 {
        self.offload_ns + self.read_wait_ns + self.verify_ns
    }
}
