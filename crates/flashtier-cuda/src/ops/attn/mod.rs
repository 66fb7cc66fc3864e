//! The decode engine's KV cache on the device and causal decode attention
//! over it.
//!
//! Keys and values are f32, so attention computes on the exact values the
//! projections produced (the CPU reference stores them as BF16 hi/lo pairs
//! for the same accuracy). Each layer's positions are cut into chunks of
//! [`CHUNK_POSITIONS`]; a chunk is laid out as one block of the KV store
//! format (`docs/kv-format.md`): `[K|V][kv_head][position][dim]`, each
//! (K|V, kv head) group `group_floats` apart (`CHUNK_POSITIONS x dim`
//! rounded up to 4096 bytes), so a chunk goes to the store and comes back
//! byte for byte with no reshuffle.
//!
//! Attention is split-KV: each query head of each row folds one chunk per
//! split with the online softmax in parallel, and a merge combines the
//! splits in order. Split boundaries depend only on the position count,
//! and a split's result depends only on its chunk's values, so results are
//! the same on every run, whichever launch computed a split: the resident
//! chunks in one launch ([`DecodeKernels::attend_resident`](crate::ops::DecodeKernels::attend_resident)), restored
//! chunks tile by tile from the restore ring ([`ring`],
//! [`DecodeKernels::attend_tile`](crate::ops::DecodeKernels::attend_tile)).
//!
//! Residency ([`window`]): the newest `slots` chunks of a layer are
//! resident, chunk `c` in slot `c % slots` of the layer's arena; with every
//! chunk resident (the default) nothing wraps. Older chunks must have been
//! offloaded ([`DevKvCache::mark_offloaded`]) before an append reuses their
//! slot; [`DecodeKernels::kv_push`](crate::ops::DecodeKernels::kv_push) refuses otherwise.
//!
//! Bounds: at most `capacity` positions per layer; a layer's arena grows by
//! doubling (from one chunk) up to `slots` chunks of `2 x kv_heads x
//! group_floats` f32, so a short sequence holds little memory; the split
//! partials hold `rows x q_heads x splits x (dim + 2)` f32, grown as needed
//! and reused (outside a KV budget).

mod launch;
mod prompt;
pub mod ring;
pub mod rows;
pub mod window;

pub use launch::{AttnSplits, PROMPT_ATTN_QUERIES, PROMPT_ATTN_ROWS};
pub(crate) use launch::{PROMPT_ATTN_KERNELS, prompt_attn_smem};
pub use prompt::PROMPT_ATTN_TC_QUERIES;
pub(crate) use prompt::{PROMPT_ATTN_TC_KERNELS, prompt_attn_tc_smem, prompt_attn_widths};
pub use rows::{DecodeRows, RowsAt};

use cudarc::driver::CudaSlice;

use super::addr;
use crate::context::Gpu;
use crate::error::CudaError;
use crate::pinned::PinnedMemory;
use window::ChunkWindow;

/// Positions per chunk: one attention split, one KV store block.
pub const CHUNK_POSITIONS: usize = 256;
/// Widest head.
pub const MAX_HEAD_DIM: usize = 256;

/// f32 values of one (K|V, kv head) group of a chunk: `CHUNK_POSITIONS x
/// dim`, rounded up to 4096 bytes (the KV store format's group stride).
#[must_use]
pub fn group_floats(dim: usize) -> usize {
    (CHUNK_POSITIONS * dim).div_ceil(1024) * 1024
}

/// Keys and values of every layer of one sequence.
pub struct DevKvCache {
    gpu: Gpu,
    arenas: Vec<CudaSlice<f32>>,
    layer_len: Vec<usize>,
    /// Chunks below this were offloaded, per layer.
    offloaded: Vec<usize>,
    /// Chunk slots allocated per layer.
    allocated: usize,
    window: ChunkWindow,
    capacity: usize,
    kv_heads: usize,
    dim: usize,
    len: usize,
    part: Option<CudaSlice<f32>>,
}

impl std::fmt::Debug for DevKvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevKvCache")
            .field("len", &self.len)
            .field("allocated_chunks", &self.allocated)
            .field("slots", &self.window.slots())
            .field("capacity", &self.capacity)
            .finish()
    }
}

impl DevKvCache {
    /// An empty cache of `layers` x up to `capacity` positions of
    /// `kv_heads x dim` keys and values, every chunk resident.
    pub fn new(
        gpu: &Gpu,
        layers: usize,
        kv_heads: usize,
        dim: usize,
        capacity: usize,
    ) -> Result<Self, CudaError> {
        Self::with_slots(gpu, layers, kv_heads, dim, capacity, usize::MAX)
    }

    /// As [`Self::new`], with at most `slots` chunks per layer resident
    /// (the newest; see [`window`]).
    pub fn with_slots(
        gpu: &Gpu,
        layers: usize,
        kv_heads: usize,
        dim: usize,
        capacity: usize,
        slots: usize,
    ) -> Result<Self, CudaError> {
        if layers == 0 || kv_heads == 0 || dim == 0 || dim > MAX_HEAD_DIM || capacity == 0 {
            return Err(CudaError::invalid(
                "kv cache",
                format!(
                    "{layers} layers, {kv_heads} kv heads of {dim} (at most {MAX_HEAD_DIM}), {capacity} positions"
                ),
            ));
        }
        let window = ChunkWindow::new(slots, capacity)
            .map_err(|e| CudaError::invalid("kv cache", e.to_string()))?;
        let mut c = Self {
            gpu: gpu.clone(),
            arenas: Vec::with_capacity(layers),
            layer_len: vec![0; layers],
            offloaded: vec![0; layers],
            allocated: 0,
            window,
            capacity,
            kv_heads,
            dim,
            len: 0,
            part: None,
        };
        for _ in 0..layers {
            c.arenas.push(c.alloc(1)?);
        }
        c.allocated = 1;
        Ok(c)
    }

    fn alloc(&self, chunks: usize) -> Result<CudaSlice<f32>, CudaError> {
        let n = chunks * self.chunk_floats();
        self.gpu
            .stream()
            .alloc_zeros::<f32>(n)
            .map_err(CudaError::driver(format!("allocate {n} f32 of KV cache")))
    }

    /// Positions every layer holds.
    #[must_use]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Is it empty?
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Positions it can hold.
    #[must_use]
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Width of one head.
    #[must_use]
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Key/value heads.
    #[must_use]
    pub fn kv_heads(&self) -> usize {
        self.kv_heads
    }

    /// Layers.
    #[must_use]
    pub fn layers(&self) -> usize {
        self.arenas.len()
    }

    /// The resident window.
    #[must_use]
    pub fn window(&self) -> ChunkWindow {
        self.window
    }

    /// f32 values of one chunk (K and V of every kv head).
    #[must_use]
    pub fn chunk_floats(&self) -> usize {
        2 * self.kv_heads * group_floats(self.dim)
    }

    /// Bytes of one chunk (one KV store block).
    #[must_use]
    pub fn chunk_bytes(&self) -> usize {
        4 * self.chunk_floats()
    }

    /// Positions `layer` holds (it may run one step ahead of [`Self::len`]).
    pub fn layer_len(&self, layer: usize) -> Result<usize, CudaError> {
        self.layer_len.get(layer).copied().ok_or_else(|| {
            CudaError::invalid("kv cache", format!("layer {layer} of {}", self.layers()))
        })
    }

    /// Chunks of `layer` below this are in the store (not resident).
    pub fn offloaded(&self, layer: usize) -> Result<usize, CudaError> {
        self.offloaded.get(layer).copied().ok_or_else(|| {
            CudaError::invalid("kv cache", format!("layer {layer} of {}", self.layers()))
        })
    }

    /// Device bytes held.
    #[must_use]
    pub fn bytes(&self) -> usize {
        self.arenas.len() * self.allocated * self.chunk_bytes()
    }

    /// Mark `n` positions every layer appended as complete.
    pub fn advance(&mut self, n: usize) {
        self.len = (self.len + n).min(self.capacity);
    }

    /// Forget the last `n` complete positions of every layer (a step
    /// whose token nobody reads), so the next append writes over them.
    /// Only a cache whose every chunk stays resident may: a window that
    /// slid past those positions' chunks has no room to take them back.
    pub fn rewind(&mut self, n: usize) -> Result<(), CudaError> {
        let keep = self.len.checked_sub(n);
        let whole = self.rewinds();
        let in_step = self.layer_len.iter().any(|&l| l != self.len);
        match keep {
            Some(keep) if whole && !in_step => {
                self.len = keep;
                self.layer_len.iter_mut().for_each(|l| *l = keep);
                Ok(())
            }
            _ => Err(CudaError::invalid(
                "kv cache",
                format!(
                    "rewind {n} of {} positions (every chunk resident: {whole}; layers mid-step: {in_step})",
                    self.len
                ),
            )),
        }
    }

    /// Whether [`Self::rewind`] may take positions back.
    #[must_use]
    pub fn rewinds(&self) -> bool {
        self.window.slots() >= ChunkWindow::chunks(self.capacity)
    }

    /// Room for `positions` positions in every layer, copying what is held
    /// (only while nothing wraps: chunks sit at their own index).
    fn grow(&mut self, positions: usize) -> Result<(), CudaError> {
        let need = ChunkWindow::chunks(positions).min(self.window.slots());
        if need <= self.allocated {
            return Ok(());
        }
        // Queued launches may use the buffers about to be replaced.
        self.gpu.flush()?;
        let mut target = self.allocated.max(1);
        while target < need {
            target *= 2;
        }
        let target = target.min(self.window.slots());
        let cf = self.chunk_floats();
        for l in 0..self.arenas.len() {
            let used = ChunkWindow::chunks(self.layer_len[l]) * cf;
            let mut fresh = self.alloc(target)?;
            if used > 0 {
                self.gpu
                    .stream()
                    .memcpy_dtod(&self.arenas[l].slice(..used), &mut fresh.slice_mut(..used))
                    .map_err(CudaError::driver("grow the KV cache"))?;
            }
            self.arenas[l] = fresh;
        }
        self.allocated = target;
        Ok(())
    }

    fn part(&mut self, len: usize) -> Result<&mut CudaSlice<f32>, CudaError> {
        if self.part.as_ref().is_none_or(|p| p.len() < len) {
            // Queued launches may use the partials about to be replaced.
            self.gpu.flush()?;
            let fresh = self
                .gpu
                .stream()
                .alloc_zeros::<f32>(len.next_power_of_two())
                .map_err(CudaError::driver("allocate attention partials"))?;
            self.part = Some(fresh);
        }
        self.part
            .as_mut()
            .ok_or_else(|| CudaError::invalid("attention partials", "missing".to_string()))
    }

    /// Copy chunk `chunk` of `layer` (complete and resident) into `dst` at
    /// byte 0, after every kernel queued so far (the appends that wrote
    /// it); returns when the bytes are there (a host sync).
    pub fn download_chunk(
        &self,
        layer: usize,
        chunk: usize,
        dst: &mut PinnedMemory,
    ) -> Result<(), CudaError> {
        let held = self.layer_len(layer)?;
        let resident = self.window.first_resident(held).max(self.offloaded(layer)?);
        let bytes = self.chunk_bytes();
        if chunk < resident || (chunk + 1) * CHUNK_POSITIONS > held || !dst.contains(0, bytes) {
            return Err(CudaError::invalid(
                "kv offload",
                format!(
                    "chunk {chunk} of layer {layer} ({held} positions, chunks {resident}.. resident) into {} bytes",
                    dst.len_bytes()
                ),
            ));
        }
        let slot = chunk % self.window.slots();
        let src = addr(&self.gpu, &self.arenas[layer], slot * self.chunk_floats());
        let stream = self.gpu.stream();
        self.gpu
            .context()
            .bind_to_thread()
            .map_err(CudaError::driver("bind context"))?;
        let host = dst.bytes_mut(0, bytes)?;
        // SAFETY: `src` is slot `slot` of the layer's arena, `bytes` long
        // (slot < allocated: the chunk is resident); `host` is `bytes` of
        // pinned memory, borrowed until the stream is synchronised below,
        // before this returns.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(host, src, stream.cu_stream()) }
            .map_err(CudaError::driver("copy a KV chunk to the host"))?;
        stream
            .synchronize()
            .map_err(CudaError::driver("wait for a KV chunk's copy"))
    }

    /// Chunks of `layer` below `chunks` are in the store: their slots may
    /// be reused.
    pub fn mark_offloaded(&mut self, layer: usize, chunks: usize) -> Result<(), CudaError> {
        let n = self.layers();
        let slot = self
            .offloaded
            .get_mut(layer)
            .ok_or_else(|| CudaError::invalid("kv cache", format!("layer {layer} of {n}")))?;
        *slot = (*slot).max(chunks);
        Ok(())
    }
}
