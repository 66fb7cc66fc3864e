//! Matrix-vector products, embeddings and the elementwise kernels, with
//! their shape checks (norms and RoPE: [`super::norm`]).

use cudarc::driver::LaunchConfig;

use super::buffers::{DevAct, DevMatrix, DevVector, WeightType};
use super::{DecodeKernels, MAX_GEMV_ROWS, addr, dim, linear_cfg};
use crate::context::Gpu;
use crate::error::CudaError;
use crate::launch::{Args, KernelArg};

/// Up to four matrices of one launch (the C layout of `struct Mats`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Mats {
    w: [u64; 4],
    scales: [u64; 4],
    out: [u64; 4],
    start: [i32; 5],
    sc_cols: [i32; 4],
    _pad: i32,
    out_stride: [i64; 4],
}

// SAFETY: plain-old-data with the C layout of `struct Mats` in kernels/decode/:
// twelve 8-byte pointers, nine 4-byte ints and the explicit `_pad` (so no
// implicit padding), four 8-byte strides.
unsafe impl KernelArg for Mats {}

/// Bytes of a row one warp reads at most (one or two rounds of its four
/// loads in flight per lane): wider rows are split between warps.
const WARP_ROW_BYTES: usize = 4096;

/// Warps sharing one output row: enough warps in flight to keep HBM busy
/// for short matrices (at least about 2048 warps), and no warp reading more
/// than [`WARP_ROW_BYTES`] of a row; one warp per row for tall, narrow ones.
fn warps_per_row(rows: usize, row_bytes: usize) -> usize {
    let mut wpr = match rows {
        0..512 => 8,
        512..1024 => 4,
        1024..2048 => 2,
        _ => 1,
    };
    while wpr < 8 && row_bytes > wpr * WARP_ROW_BYTES {
        wpr *= 2;
    }
    wpr
}

pub(super) fn shape(what: &'static str, why: String) -> CudaError {
    CudaError::invalid(what, why)
}

pub(super) fn same(what: &'static str, a: &DevAct, b: &DevAct) -> Result<(), CudaError> {
    if a.rows() != b.rows() || a.cols() != b.cols() {
        return Err(shape(
            what,
            format!(
                "{}x{} against {}x{}",
                a.rows(),
                a.cols(),
                b.rows(),
                b.cols()
            ),
        ));
    }
    Ok(())
}

/// Up to four matrices of one dtype and width, each with an output of
/// its rows for every row of `x`.
pub(super) fn check_many(
    outs: &[&mut DevAct],
    ws: &[&DevMatrix],
    x: &DevAct,
) -> Result<(), CudaError> {
    let n = ws.len();
    let Some(first) = ws.first() else {
        return Ok(());
    };
    let (ty, k) = (first.ty(), first.cols());
    let fits = |i: usize| {
        let (w, o) = (ws[i], &outs[i]);
        w.ty() == ty && w.cols() == k && o.cols() == w.rows() && o.rows() == x.rows()
    };
    if n > 4 || outs.len() != n || x.cols() != k || !(0..n).all(fits) {
        return Err(shape(
            "gemv",
            format!(
                "{n} matrices of width {k} over a {}x{} input",
                x.rows(),
                x.cols()
            ),
        ));
    }
    Ok(())
}

/// The matrices of one launch: their weights, scales and output rows
/// from input row `start` on (shapes checked by [`check_many`]).
pub(super) fn mats(gpu: &Gpu, outs: &[&mut DevAct], ws: &[&DevMatrix], start: usize) -> Mats {
    let mut mm = Mats::default();
    let mut at = 0usize;
    for (q, (w, o)) in ws.iter().zip(outs.iter()).enumerate() {
        mm.start[q] = at as i32;
        mm.w[q] = addr(gpu, w.data(), 0);
        mm.scales[q] = addr(gpu, w.scales(), 0);
        mm.sc_cols[q] = scale_args(w).0;
        mm.out[q] = addr(gpu, o.buf(), start * w.rows());
        mm.out_stride[q] = w.rows() as i64;
        at += w.rows();
    }
    // Matrices past the last are empty ranges at its end.
    for q in ws.len()..5 {
        mm.start[q] = at as i32;
    }
    mm
}

/// FP8 scale-grid arguments of a matrix (`sc_cols`, block rows, block cols).
pub(super) fn scale_args(w: &DevMatrix) -> (i32, i32, i32) {
    match w.ty() {
        WeightType::Fp8 { block: [br, bc] } => {
            let [_, sc] = w.ty().scale_grid(w.rows(), w.cols());
            (sc as i32, br as i32, bc as i32)
        }
        _ => (0, 1, 1),
    }
}

impl DecodeKernels {
    /// `out[r] = W x[r]` for every row of `x` (passes of up to
    /// [`MAX_GEMV_ROWS`] rows, each reading the weights once).
    pub fn gemv(&self, out: &mut DevAct, w: &DevMatrix, x: &DevAct) -> Result<(), CudaError> {
        self.gemv_many(&mut [out], &[w], x)
    }

    /// `outs[q][r] = ws[q] x[r]` for up to four matrices of one dtype and
    /// width sharing the input (q, k and v projections), in one launch per
    /// pass of rows.
    pub fn gemv_many(
        &self,
        outs: &mut [&mut DevAct],
        ws: &[&DevMatrix],
        x: &DevAct,
    ) -> Result<(), CudaError> {
        let Some(first) = ws.first() else {
            return Ok(());
        };
        check_many(outs, ws, x)?;
        let ty = first.ty();
        let many = format!("gemv_{}", ty.suffix());
        let one = format!("gemv1_{}", ty.suffix());
        for start in (0..x.rows()).step_by(MAX_GEMV_ROWS) {
            let rows = (x.rows() - start).min(MAX_GEMV_ROWS);
            let (a, cfg) = self.gemv_pass(outs, ws, x, start, rows)?;
            let f = if rows == 1 { &one } else { &many };
            // SAFETY: matches `gemv_*` in kernels/decode/. Each matrix holds its
            // rows of `row_bytes` (checked at upload) and, for FP8, a scale
            // grid covering every (row / br, col / bc); output q's rows
            // `start..start + rows` hold that matrix's rows and input rows
            // `start..start + rows` hold k values (`check_many`); vector
            // loads need k % 8 == 0, which `vec` says, and every buffer
            // starts 256-byte aligned; launch rows past `start[4]` do nothing.
            unsafe { self.launch(f, cfg, a) }?;
        }
        Ok(())
    }

    /// The arguments and grid of one pass of `gemv_*` (and the first ten
    /// of `router_softmax_*`): input rows `start..start + rows` of `x`
    /// (shapes checked by [`check_many`]).
    pub(super) fn gemv_pass(
        &self,
        outs: &[&mut DevAct],
        ws: &[&DevMatrix],
        x: &DevAct,
        start: usize,
        rows: usize,
    ) -> Result<(Args, LaunchConfig), CudaError> {
        let gpu = &self.gpu;
        let first = ws
            .first()
            .ok_or_else(|| shape("gemv", "no matrix".to_string()))?;
        let (ty, k) = (first.ty(), first.cols());
        let (_, br, bc) = scale_args(first);
        let row_bytes = (k * ty.elem_bytes()) as i64;
        let vec = i32::from(k % 8 == 0);
        let total: usize = ws.iter().map(|w| w.rows()).sum();
        let wpr = warps_per_row(total, row_bytes as usize);
        let per_block = 8 / wpr;
        let cfg = LaunchConfig {
            grid_dim: (
                u32::try_from(total.div_ceil(per_block))
                    .map_err(|_| shape("gemv", format!("{total} rows")))?,
                1,
                1,
            ),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut a = Args::new();
        a.push(mats(gpu, outs, ws, start))
            .push(row_bytes)
            .push(br)
            .push(bc)
            .push(k as i32)
            .push(addr(gpu, x.buf(), start * k))
            .push(k as i64)
            .push(rows as i32)
            .push(vec)
            .push(wpr as i32);
        Ok((a, cfg))
    }

    /// `out[r] = table[ids[r]]` widened to f32 (FP8 rows scaled). `ids`
    /// must be below `table.rows()`, which the caller checked on the host.
    pub fn embed(&self, out: &mut DevAct, table: &DevMatrix, ids: &[u32]) -> Result<(), CudaError> {
        if out.rows() != ids.len() || out.cols() != table.cols() {
            return Err(shape(
                "embed",
                format!(
                    "{} ids of width {} into {}x{}",
                    ids.len(),
                    table.cols(),
                    out.rows(),
                    out.cols()
                ),
            ));
        }
        if let Some(bad) = ids.iter().find(|&&i| i as usize >= table.rows()) {
            return Err(shape("embed", format!("id {bad} of {} rows", table.rows())));
        }
        let gpu = &self.gpu;
        // One id travels in the arguments (a decode step's graph replays
        // with no upload); more are uploaded.
        let (ids_dev, id0) = match ids {
            [one] => (None, *one as i32),
            _ => {
                let host: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
                let up = gpu
                    .stream()
                    .clone_htod(&host)
                    .map_err(CudaError::driver("upload token ids"))?;
                (Some(up), 0)
            }
        };
        let ids_addr = ids_dev.as_ref().map_or(0, |d| addr(gpu, d, 0));
        // SAFETY: every id is below the table's rows (checked above); the
        // uploaded ids (several rows) are retired below, kept until the
        // launch was issued.
        unsafe { self.launch_embed(out, table, ids_addr, id0) }?;
        if let Some(d) = ids_dev {
            gpu.retire(d);
        }
        Ok(())
    }

    /// `out` (one row) = `table[id]`, the id read on the device from the
    /// pick `t` ([`Self::argmax_ahead`]): `t` must be the latest pick (the
    /// device keeps one) and its row no wider than `table` has rows, so any
    /// id it holds is a row. The host need not have read the id.
    pub fn embed_picked(
        &self,
        out: &mut DevAct,
        table: &DevMatrix,
        t: super::pick::PickTicket,
    ) -> Result<(), CudaError> {
        if out.rows() != 1 || out.cols() != table.cols() || t.cols() > table.rows() {
            return Err(shape(
                "embed_picked",
                format!(
                    "a pick of {} ids into {}x{} from a table of {}x{}",
                    t.cols(),
                    out.rows(),
                    out.cols(),
                    table.rows(),
                    table.cols()
                ),
            ));
        }
        let ids = self.latest_pick_addr(t)?;
        // SAFETY: the id at `ids` is the argmax of a row of t.cols() <=
        // table.rows() values (the kernel writes an index below its row's
        // width), written by a launch issued before this one on the same
        // stream; the scratch it lives in outlives every launch.
        unsafe { self.launch_embed(out, table, ids, 0) }
    }

    /// Launch `embed_*`: `out.rows()` rows, ids from the device address
    /// `ids` (0: the one id `id0`).
    ///
    /// # Safety
    /// Every id the launch reads is below `table.rows()`, and a nonzero
    /// `ids` holds `out.rows()` ids that stay allocated until it ran.
    unsafe fn launch_embed(
        &self,
        out: &mut DevAct,
        table: &DevMatrix,
        ids: u64,
        id0: i32,
    ) -> Result<(), CudaError> {
        let gpu = &self.gpu;
        let f = format!("embed_{}", table.ty().suffix());
        let (sc_cols, br, bc) = scale_args(table);
        let row_bytes = (table.cols() * table.ty().elem_bytes()) as i64;
        let cols = table.cols() as i32;
        let cfg = LaunchConfig {
            grid_dim: (
                table.cols().div_ceil(256).min(64) as u32,
                dim(out.rows(), "y")?,
                1,
            ),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut a = Args::new();
        a.buf(gpu, table.data())
            .push(row_bytes)
            .buf(gpu, table.scales())
            .push(sc_cols)
            .push(br)
            .push(bc)
            .push(ids)
            .push(id0)
            .push(cols)
            .buf(gpu, out.buf());
        // SAFETY: matches `embed_*`; each id is a row of the table (the
        // caller's promise), so each row read lies in the table, and out
        // holds out.rows() rows of cols.
        unsafe { self.launch(&f, cfg, a) }
    }

    /// `x += y`.
    pub fn add(&self, x: &mut DevAct, y: &DevAct) -> Result<(), CudaError> {
        same("add", x, y)?;
        let n = (x.rows() * x.cols()) as i64;
        let g = &self.gpu;
        let mut a = Args::new();
        a.buf(g, x.buf()).buf(g, y.buf()).push(n);
        // SAFETY: matches `add_inplace`; both hold n elements.
        unsafe { self.launch("add_inplace", linear_cfg(n as usize, 256)?, a) }?;
        Ok(())
    }

    /// `x[r] += bias` for every row.
    pub fn add_bias(&self, x: &mut DevAct, bias: &DevVector) -> Result<(), CudaError> {
        if bias.len() != x.cols() {
            return Err(shape(
                "add_bias",
                format!("{} biases for {} columns", bias.len(), x.cols()),
            ));
        }
        let n = (x.rows() * x.cols()) as i64;
        let cols = x.cols() as i32;
        let g = &self.gpu;
        let mut a = Args::new();
        a.buf(g, x.buf()).buf(g, bias.data()).push(cols).push(n);
        // SAFETY: matches `add_bias`; x holds n elements, the bias cols.
        unsafe { self.launch("add_bias", linear_cfg(n as usize, 256)?, a) }?;
        Ok(())
    }

    /// `gate = silu(gate) * up`.
    pub fn silu_mul(&self, gate: &mut DevAct, up: &DevAct) -> Result<(), CudaError> {
        same("silu_mul", gate, up)?;
        let n = (gate.rows() * gate.cols()) as i64;
        let g = &self.gpu;
        let mut a = Args::new();
        a.buf(g, gate.buf()).buf(g, up.buf()).push(n);
        // SAFETY: matches `silu_mul`; both hold n elements.
        unsafe { self.launch("silu_mul", linear_cfg(n as usize, 256)?, a) }?;
        Ok(())
    }

    /// `acc[r] += sigmoid(gate[r][0]) * y[r]`.
    pub fn add_gated(&self, acc: &mut DevAct, y: &DevAct, gate: &DevAct) -> Result<(), CudaError> {
        same("add_gated", acc, y)?;
        if gate.rows() != acc.rows() || gate.cols() != 1 {
            return Err(shape(
                "add_gated",
                format!(
                    "gate {}x{} for {} rows",
                    gate.rows(),
                    gate.cols(),
                    acc.rows()
                ),
            ));
        }
        let n = (acc.rows() * acc.cols()) as i64;
        let cols = acc.cols() as i32;
        let g = &self.gpu;
        let mut a = Args::new();
        a.buf(g, acc.buf())
            .buf(g, y.buf())
            .buf(g, gate.buf())
            .push(cols)
            .push(n);
        // SAFETY: matches `add_gated`; acc and y hold n elements, gate one per row.
        unsafe { self.launch("add_gated", linear_cfg(n as usize, 256)?, a) }?;
        Ok(())
    }

    /// For each row and head `h`: `dst[h * ds + doff..][..len] = scale *
    /// src[h * ss + soff..][..len]` (`ss` 0 broadcasts one slice).
    #[allow(
        clippy::too_many_arguments,
        reason = "the copy's geometry, named as the kernel names it"
    )]
    pub fn copy_heads(
        &self,
        dst: &mut DevAct,
        src: &DevAct,
        heads: usize,
        len: usize,
        (ss, soff): (usize, usize),
        (ds, doff): (usize, usize),
        scale: f32,
    ) -> Result<(), CudaError> {
        let end = |stride: usize, off: usize| heads.saturating_sub(1) * stride + off + len;
        if dst.rows() != src.rows()
            || heads == 0
            || len == 0
            || end(ss, soff) > src.cols()
            || end(ds, doff) > dst.cols()
        {
            return Err(shape(
                "copy_heads",
                format!(
                    "{heads} heads of {len} from {}x{} to {}x{}",
                    src.rows(),
                    src.cols(),
                    dst.rows(),
                    dst.cols()
                ),
            ));
        }
        let cfg = LaunchConfig {
            grid_dim: (dim(src.rows(), "x")?, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let v = [src.cols(), ss, soff, dst.cols(), ds, doff, heads, len].map(|v| v as i32);
        let g = &self.gpu;
        let mut a = Args::new();
        a.buf(g, src.buf()).push(v[0]).push(v[1]).push(v[2]);
        a.buf(g, dst.buf());
        for x in &v[3..] {
            a.push(*x);
        }
        a.push(scale);
        // SAFETY: matches `copy_heads`; the last head's slice ends inside
        // both rows (checked above).
        unsafe { self.launch("copy_heads", cfg, a) }?;
        Ok(())
    }

    /// Rows `dst_row..dst_row + n` of `dst` = rows `src_row..src_row + n`
    /// of `src` (the same width), after every launch queued so far.
    pub fn copy_rows(
        &self,
        dst: &mut DevAct,
        dst_row: usize,
        src: &DevAct,
        src_row: usize,
        n: usize,
    ) -> Result<(), CudaError> {
        let c = src.cols();
        let fits = |row: usize, rows: usize| row.checked_add(n).is_some_and(|end| end <= rows);
        if dst.cols() != c || n == 0 || !fits(src_row, src.rows()) || !fits(dst_row, dst.rows()) {
            return Err(shape(
                "copy_rows",
                format!(
                    "{n} rows from row {src_row} of {}x{c} to row {dst_row} of {}x{}",
                    src.rows(),
                    dst.rows(),
                    dst.cols()
                ),
            ));
        }
        // Recorded launches wait in a queue; the copy goes to the stream.
        self.gpu.flush()?;
        let from = src.buf().slice(src_row * c..(src_row + n) * c);
        let mut to = dst.buf_mut().slice_mut(dst_row * c..(dst_row + n) * c);
        self.gpu
            .stream()
            .memcpy_dtod(&from, &mut to)
            .map_err(CudaError::driver("copy rows"))
    }
}
