//! Sparse attention over the blocks an indexer keeps (Qwen4-Exp's QSA
//! layers): the cache of one layer in HBM ([`DevSparse`]) and the step
//! that appends a chunk's keys and attends ([`DecodeKernels::sparse_attend`]).
//!
//! The cache holds every position's keys and values (`kv_heads * head_dim`
//! f32 each) and raw index keys (`index_dim` f32), and one key per complete
//! block of `ratio` positions, made once when the block completes. It grows
//! by doubling as positions arrive, up to its capacity; a step's scratch
//! (the indexer's scores and each row's kept blocks) grows to the largest
//! step and is reused.
//!
//! Per row at position `t`: each of the `(t + 1) / ratio` complete blocks
//! scores `sum over index heads of relu(iq . key) / sqrt(index_dim)`; the
//! `keep` best stay as torch's CPU `topk` keeps them, ties included (one
//! thread replays its selection, `tk_keep` in `route.cu`); the attention
//! runs over the kept blocks' positions ascending, then the incomplete last
//! block's, as an online softmax over chunks of 256 positions.

use cudarc::driver::{CudaSlice, LaunchConfig};

use super::buffers::{DevAct, DevVector, RopeTable};
use super::dense::shape;
use super::{DecodeKernels, dim, linear_cfg};
use crate::context::Gpu;
use crate::error::CudaError;
use crate::launch::Args;

/// Widest attention head (one thread per output column).
pub const MAX_SPARSE_HEAD_DIM: usize = 256;
/// Most index-query floats of one row (they sit in shared memory).
pub const MAX_INDEX_FLOATS: usize = 12 * 1024;
/// Positions a new cache holds before it first grows.
const FIRST_HELD: usize = 1024;

/// The shape of a sparse-attention cache and its indexer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SparseGeometry {
    /// Positions at most.
    pub capacity: usize,
    /// Query heads (a multiple of `kv_heads`).
    pub q_heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Attention head width.
    pub head_dim: usize,
    /// Indexer query heads.
    pub index_heads: usize,
    /// Indexer head width.
    pub index_dim: usize,
    /// Positions per block.
    pub ratio: usize,
    /// Complete blocks kept per query.
    pub keep: usize,
    /// Leading columns of an index key RoPE rotates.
    pub rope_dims: usize,
    /// The block keys' RMSNorm epsilon.
    pub eps: f32,
}

impl SparseGeometry {
    fn check(&self) -> Result<(), CudaError> {
        let s = self;
        let ok = s.kv_heads > 0
            && s.q_heads % s.kv_heads == 0
            && s.q_heads > 0
            && (1..=MAX_SPARSE_HEAD_DIM).contains(&s.head_dim)
            && s.index_dim > 0
            && s.index_heads > 0
            && s.index_heads * s.index_dim <= MAX_INDEX_FLOATS
            && s.ratio > 0
            && s.keep > 0
            && s.rope_dims % 2 == 0
            && s.rope_dims <= s.index_dim
            && s.capacity > 0
            && i32::try_from(s.capacity).is_ok();
        if !ok {
            return Err(shape(
                "sparse cache",
                format!(
                    "{} query heads over {} key heads of {} (at most {MAX_SPARSE_HEAD_DIM}), {} \
                     index heads of {} ({} rotated), blocks of {}, {} kept, {} positions",
                    s.q_heads,
                    s.kv_heads,
                    s.head_dim,
                    s.index_heads,
                    s.index_dim,
                    s.rope_dims,
                    s.ratio,
                    s.keep,
                    s.capacity
                ),
            ));
        }
        Ok(())
    }

    fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}

/// One sparse-attention layer's cache in HBM.
pub struct DevSparse {
    geo: SparseGeometry,
    gpu: Gpu,
    len: usize,
    /// Complete blocks whose keys are made.
    blocks: usize,
    /// Positions the buffers hold.
    held: usize,
    keys: CudaSlice<f32>,
    values: CudaSlice<f32>,
    index_keys: CudaSlice<f32>,
    block_keys: CudaSlice<f32>,
    /// The indexer's (score, block) entries, `rows x max_blocks` of 8 bytes.
    entries: CudaSlice<u64>,
    /// Each row's kept blocks, `rows x keep`, and how many.
    kept: CudaSlice<i32>,
    counts: CudaSlice<i32>,
}

impl std::fmt::Debug for DevSparse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DevSparse({} of {} positions)", self.len, self.held)
    }
}

fn alloc<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    gpu: &Gpu,
    n: usize,
    what: &str,
) -> Result<CudaSlice<T>, CudaError> {
    gpu.stream()
        .alloc_zeros::<T>(n.max(1))
        .map_err(CudaError::driver(format!(
            "allocate the sparse cache's {what}"
        )))
}

impl DevSparse {
    /// An empty cache of `geo`'s shape.
    pub fn new(gpu: &Gpu, geo: SparseGeometry) -> Result<Self, CudaError> {
        geo.check()?;
        let held = FIRST_HELD.min(geo.capacity);
        let (kvw, di) = (geo.kv_width(), geo.index_dim);
        Ok(Self {
            gpu: gpu.clone(),
            len: 0,
            blocks: 0,
            held,
            keys: alloc(gpu, held * kvw, "keys")?,
            values: alloc(gpu, held * kvw, "values")?,
            index_keys: alloc(gpu, held * di, "index keys")?,
            block_keys: alloc(gpu, (held / geo.ratio) * di, "block keys")?,
            entries: alloc(gpu, 1, "scores")?,
            kept: alloc(gpu, geo.keep, "kept blocks")?,
            counts: alloc(gpu, 1, "kept counts")?,
            geo,
        })
    }

    /// Positions held.
    #[must_use]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Is it empty?
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Positions it may hold.
    #[must_use]
    pub fn capacity(&self) -> usize {
        self.geo.capacity
    }

    /// The shape.
    #[must_use]
    pub fn geometry(&self) -> &SparseGeometry {
        &self.geo
    }

    /// Forget the sequence (the buffers stay).
    pub fn clear(&mut self) {
        self.len = 0;
        self.blocks = 0;
    }

    /// Room for `need` positions (doubling, up to the capacity); what is
    /// held is copied over, and the old buffers are freed once the launches
    /// queued now are issued.
    fn reserve(&mut self, need: usize) -> Result<(), CudaError> {
        if need <= self.held {
            return Ok(());
        }
        let held = need.max(self.held.saturating_mul(2)).min(self.geo.capacity);
        let (kvw, di, r) = (self.geo.kv_width(), self.geo.index_dim, self.geo.ratio);
        let (len, blocks) = (self.len, self.blocks);
        for (buf, used, n) in [
            (&mut self.keys, len * kvw, held * kvw),
            (&mut self.values, len * kvw, held * kvw),
            (&mut self.index_keys, len * di, held * di),
            (&mut self.block_keys, blocks * di, (held / r).max(1) * di),
        ] {
            let mut fresh = alloc::<f32>(&self.gpu, n, "growth")?;
            if used > 0 {
                // Recorded launches wait in a queue; the copy goes to the stream.
                self.gpu.flush()?;
                self.gpu
                    .stream()
                    .memcpy_dtod(&buf.slice(..used), &mut fresh.slice_mut(..used))
                    .map_err(CudaError::driver("grow the sparse cache"))?;
            }
            self.gpu.retire(std::mem::replace(buf, fresh));
        }
        self.held = held;
        Ok(())
    }

    /// Scratch for a step of `rows` rows with up to `max_blocks` blocks each.
    fn scratch(&mut self, rows: usize, max_blocks: usize) -> Result<(), CudaError> {
        let want = rows * max_blocks.max(1);
        if self.entries.len() < want {
            let fresh = alloc(&self.gpu, want.max(2 * self.entries.len()), "scores")?;
            self.gpu.retire(std::mem::replace(&mut self.entries, fresh));
        }
        if self.kept.len() < rows * self.geo.keep {
            let fresh = alloc(&self.gpu, rows * self.geo.keep, "kept blocks")?;
            self.gpu.retire(std::mem::replace(&mut self.kept, fresh));
            let fresh = alloc(&self.gpu, rows, "kept counts")?;
            self.gpu.retire(std::mem::replace(&mut self.counts, fresh));
        }
        Ok(())
    }
}

/// The step's operands of [`DecodeKernels::sparse_attend`].
#[derive(Clone, Copy, Debug)]
pub struct SparseStep<'a> {
    /// `rows x q_heads * head_dim`, normed and rotated.
    pub q: &'a DevAct,
    /// `rows x kv_heads * head_dim`, normed and rotated.
    pub k: &'a DevAct,
    /// `rows x kv_heads * head_dim`.
    pub v: &'a DevAct,
    /// `rows x index_heads * index_dim`, normed and rotated.
    pub iq: &'a DevAct,
    /// `rows x index_dim`, raw.
    pub ik: &'a DevAct,
    /// The block keys' RMSNorm weights (`index_dim`).
    pub k_norm: &'a DevVector,
    /// RoPE for the block keys.
    pub table: &'a RopeTable,
}

impl DecodeKernels {
    /// Append the step's keys, values and index keys at the next positions,
    /// make the keys of the blocks they complete, then attend each row over
    /// the positions its indexer keeps (see the module docs) into `out`
    /// (`rows x q_heads * head_dim`).
    pub fn sparse_attend(
        &self,
        cache: &mut DevSparse,
        st: SparseStep<'_>,
        out: &mut DevAct,
    ) -> Result<(), CudaError> {
        let s = cache.geo;
        let rows = st.q.rows();
        let (qw, kvw, di) = (s.q_heads * s.head_dim, s.kv_width(), s.index_dim);
        let first = cache.len;
        let fits = [st.q, &*out]
            .iter()
            .all(|a| (a.rows(), a.cols()) == (rows, qw))
            && [st.k, st.v]
                .iter()
                .all(|a| (a.rows(), a.cols()) == (rows, kvw))
            && (st.iq.rows(), st.iq.cols()) == (rows, s.index_heads * di)
            && (st.ik.rows(), st.ik.cols()) == (rows, di)
            && st.k_norm.len() == di
            && s.rope_dims / 2 <= st.table.half();
        if !fits {
            return Err(shape(
                "sparse_attend",
                format!(
                    "{rows}x{} queries, {}x{} keys, {}x{} index queries, {}x{} index keys for {} \
                     query and {} key heads of {}, {} index heads of {di}",
                    st.q.cols(),
                    st.k.rows(),
                    st.k.cols(),
                    st.iq.rows(),
                    st.iq.cols(),
                    st.ik.rows(),
                    st.ik.cols(),
                    s.q_heads,
                    s.kv_heads,
                    s.head_dim,
                    s.index_heads
                ),
            ));
        }
        let end = first + rows;
        if end > s.capacity || end > st.table.positions() {
            return Err(shape(
                "sparse_attend",
                format!(
                    "positions up to {end} in a cache of {} with a {}-position table",
                    s.capacity,
                    st.table.positions()
                ),
            ));
        }
        cache.reserve(end)?;
        self.sparse_append(cache, &st, first)?;
        let done = end / s.ratio;
        if done > cache.blocks {
            self.sparse_block_keys(cache, st.k_norm, st.table, done)?;
        }
        cache.len = end;
        cache.scratch(rows, done)?;
        self.sparse_select(cache, st.iq, first, rows, done)?;
        self.sparse_heads(cache, st.q, first, out)
    }

    fn sparse_append(
        &self,
        c: &DevSparse,
        st: &SparseStep<'_>,
        first: usize,
    ) -> Result<(), CudaError> {
        let (kvw, di) = (c.geo.kv_width(), c.geo.index_dim);
        let rows = st.q.rows();
        let (n_kv, n_ik) = ((rows * kvw) as i64, (rows * di) as i64);
        let g = &self.gpu;
        let mut a = Args::new();
        a.buf(g, &c.keys)
            .buf(g, &c.values)
            .buf(g, &c.index_keys)
            .buf(g, st.k.buf())
            .buf(g, st.v.buf())
            .buf(g, st.ik.buf())
            .push(first as i64)
            .push(kvw as i32)
            .push(di as i32)
            .push(n_kv)
            .push(n_ik);
        // SAFETY: matches `sparse_append`; writes positions first..first +
        // rows of the cache's buffers (reserved for them) from the step's
        // k, v (n_kv elements) and ik (n_ik), shapes checked by the caller.
        unsafe {
            self.launch(
                "sparse_append",
                linear_cfg(n_kv.max(n_ik) as usize, 256)?,
                a,
            )
        }
    }

    fn sparse_block_keys(
        &self,
        c: &mut DevSparse,
        k_norm: &DevVector,
        table: &RopeTable,
        done: usize,
    ) -> Result<(), CudaError> {
        let s = c.geo;
        let cfg = LaunchConfig {
            grid_dim: (dim(done - c.blocks, "x")?, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: (s.index_dim * 4) as u32,
        };
        let (cos, sin) = table.tables();
        let g = &self.gpu;
        let mut a = Args::new();
        a.buf(g, &c.index_keys)
            .buf(g, k_norm.data())
            .buf(g, cos)
            .buf(g, sin)
            .push(table.half() as i32)
            .push(s.ratio as i32)
            .push(s.index_dim as i32)
            .push(s.rope_dims as i32)
            .push(s.eps)
            .push(c.blocks as i32)
            .buf(g, &c.block_keys);
        // SAFETY: matches `sparse_block_keys`; block b reads the index keys
        // of positions (blocks + b) * ratio.. (appended, below `len + rows`),
        // the table row of its first position (checked) and writes its key.
        unsafe { self.launch("sparse_block_keys", cfg, a) }?;
        c.blocks = done;
        Ok(())
    }

    fn sparse_select(
        &self,
        c: &DevSparse,
        iq: &DevAct,
        first: usize,
        rows: usize,
        max_blocks: usize,
    ) -> Result<(), CudaError> {
        let s = c.geo;
        let cfg = LaunchConfig {
            grid_dim: (dim(rows, "x")?, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: (s.index_heads * s.index_dim * 4) as u32,
        };
        let g = &self.gpu;
        let mut a = Args::new();
        a.buf(g, iq.buf())
            .buf(g, &c.block_keys)
            .push(first as i64)
            .push(s.ratio as i32)
            .push(s.index_dim as i32)
            .push(s.index_heads as i32)
            .push(s.keep as i32)
            .push(max_blocks.max(1) as i32)
            .buf(g, &c.entries)
            .buf(g, &c.kept)
            .buf(g, &c.counts);
        // SAFETY: matches `sparse_select`; row r reads its index queries and
        // the keys of blocks below (first + r + 1) / ratio <= max_blocks
        // (made), and writes its max_blocks entries, keep kept ids and count
        // (scratch sized for rows rows).
        unsafe { self.launch("sparse_select", cfg, a) }
    }

    fn sparse_heads(
        &self,
        c: &DevSparse,
        q: &DevAct,
        first: usize,
        out: &mut DevAct,
    ) -> Result<(), CudaError> {
        let s = c.geo;
        let cfg = LaunchConfig {
            grid_dim: (dim(s.q_heads, "x")?, dim(q.rows(), "y")?, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: ((s.head_dim + 256) * 4) as u32,
        };
        let g = &self.gpu;
        let mut a = Args::new();
        a.buf(g, q.buf())
            .buf(g, &c.keys)
            .buf(g, &c.values)
            .buf(g, &c.kept)
            .buf(g, &c.counts)
            .push(first as i64)
            .push(s.ratio as i32)
            .push(s.keep as i32)
            .push(s.q_heads as i32)
            .push(s.kv_heads as i32)
            .push(s.head_dim as i32)
            .buf(g, out.buf());
        // SAFETY: matches `sparse_attend`; block (h, r) reads row r's query
        // head h, kept ids and count (written by sparse_select), the keys
        // and values of positions up to first + r (appended), and writes
        // head h of row r of out.
        unsafe { self.launch("sparse_attend", cfg, a) }
    }
}

#[cfg(test)]
mod tests {
    use super::SparseGeometry;

    fn geo() -> SparseGeometry {
        SparseGeometry {
            capacity: 4096,
            q_heads: 8,
            kv_heads: 2,
            head_dim: 64,
            index_heads: 4,
            index_dim: 32,
            ratio: 16,
            keep: 4,
            rope_dims: 16,
            eps: 1e-6,
        }
    }

    #[test]
    fn shapes_the_kernels_cannot_take_are_refused() {
        assert!(geo().check().is_ok());
        let bad = [
            SparseGeometry {
                head_dim: 512,
                ..geo()
            },
            SparseGeometry {
                q_heads: 7,
                ..geo()
            },
            SparseGeometry { keep: 0, ..geo() },
            SparseGeometry { ratio: 0, ..geo() },
            SparseGeometry {
                rope_dims: 48,
                ..geo()
            },
            SparseGeometry {
                index_heads: 1024,
                ..geo()
            },
        ];
        for g in bad {
            let e = g.check().unwrap_err().to_string();
            assert!(e.contains("sparse cache"), "{e}");
        }
    }
}
