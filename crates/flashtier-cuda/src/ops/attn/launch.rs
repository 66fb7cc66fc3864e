//! The attention launches over a [`DevKvCache`]: the KV append, the
//! partials of the resident chunks and of restored tiles, and the merge
//! (see the [`super`] docs for why splitting them changes no bit).
//!
//! A split's partials come from one of three kernels: `attn_partial`, a
//! block per (row, head, split), for decode rows and short chunks; and for
//! prompt chunks of [`PROMPT_ATTN_ROWS`] rows or more, tiles of queries
//! over keys and values staged once in shared memory, either
//! `attn_prompt_tc_<D>` on the tensor cores (TF32 operands split three
//! ways, `FLASHTIER_PROMPT_ATTN_TC=1`) or `attn_prompt_<D>` in f32 (the
//! default; [`super::prompt`] says
//! which). They sum in different orders (and the tensor-core kernel's
//! products carry a few parts in 2^22 of each term), so a prompt row's
//! output is within f32 rounding of, not bit for bit, what the decode
//! kernel gives it; in every kernel a row's bits depend on its own query
//! and positions only.

use cudarc::driver::LaunchConfig;

use super::ring::RingTile;
use super::window::ChunkWindow;
use super::{CHUNK_POSITIONS, DevKvCache, group_floats};
use crate::error::CudaError;
use crate::launch::Args;
use crate::ops::buffers::DevAct;
use crate::ops::{DecodeKernels, addr, dim, linear_cfg};

/// Fewest rows of a prompt chunk attended as tiles (`attn_prompt_<D>`):
/// below, a tile of [`PROMPT_ATTN_QUERIES`] queries would be mostly
/// empty, and the per-row blocks of the decode attention are as fast.
pub const PROMPT_ATTN_ROWS: usize = 16;
/// Queries (rows x the heads sharing a kv head) per tile of the prompt
/// attention (`PA_BM` in kernels/decode/prompt_attn.cu).
pub const PROMPT_ATTN_QUERIES: usize = 64;

/// The tiled prompt attention's kernels and the widest head each takes.
pub(crate) const PROMPT_ATTN_KERNELS: [(&str, usize); 3] = [
    ("attn_prompt_64", 64),
    ("attn_prompt_128", 128),
    ("attn_prompt_256", 256),
];

/// Dynamic shared memory of `attn_prompt_<tile>`: the queries and one
/// tile of keys or values (`PA_BM` and `PA_BN` rows of `tile + 4` f32) and
/// the probability tile (`PA_BM` x `PA_BN + 4`).
#[must_use]
pub(crate) const fn prompt_attn_smem(tile: usize) -> usize {
    (2 * PROMPT_ATTN_QUERIES * (tile + 4) + PROMPT_ATTN_QUERIES * (64 + 4)) * 4
}

/// What one layer's attention over its positions is made of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnSplits {
    /// Splits (chunks) attended.
    pub splits: usize,
    /// The first resident split; splits below come from the store.
    pub first_resident: usize,
}

impl DecodeKernels {
    /// Append each row's keys and values to `layer` (positions `held..held
    /// + rows`), then attend row r's queries over positions `0..=held + r`
    /// with softmax scale `scale`: `q`, `out` are `rows x q_heads * dim`,
    /// `k`, `v` are `rows x kv_heads * dim`. Every chunk must be resident.
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
        self.kv_push(kv, layer, k, v)?;
        let s = self.attend_resident(kv, layer, q_heads, q, scale, out)?;
        if s.first_resident > 0 {
            return Err(CudaError::invalid(
                "attention",
                format!(
                    "chunks 0..{} of layer {layer} are in the store",
                    s.first_resident
                ),
            ));
        }
        self.attend_merge(kv, q_heads, q.rows(), s, out)
    }

    /// Append each row's keys and values to `layer` at its next positions
    /// (no slot of a chunk not yet offloaded is overwritten).
    pub fn kv_push(
        &self,
        kv: &mut DevKvCache,
        layer: usize,
        k: &DevAct,
        v: &DevAct,
    ) -> Result<(), CudaError> {
        let (rows, d, kvh) = (k.rows(), kv.dim, kv.kv_heads);
        let held = kv.layer_len(layer)?;
        if k.cols() != kvh * d || v.cols() != kvh * d || v.rows() != rows || rows == 0 {
            return Err(CudaError::invalid(
                "kv append",
                format!(
                    "k {}x{}, v {}x{} for {kvh} kv heads of {d}",
                    k.rows(),
                    k.cols(),
                    v.rows(),
                    v.cols()
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
        kv.window
            .check_append(held, rows, kv.offloaded(layer)?)
            .map_err(|e| CudaError::invalid("kv append", format!("layer {layer}: {e}")))?;
        kv.grow(held + rows)?;
        let n = (rows * kvh * d) as i64;
        let arena = addr(&self.gpu, &kv.arenas[layer], 0);
        let g = &self.gpu;
        let mut a = Args::new();
        a.buf(g, k.buf())
            .buf(g, v.buf())
            .push(arena)
            .push(kvh as i32)
            .push(d as i32)
            .push(group_floats(d) as i32)
            .push(kv.window.slots() as i32)
            .push(held as i32)
            .push(CHUNK_POSITIONS as i32)
            .push(n);
        // SAFETY: matches `kv_append`; writes positions held..held + rows,
        // each into slot (p / CHUNK) % slots of the layer's arena, which
        // holds min(slots, chunks) >= that many slots (grown above), at
        // offsets below one chunk; no chunk still needed is in those slots
        // (check_append).
        unsafe { self.launch("kv_append", linear_cfg(n as usize, 256)?, a) }?;
        kv.layer_len[layer] = held + rows;
        Ok(())
    }

    fn attn_shape_ok(kv: &DevKvCache, q_heads: usize, q: &DevAct, out: &DevAct) -> bool {
        q_heads % kv.kv_heads == 0
            && q.cols() == q_heads * kv.dim
            && out.rows() == q.rows()
            && out.cols() == q.cols()
    }

    /// Launch the partials of `layer`'s resident chunks for the rows of
    /// `q` (the last rows pushed), sizing the partials for every split;
    /// with one split, writes `out` directly.
    pub fn attend_resident(
        &self,
        kv: &mut DevKvCache,
        layer: usize,
        q_heads: usize,
        q: &DevAct,
        scale: f32,
        out: &mut DevAct,
    ) -> Result<AttnSplits, CudaError> {
        let (rows, d) = (q.rows(), kv.dim);
        let len = kv.layer_len(layer)?;
        if !Self::attn_shape_ok(kv, q_heads, q, out) || rows > len {
            return Err(CudaError::invalid(
                "attention",
                format!(
                    "q {}x{}, {q_heads} heads over {} kv heads of {d}, {len} positions",
                    q.rows(),
                    q.cols(),
                    kv.kv_heads
                ),
            ));
        }
        let splits = ChunkWindow::chunks(len);
        let first_resident = kv.window.first_resident(len);
        let part_len = rows * q_heads * splits * (d + 2);
        let part_addr = addr(&self.gpu, kv.part(part_len)?, 0);
        let direct = if splits == 1 {
            addr(&self.gpu, out.buf(), 0)
        } else {
            0u64
        };
        let arena = addr(&self.gpu, &kv.arenas[layer], 0);
        let span = (
            first_resident,
            splits - first_resident,
            0,
            kv.window.slots(),
        );
        // SAFETY (of the launch inside): chunks first_resident..splits are
        // resident in the layer's arena, at slot c % slots < allocated.
        self.launch_partials(
            kv,
            layer,
            q_heads,
            q,
            scale,
            (arena, span),
            (part_addr, direct),
        )?;
        Ok(AttnSplits {
            splits,
            first_resident,
        })
    }

    /// Launch the partials of the restored chunks in ring slot `tile` (of
    /// `layer`, after [`Self::attend_resident`] for the same rows).
    pub fn attend_tile(
        &self,
        kv: &mut DevKvCache,
        layer: usize,
        q_heads: usize,
        q: &DevAct,
        scale: f32,
        tile: &RingTile,
    ) -> Result<(), CudaError> {
        let (rows, d) = (q.rows(), kv.dim);
        let len = kv.layer_len(layer)?;
        let splits = ChunkWindow::chunks(len);
        let part_len = rows * q_heads * splits * (d + 2);
        let fits = q_heads % kv.kv_heads == 0
            && q.cols() == q_heads * d
            && rows <= len
            && tile.layer() == layer
            && tile.chunk_floats() == kv.chunk_floats()
            && tile.first_chunk() + tile.chunks() <= kv.window.first_resident(len)
            && kv.part.as_ref().is_some_and(|p| p.len() >= part_len);
        if !fits || splits < 2 {
            return Err(CudaError::invalid(
                "attention tile",
                format!(
                    "chunks {}..+{} of layer {layer} ({len} positions) for q {}x{}",
                    tile.first_chunk(),
                    tile.chunks(),
                    q.rows(),
                    q.cols()
                ),
            ));
        }
        let part_addr = addr(&self.gpu, kv.part(part_len)?, 0);
        let span = (
            tile.first_chunk(),
            tile.chunks(),
            tile.first_chunk(),
            tile.chunks(),
        );
        // SAFETY (of the launch inside): the ring slot holds the tile's
        // chunks, chunk c at (c - first) of `chunks` slots.
        self.launch_partials(
            kv,
            layer,
            q_heads,
            q,
            scale,
            (tile.address(), span),
            (part_addr, 0),
        )
    }

    /// Launch the partials (`attn_partial`, or a tiled prompt kernel
    /// where [`Self::prompt_attention_kernel`] names one) over `count` splits
    /// from `s_first`, chunk c at slot `(c - c_base) % slots` of the arena
    /// at `arena`.
    #[allow(clippy::too_many_arguments, reason = "the attention step's operands")]
    fn launch_partials(
        &self,
        kv: &DevKvCache,
        layer: usize,
        q_heads: usize,
        q: &DevAct,
        scale: f32,
        (arena, (s_first, count, c_base, slots)): (u64, (usize, usize, usize, usize)),
        (part, direct): (u64, u64),
    ) -> Result<(), CudaError> {
        if count == 0 {
            return Ok(());
        }
        let rows = q.rows();
        let len = kv.layer_len(layer)?;
        let held = len - rows;
        let total = ChunkWindow::chunks(len);
        let group = q_heads / kv.kv_heads;
        // The arguments both kernels take; the tiled one also takes the rows.
        let mut a = Args::new();
        a.buf(&self.gpu, q.buf())
            .push(q.cols() as i32)
            .push(arena)
            .push(kv.kv_heads as i32)
            .push(kv.dim as i32)
            .push(group as i32)
            .push(held as i32)
            .push(scale)
            .push(CHUNK_POSITIONS as i32)
            .push(part)
            .push(direct)
            .push(group_floats(kv.dim) as i32)
            .push(s_first as i32)
            .push(c_base as i32)
            .push(slots as i32)
            .push(total as i32);
        if let Some(p) = self.prompt_attn_launch(rows, kv.dim, group, held) {
            let cfg = LaunchConfig {
                grid_dim: (
                    dim(p.blocks, "x")?,
                    dim(kv.kv_heads, "y")?,
                    dim(count, "z")?,
                ),
                block_dim: (256, 1, 1),
                shared_mem_bytes: p.smem_bytes as u32,
            };
            a.push(rows as i32);
            // SAFETY: matches `attn_prompt_<D>` and `attn_prompt_tc_<D>`
            // (the same arguments; D >= dim, dim a multiple of 4, the
            // kernel's dynamic shared memory `smem_bytes`: the limit set for
            // it when the module loaded, or it would not have been chosen;
            // the grid's x the kernel's tiles of queries for these rows,
            // group and held): every float4 or float2 it loads lies inside a
            // head, q's rows are q_heads * dim floats, the arena's groups
            // 4096-byte aligned; block (x, kvh, s) reads split s's chunk at
            // the arena slot the caller vouched for (positions below held +
            // rows, all written) and the queries of its rows, and writes
            // their partials (rows x q_heads x total x (dim + 2), sized by
            // attend_resident) or, with one split, their rows of out (rows x
            // q_heads * dim).
            return unsafe { self.launch(p.name, cfg, a) };
        }
        let cfg = LaunchConfig {
            grid_dim: (dim(q_heads, "x")?, dim(rows, "y")?, dim(count, "z")?),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches `attn_partial`; each block reads split s's chunk
        // at the arena slot its caller vouched for (positions below held +
        // r + 1, all written), q (rows x q_heads * dim), and writes its
        // partial (rows x q_heads x total x (dim + 2), sized by
        // attend_resident) or, with one split, out (rows x q_heads * dim).
        unsafe { self.launch("attn_partial", cfg, a) }
    }

    /// Merge the partials of every split into `out` (nothing to do with one
    /// split: the partial wrote `out`).
    pub fn attend_merge(
        &self,
        kv: &DevKvCache,
        q_heads: usize,
        rows: usize,
        s: AttnSplits,
        out: &mut DevAct,
    ) -> Result<(), CudaError> {
        if s.splits <= 1 {
            return Ok(());
        }
        let d = kv.dim;
        let need = rows * q_heads * s.splits * (d + 2);
        let part = kv
            .part
            .as_ref()
            .filter(|p| p.len() >= need && out.rows() == rows && out.cols() == q_heads * d)
            .ok_or_else(|| {
                CudaError::invalid("attention merge", format!("{rows} rows x {q_heads} heads"))
            })?;
        let cfg = LaunchConfig {
            grid_dim: (dim(q_heads, "x")?, dim(rows, "y")?, 1),
            block_dim: (d.next_power_of_two().clamp(32, 256) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let (di, si, oc) = (d as i32, s.splits as i32, out.cols() as i32);
        let part_addr = addr(&self.gpu, part, 0);
        let mut a = Args::new();
        a.push(part_addr)
            .push(di)
            .push(si)
            .buf(&self.gpu, out.buf())
            .push(oc);
        // SAFETY: matches `attn_merge`; reads the partials of every split
        // (sized above), writes q_heads x dim of each of out's rows.
        unsafe { self.launch("attn_merge", cfg, a) }
    }
}
