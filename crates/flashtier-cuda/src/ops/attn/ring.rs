//! The restore ring: HBM slots that restored KV chunks land in, tile by
//! tile, for the attention over them.
//!
//! A tile (at most `tile_chunks` consecutive chunks of one layer, as the KV
//! store restores them into pinned host memory) is copied into the next of
//! `slots` HBM slots on the ring's own copy stream ([`KvRing::land`]). The
//! copy first waits, on the device, for the event recorded after the last
//! attention that read that slot ([`KvRing::release`]): a slot is reused
//! only after the kernel that read it finished, with no host sync for it.
//! The compute stream waits for the copy's event before the attention
//! reads the slot. `land` returns once the copy is done (a wait on that one
//! copy), so the caller may reuse the host bytes at once; meanwhile the
//! attention over the previous tile and the reads of the next tiles go on.
//!
//! Bounds: `slots x tile_chunks` chunks of HBM, allocated once; one copy
//! in flight per call.

use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream};

use super::super::addr;
use crate::context::Gpu;
use crate::error::CudaError;

/// A tile in a ring slot, ready for [`DecodeKernels::attend_tile`](crate::ops::DecodeKernels::attend_tile).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingTile {
    slot: usize,
    address: u64,
    layer: usize,
    first_chunk: usize,
    chunks: usize,
    chunk_floats: usize,
}

impl RingTile {
    /// Device address of the tile's first chunk.
    #[must_use]
    pub fn address(&self) -> u64 {
        self.address
    }
    /// The layer its chunks belong to.
    #[must_use]
    pub fn layer(&self) -> usize {
        self.layer
    }
    /// Its first chunk.
    #[must_use]
    pub fn first_chunk(&self) -> usize {
        self.first_chunk
    }
    /// Chunks it holds.
    #[must_use]
    pub fn chunks(&self) -> usize {
        self.chunks
    }
    /// f32 values per chunk.
    #[must_use]
    pub fn chunk_floats(&self) -> usize {
        self.chunk_floats
    }
}

/// HBM slots for restored tiles, a copy stream and a pair of events per
/// slot.
pub struct KvRing {
    gpu: Gpu,
    slots: CudaSlice<f32>,
    tile_chunks: usize,
    chunk_floats: usize,
    copy: Arc<CudaStream>,
    landed: Vec<CudaEvent>,
    freed: Vec<CudaEvent>,
    next: usize,
}

impl std::fmt::Debug for KvRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvRing")
            .field("slots", &self.landed.len())
            .field("tile_chunks", &self.tile_chunks)
            .field("chunk_floats", &self.chunk_floats)
            .finish_non_exhaustive()
    }
}

impl KvRing {
    /// `slots` slots of `tile_chunks` chunks of `chunk_floats` f32 each.
    pub fn new(
        gpu: &Gpu,
        slots: usize,
        tile_chunks: usize,
        chunk_floats: usize,
    ) -> Result<Self, CudaError> {
        let n = slots
            .checked_mul(tile_chunks)
            .and_then(|x| x.checked_mul(chunk_floats))
            .filter(|&n| n > 0)
            .ok_or_else(|| {
                CudaError::invalid(
                    "kv restore ring",
                    format!("{slots} slots of {tile_chunks} chunks of {chunk_floats} f32"),
                )
            })?;
        let stream = gpu.stream();
        let buf = stream
            .alloc_zeros::<f32>(n)
            .map_err(CudaError::driver(format!(
                "allocate {n} f32 of KV restore ring"
            )))?;
        let copy = gpu.new_stream()?;
        // The ring's memory is ready before any copy lands in it.
        copy.join(stream)
            .map_err(CudaError::driver("order the restore ring's copy stream"))?;
        let event = || {
            gpu.context()
                .new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
                .map_err(CudaError::driver("create a restore ring event"))
        };
        let landed = (0..slots).map(|_| event()).collect::<Result<_, _>>()?;
        let freed = (0..slots).map(|_| event()).collect::<Result<_, _>>()?;
        Ok(Self {
            gpu: gpu.clone(),
            slots: buf,
            tile_chunks,
            chunk_floats,
            copy,
            landed,
            freed,
            next: 0,
        })
    }

    /// Device bytes held.
    #[must_use]
    pub fn bytes(&self) -> usize {
        self.landed.len() * self.tile_chunks * self.chunk_floats * 4
    }

    /// Most chunks per tile.
    #[must_use]
    pub fn tile_chunks(&self) -> usize {
        self.tile_chunks
    }

    /// Copy `bytes` (whole chunks `first_chunk..` of `layer`, at most a
    /// tile) into the next slot once the attention that last read it
    /// finished; returns when the copy is done, the compute stream ordered
    /// after it.
    pub fn land(
        &mut self,
        layer: usize,
        first_chunk: usize,
        bytes: &[u8],
    ) -> Result<RingTile, CudaError> {
        let chunk_bytes = self.chunk_floats * 4;
        let chunks = bytes.len() / chunk_bytes;
        if bytes.len() % chunk_bytes != 0 || chunks == 0 || chunks > self.tile_chunks {
            return Err(CudaError::invalid(
                "kv restore",
                format!(
                    "{} bytes are not 1..={} chunks of {chunk_bytes}",
                    bytes.len(),
                    self.tile_chunks
                ),
            ));
        }
        let slot = self.next;
        self.next = (self.next + 1) % self.landed.len();
        let offset = slot * self.tile_chunks * self.chunk_floats;
        let dst = addr(&self.gpu, &self.slots, offset);
        let (landed, freed) = (&self.landed[slot], &self.freed[slot]);
        self.copy
            .wait(freed)
            .map_err(CudaError::driver("wait for the attention over a ring slot"))?;
        self.gpu
            .context()
            .bind_to_thread()
            .map_err(CudaError::driver("bind context"))?;
        // SAFETY: `dst` is slot `slot` of the ring, `tile_chunks` chunks
        // long, and `bytes` is at most that (checked); the copy stream waits
        // (above) for the last kernel that read the slot. `bytes` stays
        // borrowed until the copy completed: the event is synchronised
        // below before this returns.
        unsafe { cudarc::driver::result::memcpy_htod_async(dst, bytes, self.copy.cu_stream()) }
            .map_err(CudaError::driver(format!(
                "copy {} restored KV bytes to the device",
                bytes.len()
            )))?;
        landed
            .record(&self.copy)
            .map_err(CudaError::driver("record a restore copy"))?;
        landed
            .synchronize()
            .map_err(CudaError::driver("wait for a restore copy"))?;
        self.gpu.stream().wait(landed).map_err(CudaError::driver(
            "order the attention after a restore copy",
        ))?;
        Ok(RingTile {
            slot,
            address: dst,
            layer,
            first_chunk,
            chunks,
            chunk_floats: self.chunk_floats,
        })
    }

    /// The kernels queued on the compute stream so far (the attention over
    /// `tile`) must finish before its slot is written again.
    pub fn release(&self, tile: &RingTile) -> Result<(), CudaError> {
        let freed = self
            .freed
            .get(tile.slot)
            .ok_or_else(|| CudaError::invalid("kv restore ring", format!("slot {}", tile.slot)))?;
        freed
            .record(self.gpu.stream())
            .map_err(CudaError::driver("record the attention over a ring slot"))
    }
}

impl Drop for KvRing {
    fn drop(&mut self) {
        // Copies may still be in flight into slots about to be freed.
        let _ = self.copy.synchronize();
        let _ = self.gpu.flush();
        let _ = self.gpu.synchronize();
    }
}
