//! [`RowStoreConfig`]: how a [`crate::rows::RowStore`] is built.

use std::sync::Arc;

use flashtier_io::{DirectMode, StorageBackend};

use crate::rows::RowPool;

/// How a [`RowStore`](crate::rows::RowStore) is built.
#[derive(Clone)]
pub struct RowStoreConfig {
    /// Cache budget in bytes (0 = no cache).
    pub cache_bytes: u64,
    /// Cache ways per set, 1..=16.
    pub ways: usize,
    /// O_DIRECT policy for row reads (buffered fallback is announced once).
    pub direct: DirectMode,
    /// Map and lock the whole source table in RAM instead of reading it.
    pub ram_mode: bool,
    /// Pin the owned scales in RAM at `set_range`, so a source miss is one read.
    pub pin_scales: bool,
    /// Miss pool (`None` = the process-wide [`RowPool::shared`]).
    pub pool: Option<Arc<RowPool>>,
    /// Backend the reads go through. `None` = [`InlineBackend`](crate::rows::InlineBackend), driven by
    /// the pool; a backend with its own queue (`queue_depth() > 1`: io_uring,
    /// posix, the simulator) gets each batch's reads submitted in windows
    /// instead (see `fetch`).
    pub backend: Option<Arc<dyn StorageBackend>>,
    /// Batches with fewer read units than this are read on the caller alone.
    pub inline_below: usize,
}

impl Default for RowStoreConfig {
    fn default() -> Self {
        Self {
            cache_bytes: 64 << 20,
            ways: 4,
            direct: DirectMode::Prefer,
            ram_mode: false,
            pin_scales: true,
            pool: None,
            backend: None,
            inline_below: 8,
        }
    }
}

impl std::fmt::Debug for RowStoreConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RowStoreConfig")
            .field("cache_bytes", &self.cache_bytes)
            .field("ways", &self.ways)
            .field("direct", &self.direct)
            .field("ram_mode", &self.ram_mode)
            .field("pin_scales", &self.pin_scales)
            .field("backend", &self.backend.as_ref().map(|b| b.name()))
            .field("inline_below", &self.inline_below)
            .finish()
    }
}
