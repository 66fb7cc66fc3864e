//! [`PoolExperts`]: the CPU device's expert tier, the tier's
//! [`ExpertPool`] over a packed expert store, read in place from host
//! memory (arena slots or the mapped store).
//!
//! Per sparse layer of a token: `acquire` the top-k records (pinned until
//! `finish`), `plan` and `run_tracked` the misses, then hand each record to
//! the kernel as soon as it is ready: resident records first, the others as
//! their reads land (the CPU computes one expert while the next is still in
//! flight), or in batches of every ready record for a prompt chunk's
//! experts to run in parallel. Time spent blocked on reads is the stall. The pool's bound
//! (`budget_bytes / stride` records) is the memory bound; a step needing
//! more records than that is [`flashtier::experts::ExpertsError::PoolTooSmall`].

use std::time::Instant;

use flashtier::experts::{Backing, ExpertPool, ExpertsError, Precision};

use crate::device::ExpertTier;
use crate::error::EngineError;
use crate::experts::{ExpertRecordLayout, ExpertStats, ExpertView, PoolTier, serve_landed};
use crate::hint::HintTracker;

/// Records acquired per step of [`PoolExperts::load_all`] (the reads of a
/// step run at the pool's queue depth).
const LOAD_BATCH: usize = 256;

/// Layers ahead a guess may look ([`PoolExperts::hint_ahead`]); also the
/// most guesses held between two steps.
pub const MAX_AHEAD: usize = 2;

/// Work to run while a step's misses are in flight.
pub type Meanwhile<'f> = dyn FnMut() -> Result<(), EngineError> + 'f;

/// Called with (position in the request, the expert's matrices).
pub type UseExpert<'f> = dyn FnMut(usize, ExpertView<'_>) -> Result<(), EngineError> + 'f;

/// Called with every record of a request that is ready at once: (position
/// in the request, the expert's matrices) each.
pub type UseExperts<'f> = dyn FnMut(&[(usize, ExpertView<'_>)]) -> Result<(), EngineError> + 'f;

/// Experts served from host memory by an [`ExpertPool`].
pub struct PoolExperts {
    pool: ExpertPool,
    layout: ExpertRecordLayout,
    stall_ns: u64,
    /// The engine's guesses for the coming sparse layers (at most
    /// [`MAX_AHEAD`], nearest first once sorted), read behind the next
    /// step's misses.
    hints: Vec<(u32, Vec<u32>)>,
    /// Per distance (0: a layer's own guess made before its attention, 1
    /// and 2: layers ahead), which ranks of a guess have been worth
    /// reading.
    trackers: [HintTracker; MAX_AHEAD + 1],
}

impl std::fmt::Debug for PoolExperts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolExperts")
            .field("pool", &self.pool)
            .field("layout", &self.layout)
            .finish()
    }
}

impl PoolExperts {
    /// Serve `pool`'s records, laid out as `layout` says.
    pub fn new(pool: ExpertPool, layout: ExpertRecordLayout) -> Self {
        Self {
            pool,
            layout,
            stall_ns: 0,
            hints: Vec::new(),
            trackers: Default::default(),
        }
    }

    /// Records the pool holds at once.
    pub fn capacity(&self) -> usize {
        self.pool.capacity()
    }

    /// The pool (stats, read rows).
    pub fn pool(&self) -> &ExpertPool {
        &self.pool
    }

    /// Make `experts` of `layer` available and call `use_expert(i, view)`
    /// exactly once for each `experts[i]`, ready records first. The caller
    /// must not depend on the call order for its result.
    pub fn with_experts(
        &mut self,
        layer: usize,
        experts: &[usize],
        use_expert: &mut UseExpert<'_>,
    ) -> Result<(), EngineError> {
        self.open_step(layer, experts, None, |tier, records| {
            tier.serve(records, use_expert)
        })
    }

    /// [`Self::with_experts`] in batches: `use_batch` gets every record that
    /// is ready in a pass at once (all of them in one call when all are
    /// resident), the rest in later passes as their reads land, each record
    /// exactly once over the passes; it may compute a batch's experts in
    /// parallel. `meanwhile`, if any, runs once the step's misses have been
    /// started and before the first batch: CPU work that does not need the
    /// experts (a shared expert) overlaps their reads. Bound: at most
    /// `experts.len()` passes, since a pass that finds none ready waits
    /// (the stall) until one is.
    pub fn with_expert_batches(
        &mut self,
        layer: usize,
        experts: &[usize],
        meanwhile: Option<&mut Meanwhile<'_>>,
        use_batch: &mut UseExperts<'_>,
    ) -> Result<(), EngineError> {
        self.open_step(layer, experts, meanwhile, |tier, records| {
            tier.serve_batches(records, use_batch)
        })
    }

    /// Acquire `experts` of `layer`, read the misses (and the pending
    /// guesses behind them), run `meanwhile`, `serve` the step's records,
    /// and close the step.
    fn open_step(
        &mut self,
        layer: usize,
        experts: &[usize],
        meanwhile: Option<&mut Meanwhile<'_>>,
        serve: impl FnOnce(&mut Self, &[usize]) -> Result<(), EngineError>,
    ) -> Result<(), EngineError> {
        let records = experts
            .iter()
            .map(|&e| record_index(&self.pool, layer, e))
            .collect::<Result<Vec<_>, EngineError>>()?;
        let ids: Vec<u32> = experts
            .iter()
            .filter_map(|&e| u32::try_from(e).ok())
            .collect();
        for t in &mut self.trackers {
            t.served(layer, &ids);
        }
        let need = self.pool.acquire(&records)?;
        let served = (|| {
            let plan = self.pool.plan(&need)?;
            self.pool.run_tracked(plan)?;
            // Behind this step's misses (the backend's read-ahead lane),
            // nearest layer first: the drive stays busy while the CPU
            // computes this layer and the next.
            let mut hints = std::mem::take(&mut self.hints);
            hints.sort_by_key(|(l, _)| *l);
            for (layer, experts) in hints {
                self.pool.prefetch(layer, &experts)?;
            }
            if let Some(meanwhile) = meanwhile {
                meanwhile()?;
            }
            serve(self, &records)
        })();
        let finished = self.pool.finish();
        served?;
        finished?;
        Ok(())
    }

    /// When the pool holds every record of its store (a budget of all
    /// experts, the slots backing), read them all now, in record order and
    /// `queue_depth` at a time, so decoding starts with no miss: the CPU
    /// counterpart of loading every expert into HBM up front. Returns the
    /// records read (0 when the pool is smaller than the store or mapped:
    /// then records are read on first use).
    pub fn load_all(&mut self) -> Result<usize, EngineError> {
        let records = self.pool.stores().records();
        if self.pool.backing() != Backing::Slots || self.pool.capacity() < records {
            return Ok(0);
        }
        let all: Vec<usize> = (0..records).collect();
        for batch in all.chunks(LOAD_BATCH) {
            let need = self.pool.acquire(batch)?;
            let read = (|| {
                let plan = self.pool.plan(&need)?;
                self.pool.run(plan)
            })();
            self.pool.finish()?;
            read?;
        }
        Ok(records)
    }

    /// Remember a guess of `layer`'s next experts, strongest first, made
    /// one sparse layer before it: the ranks whose guesses have proved
    /// right often enough are read behind the next step's misses
    /// ([`HintTracker`]).
    pub fn hint(&mut self, layer: usize, experts: &[usize]) {
        self.hint_ahead(1, layer, experts);
    }

    /// [`Self::hint`] for a guess made `distance` (1..=[`MAX_AHEAD`])
    /// layers before `layer`; each distance keeps its own precision per
    /// rank. A guess for a layer already guessed replaces it; bound:
    /// [`MAX_AHEAD`] guesses held.
    pub fn hint_ahead(&mut self, distance: usize, layer: usize, experts: &[usize]) {
        let Ok(l) = u32::try_from(layer) else { return };
        let Some(tracker) = self.trackers.get_mut(distance).filter(|_| distance > 0) else {
            return;
        };
        let ids = tracker.guessed(layer, &ranked_ids(experts));
        self.hints.retain(|(h, _)| *h != l);
        if self.hints.len() >= MAX_AHEAD {
            self.hints.remove(0);
        }
        self.hints.push((l, ids));
    }

    /// Start reading now a guess of `layer`'s experts, strongest first,
    /// made before its attention (for a first sparse layer, which no
    /// earlier layer guesses): the ranks worth reading go on the backend's
    /// read-ahead lane at once, between steps. Returns the reads started.
    pub fn read_ahead_now(
        &mut self,
        layer: usize,
        experts: &[usize],
    ) -> Result<usize, EngineError> {
        let ids = self.trackers[0].guessed(layer, &ranked_ids(experts));
        let l =
            u32::try_from(layer).map_err(|_| EngineError::ExpertOutOfRange { layer, expert: 0 })?;
        Ok(self.pool.prefetch(l, &ids)?)
    }

    /// Serve every record of the open step, ready ones first.
    fn serve(
        &mut self,
        records: &[usize],
        use_expert: &mut UseExpert<'_>,
    ) -> Result<(), EngineError> {
        let pending = records.iter().copied().enumerate().collect();
        serve_landed(self, pending, |tier, pos, r| {
            tier.use_record(pos, r, use_expert)
        })
    }

    /// Serve every record of the open step in batches of the ready ones.
    fn serve_batches(
        &mut self,
        records: &[usize],
        use_batch: &mut UseExperts<'_>,
    ) -> Result<(), EngineError> {
        let mut pending: Vec<(usize, usize)> = records.iter().copied().enumerate().collect();
        while !pending.is_empty() {
            self.pool.collect_landed()?;
            let mut ready = Vec::with_capacity(pending.len());
            let mut k = 0;
            while k < pending.len() {
                match self.full_precision(pending[k].1) {
                    Ok(()) => ready.push(pending.swap_remove(k)),
                    Err(EngineError::Pool(ExpertsError::NotLanded { .. })) => k += 1,
                    Err(e) => return Err(e),
                }
            }
            if ready.is_empty() {
                let started = Instant::now();
                let records: Vec<usize> = pending.iter().map(|&(_, r)| r).collect();
                self.pool.wait_any(&records);
                self.stall_ns += started.elapsed().as_nanos() as u64;
                continue;
            }
            // Nothing changes the pool between the checks above and these
            // shared borrows of its records.
            let views = ready
                .iter()
                .map(|&(pos, r)| Ok((pos, self.layout.view(self.pool.ready_bytes(r)?)?)))
                .collect::<Result<Vec<_>, EngineError>>()?;
            use_batch(&views)?;
        }
        Ok(())
    }

    /// A ready record's precision held against the full one the CPU
    /// kernels read (`NotLanded` while its read is in flight).
    fn full_precision(&mut self, r: usize) -> Result<(), EngineError> {
        let addr = self.pool.addr(r)?;
        if addr.precision != Precision::Full {
            return Err(EngineError::LowBitRecord {
                record: r,
                precision: addr.precision,
            });
        }
        Ok(())
    }

    fn use_record(
        &mut self,
        pos: usize,
        r: usize,
        use_expert: &mut UseExpert<'_>,
    ) -> Result<(), EngineError> {
        self.full_precision(r)?;
        let view = self.layout.view(self.pool.bytes(r)?)?;
        use_expert(pos, view)
    }
}

fn ranked_ids(experts: &[usize]) -> Vec<u32> {
    experts
        .iter()
        .filter_map(|&e| u32::try_from(e).ok())
        .collect()
}

/// The pool's record index of (`layer`, `expert`).
pub(crate) fn record_index(
    pool: &ExpertPool,
    layer: usize,
    expert: usize,
) -> Result<usize, EngineError> {
    let (Ok(l), Ok(e)) = (u32::try_from(layer), u32::try_from(expert)) else {
        return Err(EngineError::ExpertOutOfRange { layer, expert });
    };
    Ok(pool.index_of(l, e)?)
}

impl PoolTier for PoolExperts {
    fn pool_mut(&mut self) -> &mut ExpertPool {
        &mut self.pool
    }

    fn add_stall_ns(&mut self, ns: u64) {
        self.stall_ns += ns;
    }
}

impl ExpertTier for PoolExperts {
    fn stats(&self) -> ExpertStats {
        let s = self.pool.stats();
        ExpertStats {
            hits: s.hits,
            misses: s.accesses - s.hits,
            bytes_read: s.bytes_read,
            prefetch_bytes: s.prefetch_bytes,
            prefetch_used_bytes: s.prefetch_used_bytes,
            stall_ns: self.stall_ns,
            h2d_bytes: 0,
            records_used: s.accesses,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use flashtier::experts::testing::write_store;
    use flashtier::experts::{PoolConfig, StoreSet};
    use flashtier_format::Dtype;
    use flashtier_io::PosixBackend;

    use super::*;
    use crate::experts::Span;

    /// A pool of `slots` records over a 3-layer, 8-expert store whose
    /// records are read as a 2 x 4 BF16 expert.
    fn tier(dir: &std::path::Path, slots: u64) -> PoolExperts {
        let path = dir.join("e.ftstore");
        write_store(&path, 3, 8, 5000).expect("store");
        let stores = StoreSet::open(&path, false).expect("open");
        let config = PoolConfig {
            budget_bytes: slots * 8192,
            ..PoolConfig::default()
        };
        let backend = Arc::new(PosixBackend::new(2).expect("posix"));
        let pool = ExpertPool::new(stores, backend, config).expect("pool");
        let layout = ExpertRecordLayout {
            matrices: [0, 16, 32].map(|offset| Span { offset, len: 16 }),
            dtype: Dtype::Bf16,
            fp8: None,
            hidden: 4,
            intermediate: 2,
        };
        PoolExperts::new(pool, layout)
    }

    fn step(t: &mut PoolExperts, layer: usize, experts: &[usize]) -> Vec<usize> {
        let mut served = Vec::new();
        t.with_experts(layer, experts, &mut |pos, _| {
            served.push(pos);
            Ok(())
        })
        .expect("step");
        served.sort_unstable();
        served
    }

    #[test]
    fn guesses_for_two_layers_ahead_are_read_behind_the_next_step() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut t = tier(dir.path(), 12);
        t.hint_ahead(1, 1, &[0, 1]);
        t.hint_ahead(2, 2, &[3]);
        // A guess for a layer already guessed replaces it.
        t.hint_ahead(1, 1, &[0, 2]);
        assert_eq!(step(&mut t, 0, &[5, 6]), vec![0, 1]);
        let read = t.pool().stats().prefetch_bytes;
        assert_eq!(read, 3 * t.pool().stores().full().read_bytes() as u64);
        // The guessed records are served without another read.
        let before = t.stats().misses;
        assert_eq!(step(&mut t, 1, &[0, 2]), vec![0, 1]);
        assert_eq!(step(&mut t, 2, &[3]), vec![0]);
        assert_eq!(t.stats().misses, before);
        // Distance 0 and past MAX_AHEAD are not guesses to hold.
        t.hint_ahead(0, 1, &[7]);
        t.hint_ahead(MAX_AHEAD + 1, 2, &[7]);
        step(&mut t, 0, &[4]);
        assert_eq!(t.pool().stats().prefetch_bytes, read);
    }

    #[test]
    fn at_most_max_ahead_guesses_are_held_and_a_first_layer_guess_reads_now() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut t = tier(dir.path(), 12);
        for layer in 0..=MAX_AHEAD {
            t.hint_ahead(1, layer, &[layer + 4]);
        }
        step(&mut t, 0, &[0]);
        let one = t.pool().stores().full().read_bytes() as u64;
        // The oldest guess went: MAX_AHEAD records read ahead.
        assert_eq!(t.pool().stats().prefetch_bytes, MAX_AHEAD as u64 * one);
        // A guess made before a layer's attention is read at once (not
        // what is resident already: (2, 6) came with the guesses above).
        assert_eq!(t.read_ahead_now(2, &[0, 1, 6]).expect("read ahead"), 2);
        assert_eq!(
            t.pool().stats().prefetch_bytes,
            (MAX_AHEAD as u64 + 2) * one
        );
        let before = t.stats().misses;
        step(&mut t, 2, &[0, 1, 6]);
        assert_eq!(t.stats().misses, before);
    }
}
