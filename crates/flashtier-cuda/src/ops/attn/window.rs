//! Which KV chunks of a layer are resident in HBM and which live in the
//! KV store: the arithmetic of the resident window, with no device in it
//! (tested on the CPU).
//!
//! A layer's positions are cut into chunks of [`CHUNK_POSITIONS`], the
//! same cut the split-KV attention folds by, so a chunk is one attention
//! split and one KV store block. The newest `slots` chunks are resident
//! (chunk `c` in arena slot `c % slots`); every older chunk was offloaded
//! and is restored, tile by tile, for each attention over it. Dense decode
//! attention reads every chunk at every step, so which old chunks stay
//! resident does not change the bytes restored: the newest stay because
//! the step writes there.
//!
//! A step appends at most [`CHUNK_POSITIONS`] rows, so it touches at most
//! two chunks; with at least two resident slots the slot a new chunk takes
//! held a chunk the step does not touch and that is complete (all its
//! positions written before the step), so it can be offloaded first.

use std::ops::Range;

use super::CHUNK_POSITIONS;

/// Fewest resident chunk slots per layer when chunks are offloaded.
pub const MIN_RESIDENT_CHUNKS: usize = 2;

/// The resident window of a layer: the newest `slots` chunks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkWindow {
    slots: usize,
}

/// What a step would do that the window forbids.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WindowError {
    /// Too few resident slots for chunks ever to be offloaded.
    #[error(
        "{slots} resident chunk slots per layer (at least {MIN_RESIDENT_CHUNKS} when chunks are offloaded)"
    )]
    TooFewSlots {
        /// Slots asked for.
        slots: usize,
    },
    /// A step of more rows than a chunk.
    #[error("{rows} rows in one step (at most {CHUNK_POSITIONS} while chunks are offloaded)")]
    StepTooLong {
        /// Rows of the step.
        rows: usize,
    },
    /// Chunks that must leave HBM before the step are not offloaded yet.
    #[error("chunks {}..{} must be offloaded before positions {held}.. are written", .missing.start, .missing.end)]
    NotOffloaded {
        /// The chunks still resident that the step's slots need.
        missing: Range<usize>,
        /// Positions held before the step.
        held: usize,
    },
}

impl ChunkWindow {
    /// A window of `slots` resident chunks for a layer of at most
    /// `capacity` positions: every chunk resident when `slots` covers
    /// them, else at least [`MIN_RESIDENT_CHUNKS`].
    pub fn new(slots: usize, capacity: usize) -> Result<Self, WindowError> {
        let all = capacity.div_ceil(CHUNK_POSITIONS).max(1);
        if slots >= all {
            return Ok(Self { slots: all });
        }
        if slots < MIN_RESIDENT_CHUNKS {
            return Err(WindowError::TooFewSlots { slots });
        }
        Ok(Self { slots })
    }

    /// Resident chunk slots.
    #[must_use]
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Chunks that `len` positions fill (the last one maybe in part).
    #[must_use]
    pub fn chunks(len: usize) -> usize {
        len.div_ceil(CHUNK_POSITIONS)
    }

    /// The first resident chunk when `len` positions are held: chunks
    /// below it live in the store.
    #[must_use]
    pub fn first_resident(&self, len: usize) -> usize {
        Self::chunks(len).saturating_sub(self.slots)
    }

    /// Chunks to offload before `rows` rows are appended at position
    /// `held`, when chunks below `offloaded` are already in the store:
    /// every chunk that must leave HBM for the step's new chunks. Each is
    /// complete (below `held / CHUNK_POSITIONS`).
    pub fn evictions(
        &self,
        held: usize,
        rows: usize,
        offloaded: usize,
    ) -> Result<Range<usize>, WindowError> {
        let after = self.first_resident(held + rows);
        if after == 0 {
            return Ok(offloaded..offloaded);
        }
        if rows > CHUNK_POSITIONS {
            return Err(WindowError::StepTooLong { rows });
        }
        let range = offloaded.min(after)..after;
        debug_assert!(range.end <= held / CHUNK_POSITIONS);
        Ok(range)
    }

    /// Check that appending `rows` at `held` overwrites no slot whose
    /// chunk is not in the store (`offloaded`: chunks below it are).
    pub fn check_append(
        &self,
        held: usize,
        rows: usize,
        offloaded: usize,
    ) -> Result<(), WindowError> {
        let after = self.first_resident(held + rows);
        if after > 0 && rows > CHUNK_POSITIONS {
            return Err(WindowError::StepTooLong { rows });
        }
        if after > offloaded {
            return Err(WindowError::NotOffloaded {
                missing: offloaded..after,
                held,
            });
        }
        Ok(())
    }

    /// The offloaded chunks of `len` positions, `0..first_resident`, in
    /// tiles of at most `tile_chunks` consecutive chunks, in order.
    #[must_use]
    pub fn cold_tiles(&self, len: usize, tile_chunks: usize) -> Vec<Range<usize>> {
        let cold = self.first_resident(len);
        let step = tile_chunks.max(1);
        (0..cold)
            .step_by(step)
            .map(|s| s..(s + step).min(cold))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const C: usize = CHUNK_POSITIONS;

    #[test]
    fn a_window_covering_the_capacity_never_offloads() {
        let w = ChunkWindow::new(usize::MAX, 10 * C).unwrap();
        assert_eq!(w.slots(), 10);
        assert_eq!(w.first_resident(10 * C), 0);
        assert_eq!(w.evictions(9 * C, C, 0).unwrap(), 0..0);
        assert!(w.cold_tiles(10 * C, 2).is_empty());
    }

    #[test]
    fn one_slot_is_refused_when_chunks_leave() {
        assert_eq!(
            ChunkWindow::new(1, 4 * C),
            Err(WindowError::TooFewSlots { slots: 1 })
        );
        // A one-chunk context needs no second slot.
        assert_eq!(ChunkWindow::new(1, C).unwrap().slots(), 1);
    }

    #[test]
    fn decode_crossing_a_chunk_evicts_the_oldest() {
        let w = ChunkWindow::new(2, 100 * C).unwrap();
        // 2 chunks full; the next position opens chunk 2, chunk 0 leaves.
        assert_eq!(w.evictions(2 * C, 1, 0).unwrap(), 0..1);
        assert_eq!(w.evictions(2 * C + 1, 1, 1).unwrap(), 1..1);
        assert_eq!(w.cold_tiles(5 * C + 3, 2), vec![0..2, 2..4]);
        assert_eq!(w.cold_tiles(6 * C + 3, 2), vec![0..2, 2..4, 4..5]);
    }

    #[test]
    fn appending_over_a_resident_chunk_is_refused() {
        let w = ChunkWindow::new(2, 100 * C).unwrap();
        assert_eq!(
            w.check_append(2 * C, 1, 0),
            Err(WindowError::NotOffloaded {
                missing: 0..1,
                held: 2 * C
            })
        );
        assert!(w.check_append(2 * C, 1, 1).is_ok());
        assert_eq!(
            w.check_append(2 * C, C + 1, 5),
            Err(WindowError::StepTooLong { rows: C + 1 })
        );
    }

    proptest! {
        /// Over any sequence of steps, evicting what `evictions` names
        /// keeps every append legal, only ever evicts complete chunks, and
        /// the cold tiles cover exactly the evicted chunks, in order.
        #[test]
        fn steps_keep_the_window_consistent(
            slots in 2usize..6,
            steps in proptest::collection::vec(1usize..=C, 1..40),
        ) {
            let w = ChunkWindow::new(slots, 64 * C).unwrap();
            let (mut held, mut offloaded) = (0usize, 0usize);
            for rows in steps {
                if held + rows > 64 * C { break; }
                let ev = w.evictions(held, rows, offloaded).unwrap();
                prop_assert_eq!(ev.start, offloaded);
                prop_assert!(ev.end * C <= held, "evicts an incomplete chunk");
                offloaded = ev.end;
                prop_assert!(w.check_append(held, rows, offloaded).is_ok());
                held += rows;
                prop_assert_eq!(w.first_resident(held), offloaded);
                let tiles = w.cold_tiles(held, 3);
                let flat: Vec<usize> = tiles.iter().flat_map(|t| t.clone()).collect();
                prop_assert_eq!(flat, (0..offloaded).collect::<Vec<_>>());
                prop_assert!(tiles.iter().all(|t| t.len() <= 3 && !t.is_empty()));
                // Resident chunks fit their slots without two sharing one.
                let resident = ChunkWindow::chunks(held) - offloaded;
                prop_assert!(resident <= slots);
            }
        }
    }
}
