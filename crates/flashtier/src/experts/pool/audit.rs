//! The pool's invariants, checked on demand (tests, debugging).

use std::collections::HashMap;

use super::{Backing, ExpertPool, Residency};

impl ExpertPool {
    /// Check the pool's invariants (tests and debugging): every slot owned by
    /// at most one record, free slots owned by none, the resident count equal
    /// to the policy's, pinned records of an open step resident, slots with a
    /// read in flight owned by a loading record. Returns what is violated.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut owner: HashMap<u32, usize> = HashMap::new();
        let mut resident = 0;
        for (r, e) in self.entries.iter().enumerate() {
            if e.residency == Residency::Absent {
                let pinned = Self::is_pinned(&self.entries, self.step, self.step_open, r);
                if pinned && self.step_records.contains(&r) && !self.step_failed.contains(&r) {
                    return Err(format!("record {r} of the open step is not resident"));
                }
                continue;
            }
            resident += 1;
            if self.backing == Backing::Slots {
                if let Some(prev) = owner.insert(e.slot, r) {
                    return Err(format!("slot {} owned by records {prev} and {r}", e.slot));
                }
                if self.free_slots.contains(&e.slot) {
                    return Err(format!("slot {} of record {r} is on the free list", e.slot));
                }
                let busy = self
                    .arena
                    .as_ref()
                    .is_some_and(|a| a.table().is_busy(e.slot as usize));
                if busy && e.residency != Residency::Loading {
                    return Err(format!(
                        "slot {} has a read in flight but record {r} is not loading",
                        e.slot
                    ));
                }
            }
        }
        if resident != self.resident || resident != self.policy.len() || resident > self.capacity {
            return Err(format!(
                "resident {resident}, counted {}, policy {}, capacity {}",
                self.resident,
                self.policy.len(),
                self.capacity
            ));
        }
        Ok(())
    }
}
