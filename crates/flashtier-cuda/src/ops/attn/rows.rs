//! Decode attention of one row for each of several sequences, every
//! sequence with its own [`DevKvCache`], in one launch per kernel instead
//! of one per sequence.
//!
//! A continuous batch of S decoding sequences ran each layer's RoPE, KV
//! append, partials and merge S times, each launch a few blocks of work:
//! at 8 sequences the attention was most of the gap between an 8-row step
//! and the bytes it reads. Here the step's rows are described by one table
//! per layer, built once a step ([`DecodeRows`]): for row r its cache's
//! arena, the positions it holds, its resident slots and its split count.
//! The kernels (`kv_append_rows`, `attn_rows_partial`, `attn_rows_merge`,
//! and `qk_norm_rope` reading positions from the table) run each row's
//! arithmetic exactly as `kv_append`, `attn_partial` and `attn_merge` run
//! it for that sequence alone (the same device functions), so a row's
//! output has the same bits either way.
//!
//! Only caches whose every chunk stays resident take this path
//! ([`DevKvCache::takes_rows`]); a sequence under a KV budget attends
//! alone, through the restore ring.
//!
//! Bounds: the table holds `layers x rows` entries of four i64; the
//! partials `rows x q_heads x max_splits x (dim + 2)` f32, grown as
//! needed and reused.

use cudarc::driver::{CudaSlice, LaunchConfig};

use super::window::ChunkWindow;
use super::{CHUNK_POSITIONS, DevKvCache, group_floats};
use crate::error::CudaError;
use crate::launch::Args;
use crate::ops::buffers::{DevAct, DevVector, RopeTable};
use crate::ops::norm::Positions;
use crate::ops::{DecodeKernels, addr, dim, linear_cfg};

/// i64 values per row of a table: arena address, positions held, resident
/// slots, splits.
const ENTRY: usize = 4;

/// The step's description of its decode rows, reused across steps.
///
/// The table is rebuilt whenever an entry would not describe its row as
/// the row's cache is now (arena address, positions held, resident slots,
/// room for one more position): a new step, another cache in a row, a
/// cache dropped and another made where it was. Nothing is keyed by a
/// cache's identity.
#[derive(Default)]
pub struct DecodeRows {
    rows: usize,
    layers: usize,
    max_splits: usize,
    host: Vec<i64>,
    table: Option<CudaSlice<i64>>,
    part: Option<CudaSlice<f32>>,
}

impl std::fmt::Debug for DecodeRows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeRows")
            .field("rows", &self.rows)
            .field("layers", &self.layers)
            .field("max_splits", &self.max_splits)
            .finish()
    }
}

/// Where one layer's rows sit, for [`DecodeKernels::qk_norm_rope_rows`]:
/// the table's device address and one past the largest position in it.
#[derive(Clone, Copy, Debug)]
pub struct RowsAt {
    pub(crate) table: u64,
    pub(crate) end: usize,
}

impl DevKvCache {
    /// Can this cache's next position at `layer` be attended in a
    /// [`DecodeRows`] step: every chunk resident after it, nothing
    /// offloaded, room in the capacity?
    #[must_use]
    pub fn takes_rows(&self, layer: usize) -> bool {
        let (Some(&held), Some(&done)) = (self.layer_len.get(layer), self.offloaded.get(layer))
        else {
            return false;
        };
        held < self.capacity && done == 0 && self.window.first_resident(held + 1) == 0
    }
}

impl DecodeRows {
    /// An empty description (built at the first step).
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    fn entry(&self, layer: usize, row: usize) -> usize {
        (layer * self.rows + row) * ENTRY
    }

    /// Does the table's entry for (`layer`, `row`) describe `c` as it is,
    /// with room for its next position?
    fn describes(
        &self,
        gpu: &crate::context::Gpu,
        layer: usize,
        row: usize,
        c: &DevKvCache,
    ) -> bool {
        let at = self.entry(layer, row);
        let (Some(e), Ok(held)) = (self.host.get(at..at + ENTRY), c.layer_len(layer)) else {
            return false;
        };
        let room = ChunkWindow::chunks(held + 1).min(c.window.slots()) <= c.allocated;
        room && e[0] == addr(gpu, &c.arenas[layer], 0) as i64
            && e[1] == held as i64
            && e[2] == c.window.slots() as i64
    }
}

impl DecodeKernels {
    /// Describe the step's rows at `layer`: row r is the next position of
    /// `caches[r]`. The first layer of a step grows every cache by one
    /// position and uploads the table of every layer; later layers of the
    /// same step reuse it.
    pub fn rows_at(
        &self,
        t: &mut DecodeRows,
        caches: &mut [&mut DevKvCache],
        layer: usize,
    ) -> Result<RowsAt, CudaError> {
        let first = caches
            .first()
            .ok_or_else(|| CudaError::invalid("decode rows", "no sequences".to_string()))?;
        let (layers, kv_heads, dim_) = (first.layers(), first.kv_heads, first.dim);
        for c in caches.iter() {
            if c.layers() != layers
                || c.kv_heads != kv_heads
                || c.dim != dim_
                || !c.takes_rows(layer)
            {
                return Err(CudaError::invalid(
                    "decode rows",
                    format!(
                        "a cache of {} layers, {} kv heads of {} ({} positions at layer {layer}) in a step of {layers} x {kv_heads} x {dim_}",
                        c.layers(),
                        c.kv_heads,
                        c.dim,
                        c.layer_len(layer)?
                    ),
                ));
            }
        }
        let rows = caches.len();
        let current = t.rows == rows
            && t.layers == layers
            && caches
                .iter()
                .enumerate()
                .all(|(r, c)| t.describes(&self.gpu, layer, r, c));
        if !current {
            for c in caches.iter_mut() {
                let held = c.layer_len(layer)?;
                c.grow(held + 1)?;
            }
            t.rows = rows;
            t.layers = layers;
            t.max_splits = 1;
            t.host.clear();
            t.host.resize(layers * rows * ENTRY, 0);
            for l in 0..layers {
                for (r, c) in caches.iter().enumerate() {
                    let held = c.layer_len(l)?;
                    let splits = ChunkWindow::chunks(held + 1);
                    t.max_splits = t.max_splits.max(splits);
                    let at = t.entry(l, r);
                    t.host[at] = addr(&self.gpu, &c.arenas[l], 0) as i64;
                    t.host[at + 1] = held as i64;
                    t.host[at + 2] = c.window.slots() as i64;
                    t.host[at + 3] = splits as i64;
                }
            }
            let stream = self.gpu.stream();
            if t.table.as_ref().is_none_or(|d| d.len() < t.host.len()) {
                // Queued launches may read the table about to be replaced.
                self.gpu.flush()?;
                t.table = Some(
                    stream
                        .alloc_zeros::<i64>(t.host.len().next_power_of_two())
                        .map_err(CudaError::driver("allocate the decode-rows table"))?,
                );
            }
            let dst = t
                .table
                .as_mut()
                .ok_or_else(|| CudaError::invalid("decode rows", "no table".to_string()))?;
            let n = t.host.len();
            stream
                .memcpy_htod(&t.host, &mut dst.slice_mut(..n))
                .map_err(CudaError::driver("upload the decode-rows table"))?;
        }
        let table = t
            .table
            .as_ref()
            .ok_or_else(|| CudaError::invalid("decode rows", "no table".to_string()))?;
        let end = caches
            .iter()
            .map(|c| c.layer_len(layer).map(|h| h + 1))
            .try_fold(0, |m, h| h.map(|h| m.max(h)))?;
        Ok(RowsAt {
            table: addr(&self.gpu, table, t.entry(layer, 0)),
            end,
        })
    }

    /// [`Self::qk_norm_rope`] of the step's rows, each at its own
    /// sequence's position (`at` from [`Self::rows_at`] for this layer).
    #[allow(clippy::too_many_arguments, reason = "the kernel's arguments")]
    pub fn qk_norm_rope_at_rows(
        &self,
        q: &mut DevAct,
        k: &mut DevAct,
        norms: Option<[&DevVector; 2]>,
        eps: f32,
        table: &RopeTable,
        head_dim: usize,
        at: RowsAt,
    ) -> Result<(), CudaError> {
        let rows = Positions::Table(at.table, at.end);
        self.qk_norm_rope_at(q, k, norms, eps, table, (head_dim, false), 0, rows)
    }

    /// Append row r's keys and values to `caches[r]` at `layer` and attend
    /// its queries over that sequence's positions, for every row in one
    /// launch per kernel (`at` from [`Self::rows_at`] for this layer and
    /// these caches): what [`Self::attend`] gives each sequence alone.
    #[allow(clippy::too_many_arguments, reason = "the attention step's operands")]
    pub fn attend_rows(
        &self,
        t: &mut DecodeRows,
        caches: &mut [&mut DevKvCache],
        layer: usize,
        at: RowsAt,
        (q_heads, scale): (usize, f32),
        (q, k, v): (&DevAct, &DevAct, &DevAct),
        out: &mut DevAct,
    ) -> Result<(), CudaError> {
        let rows = caches.len();
        let Some(first) = caches.first() else {
            return Err(CudaError::invalid(
                "decode rows",
                "no sequences".to_string(),
            ));
        };
        let (kvh, d) = (first.kv_heads, first.dim);
        let fits = t.rows == rows
            && q.rows() == rows
            && k.rows() == rows
            && v.rows() == rows
            && out.rows() == rows
            && q_heads % kvh == 0
            && q.cols() == q_heads * d
            && out.cols() == q.cols()
            && k.cols() == kvh * d
            && v.cols() == kvh * d
            && caches
                .iter()
                .enumerate()
                .all(|(r, c)| t.describes(&self.gpu, layer, r, c))
            && at.table
                == t.table
                    .as_ref()
                    .map_or(0, |d| addr(&self.gpu, d, t.entry(layer, 0)));
        if !fits {
            return Err(CudaError::invalid(
                "decode rows",
                format!(
                    "{rows} caches for q {}x{}, k {}x{}, v {}x{} ({q_heads} heads over {kvh} kv heads of {d}); a table of {} rows not made for them at layer {layer}",
                    q.rows(),
                    q.cols(),
                    k.rows(),
                    k.cols(),
                    v.rows(),
                    v.cols(),
                    t.rows
                ),
            ));
        }
        let g = &self.gpu;
        let gs = group_floats(d) as i32;
        let n = (rows * kvh * d) as i64;
        let mut a = Args::new();
        a.buf(g, k.buf())
            .buf(g, v.buf())
            .push(at.table)
            .push(kvh as i32)
            .push(d as i32)
            .push(gs)
            .push(CHUNK_POSITIONS as i32)
            .push(n);
        // SAFETY: matches `kv_append_rows`; row r writes position held_r of
        // its cache's layer arena, which rows_at grew to hold it (slot
        // (held_r / CHUNK) % slots < allocated; every chunk resident, none
        // offloaded: takes_rows).
        unsafe { self.launch("kv_append_rows", linear_cfg(n as usize, 256)?, a) }?;
        let max_splits = t.max_splits;
        let part_len = rows * q_heads * max_splits * (d + 2);
        if max_splits > 1 && t.part.as_ref().is_none_or(|p| p.len() < part_len) {
            // Queued launches may use the partials about to be replaced.
            g.flush()?;
            t.part = Some(
                g.stream()
                    .alloc_zeros::<f32>(part_len.next_power_of_two())
                    .map_err(CudaError::driver("allocate attention partials"))?,
            );
        }
        let part = match (&t.part, max_splits) {
            (Some(p), 2..) => addr(g, p, 0),
            _ => 0u64,
        };
        let cfg = LaunchConfig {
            grid_dim: (dim(q_heads, "x")?, dim(rows, "y")?, dim(max_splits, "z")?),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut a = Args::new();
        a.buf(g, q.buf())
            .push(q.cols() as i32)
            .push(at.table)
            .push(kvh as i32)
            .push(d as i32)
            .push((q_heads / kvh) as i32)
            .push(scale)
            .push(CHUNK_POSITIONS as i32)
            .push(part)
            .buf(g, out.buf())
            .push(gs)
            .push(max_splits as i32);
        // SAFETY: matches `attn_rows_partial`; row r's block s < splits_r
        // reads chunk s of its arena (positions below held_r + 1, written
        // by the append above) and writes its partial (sized above for
        // max_splits) or, with one split, out's row r (rows x q_heads * dim).
        unsafe { self.launch("attn_rows_partial", cfg, a) }?;
        if max_splits > 1 {
            let cfg = LaunchConfig {
                grid_dim: (dim(q_heads, "x")?, dim(rows, "y")?, 1),
                block_dim: (d.next_power_of_two().clamp(32, 256) as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut a = Args::new();
            a.push(part)
                .push(at.table)
                .push(d as i32)
                .push(max_splits as i32)
                .buf(g, out.buf())
                .push(out.cols() as i32);
            // SAFETY: matches `attn_rows_merge`; reads the partials of each
            // row of more than one split (written above), writes its
            // q_heads x dim outputs.
            unsafe { self.launch("attn_rows_merge", cfg, a) }?;
        }
        for c in caches.iter_mut() {
            let held = c.layer_len(layer)?;
            c.layer_len[layer] = held + 1;
        }
        Ok(())
    }
}
