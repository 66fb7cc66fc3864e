//! The HBM tier of a discrete GPU: which record each slot holds, the
//! eviction policy over them, and the copies that fill them from the RAM
//! tier.
//!
//! Invariants: `slot_of[r] == Some(s)` exactly when `record_of[s] ==
//! Some(r)`; a slot is free (in `free`) or holds one record; the records of
//! the step being made ready (`pinned`) are never evicted; an evicted
//! record's table entry is cleared before its slot takes another record.
//! Bounds: `record_of.len()` slots; a step copies at most the RAM tier's
//! capacity of records at once.

use flashtier::experts::ExpertPool;
use flashtier::experts::ExpertsError;
use flashtier::experts::policy::{EvictionPolicy, PolicyKind};

use super::CudaExperts;
use crate::error::EngineError;
use crate::experts::serve_landed;

/// HBM residency: which record each slot holds, and the policy.
pub(super) struct HbmSlots {
    /// Table entry of each record (layer x experts + expert).
    entry_of: Vec<usize>,
    slot_of: Vec<Option<usize>>,
    record_of: Vec<Option<usize>>,
    free: Vec<usize>,
    policy: Box<dyn EvictionPolicy>,
    pinned: Vec<usize>,
}

impl HbmSlots {
    /// `slots` empty slots for the records of `ram`, a model of `experts`
    /// routed experts per layer; `layer_of` is each record's layer.
    pub(super) fn new(ram: &ExpertPool, experts: usize, layer_of: &[u32], slots: usize) -> Self {
        let records = layer_of.len();
        let entry_of = (0..records)
            .map(|r| {
                let key = ram.stores().full().store.key_of(r as u64);
                key.map_or(usize::MAX, |k| k.layer as usize * experts + k.item as usize)
            })
            .collect();
        Self {
            entry_of,
            slot_of: vec![None; records],
            record_of: vec![None; slots],
            free: (0..slots).rev().collect(),
            policy: PolicyKind::default().build(layer_of, slots),
            pinned: Vec::new(),
        }
    }

    /// Whether record `r` sits in a slot.
    pub(super) fn holds(&self, r: usize) -> bool {
        self.slot_of.get(r).is_some_and(Option::is_some)
    }
}

impl CudaExperts {
    /// Copy RAM record `r` (landed and verified) into HBM `slot`.
    pub(super) fn copy_in(&mut self, r: usize, slot: usize) -> Result<(), EngineError> {
        let offset = self.pinned_offset(r)?;
        self.slots
            .load(slot, &self.pinned, offset, self.record_bytes)?;
        self.tier.h2d_bytes += self.record_bytes as u64;
        Ok(())
    }

    /// A free HBM slot for record `r`, evicting an unpinned record if full.
    pub(super) fn take_slot(&mut self, r: usize) -> Result<usize, EngineError> {
        let h = self.hbm.as_mut().ok_or_else(|| EngineError::Layout {
            what: "the HBM tier".into(),
            reason: "not in use on this path".into(),
        })?;
        let slot = match h.free.pop() {
            Some(s) => s,
            None => {
                let pinned = &h.pinned;
                let victim = h
                    .policy
                    .evict(&|v| pinned.contains(&v))
                    .ok_or(EngineError::Pool(ExpertsError::PoolTooSmall {
                        capacity: h.record_of.len(),
                        needed: h.pinned.len() + 1,
                    }))?;
                let s = h.slot_of[victim]
                    .take()
                    .ok_or_else(|| EngineError::Layout {
                        what: "the HBM tier".into(),
                        reason: format!("evicted record {victim} held no slot"),
                    })?;
                h.record_of[s] = None;
                let gone = h.entry_of.get(victim).copied().unwrap_or(usize::MAX);
                // The victim's entry must never reach its old slot's new record.
                if gone != usize::MAX {
                    self.slots.clear(gone)?;
                }
                s
            }
        };
        h.slot_of[r] = Some(slot);
        h.record_of[slot] = Some(r);
        h.policy.on_insert(r);
        Ok(slot)
    }

    /// Record `r` (landed) into a slot, and (`layer`, `expert`)'s table
    /// entry pointed at it.
    pub(super) fn place(
        &mut self,
        layer: usize,
        expert: usize,
        r: usize,
    ) -> Result<(), EngineError> {
        let slot = self.take_slot(r)?;
        self.copy_in(r, slot)?;
        let entry = self.entry(layer, expert);
        self.slots.point_to_slot(entry, slot)?;
        Ok(())
    }

    /// The HBM path of [`CudaExperts::ensure`]: `experts` of `layer` (distinct,
    /// records `records`) into slots; `uses` counts the rows using them.
    pub(super) fn ensure_hbm(
        &mut self,
        layer: usize,
        experts: &[u32],
        records: &[usize],
        uses: u64,
    ) -> Result<(), EngineError> {
        let Some(h) = self.hbm.as_mut() else {
            return Ok(());
        };
        h.pinned.clear();
        h.policy.on_step(records);
        let mut missing = Vec::new();
        for (&e, &r) in experts.iter().zip(records) {
            h.pinned.push(r);
            if h.slot_of[r].is_some() {
                h.policy.on_hit(r);
                self.tier.hbm_hits += 1;
            } else {
                missing.push((e, r));
            }
        }
        // Uses beyond the distinct experts (rows sharing one) are hits too.
        self.tier.hbm_hits += uses.saturating_sub(experts.len() as u64);
        if missing.is_empty() {
            return Ok(());
        }
        // At most the RAM tier's capacity at once: a step may need more
        // records than RAM holds (a prompt chunk under a small RAM budget).
        let batch = self.ram.capacity().max(1);
        for part in missing.chunks(batch) {
            // The pinned bytes earlier copies read may be overwritten now.
            self.slots.wait_loads()?;
            let want: Vec<usize> = part.iter().map(|m| m.1).collect();
            let need = self.ram.acquire(&want)?;
            let result = self.fill_from_ram(layer, part, &need);
            let finished = self.ram.finish();
            result?;
            finished?;
        }
        Ok(())
    }

    /// Copy each missing record into HBM as soon as it is in RAM.
    fn fill_from_ram(
        &mut self,
        layer: usize,
        missing: &[(u32, usize)],
        need: &[usize],
    ) -> Result<(), EngineError> {
        self.tier.ram_hits += (missing.len() - need.len()) as u64;
        let plan = self.ram.plan(need)?;
        self.ram.run_tracked(plan)?;
        self.start_hinted_reads()?;
        serve_landed(self, missing.to_vec(), |tiers, e, r| {
            tiers.place(layer, e as usize, r)
        })
    }
}
