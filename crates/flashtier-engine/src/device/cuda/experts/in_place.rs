//! The in-place path (unified memory, or forced for its tests): the
//! kernels read records where they landed in the pinned RAM tier, through
//! the device table; no HBM slot, no copy.
//!
//! Invariant: a pinned slot a kernel may still read is not handed back to
//! the pool until the compute stream has passed it (the step waits for the
//! kernels queued before it, then clears the entries the last step set).

use std::time::Instant;

use super::CudaExperts;
use crate::error::EngineError;

impl CudaExperts {
    /// The in-place path of [`CudaExperts::ensure`]: `experts` of `layer`
    /// (distinct, records `records`) landed in RAM and pointed to.
    pub(super) fn ensure_in_place(
        &mut self,
        layer: usize,
        experts: &[u32],
        records: &[usize],
    ) -> Result<(), EngineError> {
        // Kernels queued earlier may still read pinned slots the pool is
        // about to reuse: wait for them.
        self.slots.consumed()?;
        self.slots.wait_consumed()?;
        for entry in std::mem::take(&mut self.in_place_set) {
            self.slots.clear(entry)?;
        }
        let need = self.ram.acquire(records)?;
        let result = (|| {
            let plan = self.ram.plan(&need)?;
            self.ram.run_tracked(plan)?;
            self.start_hinted_reads()?;
            for (&e, &r) in experts.iter().zip(records) {
                let started = Instant::now();
                self.ram.wait_ready(r)?;
                self.stall_ns += started.elapsed().as_nanos() as u64;
                let offset = self.pinned_offset(r)?;
                let entry = self.entry(layer, e as usize);
                self.slots
                    .point_to_pinned(entry, &self.pinned, offset, self.record_bytes)?;
                self.in_place_set.push(entry);
            }
            Ok::<(), EngineError>(())
        })();
        let finished = self.ram.finish();
        result?;
        finished?;
        Ok(())
    }
}
