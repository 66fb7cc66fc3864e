//! Prefetch: start reads for records predicted for a coming layer, without
//! evicting the current step's records, with a way to cancel them.
//!
//! Bound: one call starts at most `experts.len()` reads; every prefetched
//! record takes one unit of the pool's capacity like any other.

use super::{ExpertPool, Precision, Residency};
use crate::experts::ExpertsError;

impl ExpertPool {
    /// Start reads for records predicted for `layer` (expert ids), without
    /// evicting a record of the current step; stops quietly when no room is
    /// left (it evicts neither pinned records nor its own prefetches) or
    /// when the backend's read-ahead lane is full. The reads go behind
    /// every demand read ([`flashtier_io::StorageBackend::read_ahead`]), so
    /// a step's misses never wait for a guess. Returns how many reads it
    /// started. Bound: at most `experts.len()`.
    pub fn prefetch(&mut self, layer: u32, experts: &[u32]) -> Result<usize, ExpertsError> {
        let mut started: Vec<usize> = Vec::new();
        for &x in experts {
            let r = self.index_of(layer, x)?;
            if self.entries[r].residency != Residency::Absent {
                continue;
            }
            if self.resident >= self.capacity {
                let (entries, step, open) = (&self.entries, self.step, self.step_open);
                // Neither the step's records nor this call's own prefetches.
                let keep =
                    |v: usize| Self::is_pinned(entries, step, open, v) || started.contains(&v);
                let Some(victim) = self.policy.evict(&keep) else {
                    break;
                };
                self.drain(victim);
                self.release(victim);
            }
            self.insert(r, Precision::Full)?;
            match self.start_read_ahead(r) {
                Ok(true) => {}
                // Refused (the backend's read-ahead lane is full: the drive
                // has enough queued, the rest of the guess is not read) or
                // failed: the record goes back to absent.
                started => {
                    self.fail(r);
                    started?;
                    break;
                }
            }
            self.entries[r].prefetched = true;
            self.stats.prefetch_bytes += self.read_bytes(Precision::Full) as u64;
            started.push(r);
        }
        Ok(started.len())
    }

    /// Cancel prefetches whose records have not been used: reads still in
    /// flight are dropped when they land (their room comes back). Returns how
    /// many were cancelled.
    pub fn cancel_prefetch(&mut self) -> usize {
        let mut n = 0;
        let pending: Vec<usize> = self.inflight.keys().copied().collect();
        for r in pending {
            let e = &mut self.entries[r];
            if e.prefetched && e.residency == Residency::Loading && !e.cancelled {
                e.cancelled = true;
                n += 1;
            }
        }
        n
    }
}
