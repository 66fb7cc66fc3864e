//! `ExpertArena`: one allocation split into slabs of equal record slots, the
//! memory the slots backing reads expert records into.
//!
//! Invariants: the slot stride is a non-zero multiple of 4096 (every slot is a
//! legal O_DIRECT / io_uring destination); no dimension is zero; the total
//! size `slabs * slots_per_slab * stride` does not overflow and the memory
//! provided covers it. Who allocates is a parameter ([`ArenaMemory`]): aligned
//! host memory here ([`HostMemory`]), pinned or unified memory from
//! `flashtier-cuda`. Where the memory reports a device address, a slot's device
//! address is `device_base + slot * stride`.
//!
//! Bound: the arena is the pool's whole slot memory, fixed at construction.

use flashtier_io::{ALIGN, AlignedBuf, RegionMemory, SlotTable};

/// Invalid arena geometry or memory.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum ArenaError {
    /// A dimension is zero.
    #[error(
        "expert arena: zero geometry ({slabs} slabs x {slots_per_slab} slots x {stride_bytes} bytes)"
    )]
    Zero {
        /// Slabs.
        slabs: u32,
        /// Slots per slab.
        slots_per_slab: u32,
        /// Slot stride.
        stride_bytes: usize,
    },
    /// The stride is not a multiple of 4096.
    #[error("expert arena: slot stride {stride_bytes} is not a multiple of {ALIGN} (O_DIRECT)")]
    Stride {
        /// Slot stride.
        stride_bytes: usize,
    },
    /// The total size overflows.
    #[error("expert arena: {slabs} x {slots_per_slab} x {stride_bytes} bytes overflows")]
    Overflow {
        /// Slabs.
        slabs: u32,
        /// Slots per slab.
        slots_per_slab: u32,
        /// Slot stride.
        stride_bytes: usize,
    },
    /// The provider returned too little or misaligned memory, or failed.
    #[error("expert arena: memory provider: {0}")]
    Memory(String),
    /// A slot index outside the arena.
    #[error("expert arena: slot ({slab}, {slot}) outside {slabs} x {slots_per_slab}")]
    SlotOutOfRange {
        /// Slab asked for.
        slab: u32,
        /// Slot asked for.
        slot: u32,
        /// Slabs.
        slabs: u32,
        /// Slots per slab.
        slots_per_slab: u32,
    },
}

/// Who allocates an arena: host memory here, pinned or unified memory from
/// the CUDA layer.
pub trait ArenaMemory {
    /// Allocate at least `len_bytes` of 4096-aligned, initialised memory.
    fn allocate(&self, len_bytes: usize) -> Result<Box<dyn RegionMemory>, String>;
}

/// Zeroed, 4096-aligned host memory.
#[derive(Debug, Clone, Copy, Default)]
pub struct HostMemory;

impl ArenaMemory for HostMemory {
    fn allocate(&self, len_bytes: usize) -> Result<Box<dyn RegionMemory>, String> {
        Ok(Box::new(AlignedBuf::zeroed(len_bytes)))
    }
}

/// Slabs x slots of `stride_bytes` each, in one allocation.
#[derive(Debug)]
pub struct ExpertArena {
    table: SlotTable,
    slabs: u32,
    slots_per_slab: u32,
    stride_bytes: usize,
}

impl ExpertArena {
    /// An arena in host memory.
    pub fn host(slabs: u32, slots_per_slab: u32, stride_bytes: usize) -> Result<Self, ArenaError> {
        Self::new(slabs, slots_per_slab, stride_bytes, &HostMemory)
    }

    /// An arena in memory from `memory`.
    pub fn new(
        slabs: u32,
        slots_per_slab: u32,
        stride_bytes: usize,
        memory: &dyn ArenaMemory,
    ) -> Result<Self, ArenaError> {
        if slabs == 0 || slots_per_slab == 0 || stride_bytes == 0 {
            return Err(ArenaError::Zero {
                slabs,
                slots_per_slab,
                stride_bytes,
            });
        }
        if stride_bytes % ALIGN != 0 {
            return Err(ArenaError::Stride { stride_bytes });
        }
        let total = (slabs as usize)
            .checked_mul(slots_per_slab as usize)
            .and_then(|n| n.checked_mul(stride_bytes))
            .filter(|&t| isize::try_from(t).is_ok())
            .ok_or(ArenaError::Overflow {
                slabs,
                slots_per_slab,
                stride_bytes,
            })?;
        let mem = memory.allocate(total).map_err(ArenaError::Memory)?;
        if mem.len_bytes() < total || mem.base_ptr() as usize % ALIGN != 0 {
            return Err(ArenaError::Memory(format!(
                "asked {total} bytes aligned to {ALIGN}, got {} bytes at {:#x}",
                mem.len_bytes(),
                mem.base_ptr() as usize
            )));
        }
        let count = slabs as usize * slots_per_slab as usize;
        let table = SlotTable::new(mem, stride_bytes, count)
            .map_err(|e| ArenaError::Memory(e.to_string()))?;
        Ok(Self {
            table,
            slabs,
            slots_per_slab,
            stride_bytes,
        })
    }

    /// Slabs.
    #[must_use]
    pub fn slabs(&self) -> u32 {
        self.slabs
    }

    /// Slots per slab.
    #[must_use]
    pub fn slots_per_slab(&self) -> u32 {
        self.slots_per_slab
    }

    /// Total slots.
    #[must_use]
    pub fn slots(&self) -> usize {
        self.slabs as usize * self.slots_per_slab as usize
    }

    /// Bytes per slot.
    #[must_use]
    pub fn stride_bytes(&self) -> usize {
        self.stride_bytes
    }

    /// Bytes of all slots.
    #[must_use]
    pub fn total_bytes(&self) -> usize {
        self.slots() * self.stride_bytes
    }

    /// The slots, for reads (see `flashtier_io::SlotTable`).
    #[must_use]
    pub fn table(&self) -> &SlotTable {
        &self.table
    }

    /// The slots, for submitting and collecting reads.
    pub fn table_mut(&mut self) -> &mut SlotTable {
        &mut self.table
    }

    /// Linear slot index of `(slab, slot)`.
    pub fn linear(&self, slab: u32, slot: u32) -> Result<usize, ArenaError> {
        if slab >= self.slabs || slot >= self.slots_per_slab {
            return Err(ArenaError::SlotOutOfRange {
                slab,
                slot,
                slabs: self.slabs,
                slots_per_slab: self.slots_per_slab,
            });
        }
        Ok(slab as usize * self.slots_per_slab as usize + slot as usize)
    }

    /// Byte offset of linear slot `i` in the region (`None` past the end).
    #[must_use]
    pub fn slot_offset(&self, i: usize) -> Option<usize> {
        (i < self.slots()).then(|| i * self.stride_bytes)
    }

    /// Host address of linear slot `i`.
    #[must_use]
    pub fn slot_host_addr(&self, i: usize) -> Option<u64> {
        self.table.host_addr(i)
    }

    /// Device address of linear slot `i`, when the memory has one.
    #[must_use]
    pub fn slot_device_addr(&self, i: usize) -> Option<u64> {
        self.table.device_addr(i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_is_strided_and_checked() {
        let a = ExpertArena::host(2, 3, 8192).expect("valid");
        assert_eq!(a.total_bytes(), 2 * 3 * 8192);
        assert_eq!(a.table().count(), 6);
        let s = |slab, slot| {
            a.slot_host_addr(a.linear(slab, slot).expect("in range"))
                .expect("in range")
        };
        assert_eq!(s(0, 1) - s(0, 0), 8192);
        assert_eq!(s(1, 0) - s(0, 0), 3 * 8192);
        assert_eq!(s(0, 0) % 4096, 0);
        assert!(a.linear(2, 0).is_err() && a.linear(0, 3).is_err());
        assert_eq!(a.slot_device_addr(0), None);
    }

    #[test]
    fn bad_geometry_is_rejected() {
        assert!(matches!(
            ExpertArena::host(0, 1, 4096),
            Err(ArenaError::Zero { .. })
        ));
        assert!(matches!(
            ExpertArena::host(1, 0, 4096),
            Err(ArenaError::Zero { .. })
        ));
        assert!(matches!(
            ExpertArena::host(1, 1, 0),
            Err(ArenaError::Zero { .. })
        ));
        assert!(matches!(
            ExpertArena::host(1, 1, 5000),
            Err(ArenaError::Stride { .. })
        ));
        assert!(matches!(
            ExpertArena::host(u32::MAX, u32::MAX, 1 << 40),
            Err(ArenaError::Overflow { .. })
        ));
    }

    struct Short;
    impl ArenaMemory for Short {
        fn allocate(&self, len: usize) -> Result<Box<dyn RegionMemory>, String> {
            Ok(Box::new(AlignedBuf::zeroed(len / 2)))
        }
    }

    #[test]
    fn a_short_provider_is_rejected() {
        assert!(matches!(
            ExpertArena::new(1, 4, 4096, &Short),
            Err(ArenaError::Memory(_))
        ));
    }
}
