//! The decode engine's KV cache on the device and causal decode attention
//! over it.
//!
//! Keys and values are f32, `[position][kv_head][dim]` per layer, so
//! attention computes on the exact values the projections produced (the
//! CPU reference stores them as BF16 hi/lo pairs for the same accuracy).
//! Attention is split-KV: each query head of each row folds chunks of
//! [`CHUNK_POSITIONS`] positions with the online softmax in parallel, and a
//! merge combines the chunks in order. Chunk boundaries depend only on the
//! position count, so results are the same on every run.
//!
//! Bounds: at most `capacity` positions per layer; storage grows by
//! doubling (from [`FIRST_POSITIONS`]) up to it, so a short sequence holds
//! little memory; the split partials hold `rows x q_heads x chunks x
//! (dim + 2)` f32, grown as needed and reused.

use cudarc::driver::{CudaSlice, LaunchConfig};

use super::buffers::DevAct;
use super::{DecodeKernels, addr, dim, linear_cfg};
use crate::context::Gpu;
use crate::error::CudaError;
use crate::launch::Args;

/// Positions per attention split.
pub const CHUNK_POSITIONS: usize = 256;
/// Positions allocated per layer at first.
pub const FIRST_POSITIONS: usize = 256;
/// Widest head.
pub const MAX_HEAD_DIM: usize = 256;

/// Keys and values of every layer of one sequence.
pub struct DevKvCache {
    gpu: Gpu,
    keys: Vec<CudaSlice<f32>>,
    values: Vec<CudaSlice<f32>>,
    layer_len: Vec<usize>,
    allocated: usize,
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
            .field("allocated", &self.allocated)
            .field("capacity", &self.capacity)
            .finish()
    }
}

impl DevKvCache {
    /// An empty cache of `layers` x up to `capacity` positions of
    /// `kv_heads x dim` keys and values.
    pub fn new(
        gpu: &Gpu,
        layers: usize,
        kv_heads: usize,
        dim: usize,
        capacity: usize,
    ) -> Result<Self, CudaError> {
        if layers == 0 || kv_heads == 0 || dim == 0 || dim > MAX_HEAD_DIM || capacity == 0 {
            return Err(CudaError::invalid(
                "kv cache",
                format!(
                    "{layers} layers, {kv_heads} kv heads of {dim} (at most {MAX_HEAD_DIM}), {capacity} positions"
                ),
            ));
        }
        let allocated = FIRST_POSITIONS.min(capacity);
        let mut c = Self {
            gpu: gpu.clone(),
            keys: Vec::with_capacity(layers),
            values: Vec::with_capacity(layers),
            layer_len: vec![0; layers],
            allocated: 0,
            capacity,
            kv_heads,
            dim,
            len: 0,
            part: None,
        };
        for _ in 0..layers {
            c.keys.push(c.alloc(allocated)?);
            c.values.push(c.alloc(allocated)?);
        }
        c.allocated = allocated;
        Ok(c)
    }

    fn alloc(&self, positions: usize) -> Result<CudaSlice<f32>, CudaError> {
        let n = positions * self.kv_heads * self.dim;
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

    /// Device bytes held.
    #[must_use]
    pub fn bytes(&self) -> usize {
        2 * self.keys.len() * self.allocated * self.kv_heads * self.dim * 4
    }

    /// Mark `n` positions every layer appended as complete.
    pub fn advance(&mut self, n: usize) {
        self.len = (self.len + n).min(self.capacity);
    }

    /// Room for `positions` positions in every layer, copying what is held.
    fn grow(&mut self, positions: usize) -> Result<(), CudaError> {
        if positions <= self.allocated {
            return Ok(());
        }
        // Queued launches may use the buffers about to be replaced.
        self.gpu.flush()?;
        let mut target = self.allocated.max(1);
        while target < positions {
            target *= 2;
        }
        let target = target.min(self.capacity);
        let width = self.kv_heads * self.dim;
        for l in 0..self.keys.len() {
            let used = self.layer_len[l] * width;
            for which in 0..2 {
                let mut fresh = self.alloc(target)?;
                let old = if which == 0 {
                    &self.keys[l]
                } else {
                    &self.values[l]
                };
                if used > 0 {
                    self.gpu
                        .stream()
                        .memcpy_dtod(&old.slice(..used), &mut fresh.slice_mut(..used))
                        .map_err(CudaError::driver("grow the KV cache"))?;
                }
                if which == 0 {
                    self.keys[l] = fresh;
                } else {
                    self.values[l] = fresh;
                }
            }
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
}

impl DecodeKernels {
    /// Append each row's keys and values to `layer` (positions `held..held
    /// + rows`), then attend row r's queries over positions `0..=held + r`
    /// with softmax scale `scale`: `q`, `out` are `rows x q_heads * dim`,
    /// `k`, `v` are `rows x kv_heads * dim`.
    #[allow(clippy::too_many_arguments, reason = "the attention step's operands")]
    pub fn attend(
        &self,
        kv: &mut DevKvCache,
        layer: usize,
        q_heads: usize,
        q: &DevAct,
        k: &DevAct,
        v: &DevAct,
        scale: f32,
        out: &mut DevAct,
    ) -> Result<(), CudaError> {
        let (rows, d, kvh) = (q.rows(), kv.dim, kv.kv_heads);
        let held = *kv.layer_len.get(layer).ok_or_else(|| {
            CudaError::invalid("attention", format!("layer {layer} of {}", kv.keys.len()))
        })?;
        let ok = q_heads % kvh == 0
            && q.cols() == q_heads * d
            && out.rows() == rows
            && out.cols() == q.cols()
            && k.rows() == rows
            && v.rows() == rows
            && k.cols() == kvh * d
            && v.cols() == kvh * d;
        if !ok {
            return Err(CudaError::invalid(
                "attention",
                format!(
                    "q {}x{}, k {}x{}, {q_heads} heads over {kvh} kv heads of {d}",
                    q.rows(),
                    q.cols(),
                    k.rows(),
                    k.cols()
                ),
            ));
        }
        if held + rows > kv.capacity {
            return Err(CudaError::invalid(
                "attention",
                format!(
                    "{} positions of a {}-position cache",
                    held + rows,
                    kv.capacity
                ),
            ));
        }
        kv.grow(held + rows)?;
        self.kv_append(kv, layer, k, v, held)?;
        kv.layer_len[layer] = held + rows;
        let splits = (held + rows).div_ceil(CHUNK_POSITIONS);
        let part_len = rows * q_heads * splits * (d + 2);
        let gpu = self.gpu.clone();
        let (keys, values) = (
            addr(&gpu, &kv.keys[layer], 0),
            addr(&gpu, &kv.values[layer], 0),
        );
        let part_addr = addr(&gpu, kv.part(part_len)?, 0);
        let cfg = LaunchConfig {
            grid_dim: (dim(q_heads, "x")?, dim(rows, "y")?, dim(splits, "z")?),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let v = [q.cols(), kvh, d, q_heads / kvh, held, CHUNK_POSITIONS].map(|x| x as i32);
        // One split: the partial kernel finishes the softmax itself.
        let direct = if splits == 1 {
            addr(&gpu, out.buf(), 0)
        } else {
            0u64
        };
        let mut a = Args::new();
        a.buf(&gpu, q.buf())
            .push(v[0])
            .push(keys)
            .push(values)
            .push(v[1])
            .push(v[2])
            .push(v[3])
            .push(v[4])
            .push(scale)
            .push(v[5])
            .push(part_addr)
            .push(direct);
        // SAFETY: matches `attn_partial`; row r reads positions below held +
        // r + 1 <= the layer's length, all allocated (`grow`), of kv_heads x
        // dim each (dim <= 256, the kernel's register tile); the partials
        // hold rows x q_heads x splits x (dim + 2) (allocated above); with
        // one split it writes out (rows x q_heads * dim) instead.
        unsafe { self.launch("attn_partial", cfg, a) }?;
        if splits == 1 {
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: (dim(q_heads, "x")?, dim(rows, "y")?, 1),
            block_dim: (d.next_power_of_two().clamp(32, 256) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let (di, si, oc) = (d as i32, splits as i32, out.cols() as i32);
        let mut a = Args::new();
        a.push(part_addr)
            .push(di)
            .push(si)
            .buf(&gpu, out.buf())
            .push(oc);
        // SAFETY: matches `attn_merge`; reads the partials written above,
        // writes q_heads x dim of each of out's rows.
        unsafe { self.launch("attn_merge", cfg, a) }?;
        Ok(())
    }

    fn kv_append(
        &self,
        kv: &mut DevKvCache,
        layer: usize,
        k: &DevAct,
        v: &DevAct,
        held: usize,
    ) -> Result<(), CudaError> {
        let width = (kv.kv_heads * kv.dim) as i32;
        let n = (k.rows() * k.cols()) as i64;
        let first = held as i32;
        let (keys, values) = (
            addr(&self.gpu, &kv.keys[layer], 0),
            addr(&self.gpu, &kv.values[layer], 0),
        );
        let g = &self.gpu;
        let mut a = Args::new();
        a.buf(g, k.buf())
            .buf(g, v.buf())
            .push(keys)
            .push(values)
            .push(width)
            .push(first)
            .push(n);
        // SAFETY: matches `kv_append`; writes positions held..held + rows of
        // the layer, inside its allocation (grown to at least held + rows).
        unsafe { self.launch("kv_append", linear_cfg(n as usize, 256)?, a) }?;
        Ok(())
    }
}
