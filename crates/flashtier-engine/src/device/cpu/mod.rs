//! The CPU device: the reference every other device is checked against,
//! and the fallback where there is no GPU. Activations are host `Vec<f32>`,
//! weights stay in their stored form ([`Matrix`]), the KV cache is the KV
//! tier's paged BF16 layout ([`kv::KvCache`]) and experts are read in place
//! from the host expert pool ([`experts::PoolExperts`]).
//!
//! Kernels ([`kernels`], [`gemv`]) run on rayon's global pool (one
//! persistent pool sized to the cores) on the instruction set [`isa`] picks
//! at start-up; each reduction runs in an order fixed by the shapes alone.
//! A step with several rows (a prompt chunk) reads each weight row once per
//! group of rows (dense layers, and each expert over the rows that chose
//! it) and attends its rows together, each over the positions up to its
//! own ([`kv`]); the experts it routes to run in parallel, each over its
//! rows, and its row-wise steps (norms, residual adds, RoPE, routing) on
//! the pool; its output is bit-identical to feeding the rows one at a
//! time.

pub mod ceiling;
pub mod experts;
pub mod gemv;
pub mod hybrid;
pub mod isa;
pub mod kernels;
pub mod kv;
mod moe;
mod sparse;

use crate::device::{Activation, Device, HeadCopy, KvSpec, RopeSpec, VectorLen};
use crate::error::EngineError;
use crate::family::route::{RouteRule, route_row};
use crate::matrix::Matrix;
use experts::PoolExperts;
use kernels::{apply_rope, apply_rope_interleaved, argmax, matmul, rms_norm, silu};
use kv::KvCache;
use moe::{moe_row, moe_rows};
use rayon::prelude::*;

/// Fewest values of an element-wise step one pool task takes (a prompt
/// chunk's norms and residual adds; one row runs on the caller).
const PAR_MIN_VALUES: usize = 16 * 1024;

/// A `rows x cols` f32 activation in host memory.
#[derive(Clone, Debug, PartialEq)]
pub struct HostAct {
    rows: usize,
    cols: usize,
    data: Vec<f32>,
}

impl HostAct {
    /// Row-major values.
    pub fn data(&self) -> &[f32] {
        &self.data
    }

    /// `rows x cols` from row-major `data` (its length must be the product).
    pub fn from_vec(rows: usize, cols: usize, data: Vec<f32>) -> Result<Self, EngineError> {
        if rows.checked_mul(cols) != Some(data.len()) {
            return Err(shape_err(
                "from_vec",
                format!("{} values for {rows}x{cols}", data.len()),
            ));
        }
        Ok(Self { rows, cols, data })
    }

    /// The row-major values.
    pub fn into_vec(self) -> Vec<f32> {
        self.data
    }

    fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }

    fn row_mut(&mut self, r: usize) -> &mut [f32] {
        &mut self.data[r * self.cols..(r + 1) * self.cols]
    }
}

impl Activation for HostAct {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
}

impl VectorLen for Vec<f32> {
    fn len(&self) -> usize {
        self.as_slice().len()
    }
}

/// RoPE's inverse frequencies and cos/sin factor; angles are computed per
/// position (`p as f32 * inv_freq[i]`, as transformers does).
#[derive(Clone, Debug)]
pub struct HostRope {
    inv_freq: Vec<f32>,
    factor: f32,
    positions: usize,
}

/// The CPU device.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuDevice;

/// A MoE step's input, output and routes agree: one route per row.
fn moe_shapes(x: &HostAct, routes: &[Vec<(usize, f32)>], out: &HostAct) -> Result<(), EngineError> {
    same_shape("moe", x, out)?;
    if routes.len() != x.rows {
        return Err(shape_err(
            "moe",
            format!("{} routed rows for {} input rows", routes.len(), x.rows),
        ));
    }
    Ok(())
}

fn shape_err(op: &'static str, what: String) -> EngineError {
    EngineError::Shape { op, what }
}

fn same_shape(op: &'static str, a: &HostAct, b: &HostAct) -> Result<(), EngineError> {
    if a.rows != b.rows || a.cols != b.cols {
        return Err(shape_err(
            op,
            format!("{}x{} against {}x{}", a.rows, a.cols, b.rows, b.cols),
        ));
    }
    Ok(())
}

fn mat_len(w: &Matrix) -> (usize, usize) {
    (w.rows(), w.cols())
}

impl Device for CpuDevice {
    type Act = HostAct;
    type Mat = Matrix;
    type Vector = Vec<f32>;
    type Kv = KvCache;
    type Rope = HostRope;
    type Routes = Vec<Vec<(usize, f32)>>;
    type Experts = PoolExperts;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn matrix(&self, m: Matrix) -> Result<Matrix, EngineError> {
        Ok(m)
    }

    fn vector(&self, v: Vec<f32>) -> Result<Vec<f32>, EngineError> {
        Ok(v)
    }

    fn zeros(&self, rows: usize, cols: usize) -> Result<HostAct, EngineError> {
        let len = rows
            .checked_mul(cols)
            .ok_or_else(|| shape_err("zeros", format!("{rows}x{cols} overflows")))?;
        Ok(HostAct {
            rows,
            cols,
            data: vec![0.0; len],
        })
    }

    fn rope_table(
        &self,
        inv_freq: &[f32],
        factor: f32,
        positions: usize,
    ) -> Result<HostRope, EngineError> {
        Ok(HostRope {
            inv_freq: inv_freq.to_vec(),
            factor,
            positions,
        })
    }

    fn kv_cache(&self, spec: &KvSpec) -> Result<KvCache, EngineError> {
        KvCache::new(spec)
    }

    fn embed(&self, out: &mut HostAct, table: &Matrix, ids: &[u32]) -> Result<(), EngineError> {
        if out.rows != ids.len() || out.cols != table.cols() {
            return Err(shape_err(
                "embed",
                format!(
                    "{} ids of {} into {}x{}",
                    ids.len(),
                    table.cols(),
                    out.rows,
                    out.cols
                ),
            ));
        }
        for (r, &id) in ids.iter().enumerate() {
            let row = table
                .row_f32(id as usize)
                .ok_or(EngineError::TokenOutOfRange {
                    id,
                    vocab: table.rows(),
                })?;
            out.row_mut(r).copy_from_slice(&row);
        }
        Ok(())
    }

    fn linear(&self, out: &mut HostAct, w: &Matrix, x: &HostAct) -> Result<(), EngineError> {
        let (rows, cols) = mat_len(w);
        if x.cols != cols || out.cols != rows || out.rows != x.rows {
            return Err(shape_err(
                "linear",
                format!(
                    "{rows}x{cols} weight, {}x{} input, {}x{} output",
                    x.rows, x.cols, out.rows, out.cols
                ),
            ));
        }
        if x.rows == 0 {
            return Ok(());
        }
        // Every weight row is read once per group of tokens; the bits
        // equal a matvec per row.
        matmul(&mut out.data, w.mat(), &x.data, x.rows);
        Ok(())
    }

    fn rms_norm(
        &self,
        out: &mut HostAct,
        x: &HostAct,
        w: &Vec<f32>,
        eps: f32,
    ) -> Result<(), EngineError> {
        same_shape("rms_norm", out, x)?;
        let g = w.len();
        if g == 0 || x.cols % g != 0 {
            return Err(shape_err(
                "rms_norm",
                format!("{}-wide weight over {} columns", g, x.cols),
            ));
        }
        let norm = |(o, xi): (&mut [f32], &[f32])| rms_norm(o, xi, w, eps);
        if x.rows > 1 {
            // A prompt chunk's rows on the pool; each row's bits as alone.
            (out.data.par_chunks_exact_mut(g))
                .zip(x.data.par_chunks_exact(g))
                .with_min_len(PAR_MIN_VALUES.div_ceil(g))
                .for_each(norm);
        } else {
            out.data
                .chunks_exact_mut(g)
                .zip(x.data.chunks_exact(g))
                .for_each(norm);
        }
        Ok(())
    }

    fn add(&self, x: &mut HostAct, y: &HostAct) -> Result<(), EngineError> {
        same_shape("add", x, y)?;
        let add = |(a, b): (&mut [f32], &[f32])| {
            for (a, b) in a.iter_mut().zip(b) {
                *a += b;
            }
        };
        let piece = PAR_MIN_VALUES;
        if x.rows > 1 {
            (x.data.par_chunks_mut(piece))
                .zip(y.data.par_chunks(piece))
                .for_each(add);
        } else {
            add((&mut x.data, &y.data));
        }
        Ok(())
    }

    fn add_bias(&self, x: &mut HostAct, b: &Vec<f32>) -> Result<(), EngineError> {
        if b.len() != x.cols {
            return Err(shape_err(
                "add_bias",
                format!("{} biases for {} columns", b.len(), x.cols),
            ));
        }
        for row in x.data.chunks_exact_mut(x.cols.max(1)) {
            for (a, v) in row.iter_mut().zip(b) {
                *a += v;
            }
        }
        Ok(())
    }

    fn silu_mul(&self, gate: &mut HostAct, up: &HostAct) -> Result<(), EngineError> {
        same_shape("silu_mul", gate, up)?;
        for (a, u) in gate.data.iter_mut().zip(&up.data) {
            *a = silu(*a) * u;
        }
        Ok(())
    }

    fn add_gated(&self, acc: &mut HostAct, y: &HostAct, gate: &HostAct) -> Result<(), EngineError> {
        same_shape("add_gated", acc, y)?;
        if gate.rows != acc.rows || gate.cols != 1 {
            return Err(shape_err(
                "add_gated",
                format!("gate {}x{} for {} rows", gate.rows, gate.cols, acc.rows),
            ));
        }
        for r in 0..acc.rows {
            let g = crate::family::route::sigmoid(gate.data[r]);
            let (a, yr) = (&mut acc.data[r * acc.cols..(r + 1) * acc.cols], y.row(r));
            for (o, v) in a.iter_mut().zip(yr) {
                *o += g * v;
            }
        }
        Ok(())
    }

    fn rope(
        &self,
        x: &mut HostAct,
        table: &HostRope,
        spec: RopeSpec,
        first: usize,
    ) -> Result<(), EngineError> {
        check_rope(x, table, spec, first)?;
        let cols = x.cols.max(1);
        // Rows on the pool (each row's bits as alone).
        x.data
            .par_chunks_mut(cols)
            .enumerate()
            .for_each(|(r, row)| {
                let (cos, sin) = kernels::rope_angles(first + r, &table.inv_freq, table.factor);
                for h in 0..spec.heads {
                    let at = h * spec.head_stride + spec.offset;
                    let part = &mut row[at..at + spec.dims];
                    if spec.interleaved {
                        apply_rope_interleaved(part, spec.dims, &cos, &sin);
                    } else {
                        apply_rope(part, spec.dims, &cos, &sin);
                    }
                }
            });
        Ok(())
    }

    fn copy_heads(
        &self,
        dst: &mut HostAct,
        src: &HostAct,
        spec: HeadCopy,
    ) -> Result<(), EngineError> {
        check_copy(dst, src, spec)?;
        for r in 0..src.rows {
            for h in 0..spec.heads {
                let s = h * spec.src_stride + spec.src_offset;
                let d = h * spec.dst_stride + spec.dst_offset;
                let (from, to) = (&src.row(r)[s..s + spec.len], r * dst.cols + d);
                for (o, v) in dst.data[to..to + spec.len].iter_mut().zip(from) {
                    *o = v * spec.scale;
                }
            }
        }
        Ok(())
    }

    fn attend(
        &self,
        kv: &mut KvCache,
        layer: usize,
        q: &HostAct,
        k: &HostAct,
        v: &HostAct,
        out: &mut HostAct,
    ) -> Result<(), EngineError> {
        same_shape("attend", q, out)?;
        same_shape("attend", k, v)?;
        if k.rows != q.rows {
            return Err(shape_err(
                "attend",
                format!("{} key rows for {} query rows", k.rows, q.rows),
            ));
        }
        for r in 0..k.rows {
            kv.push(layer, k.row(r), v.row(r))?;
        }
        if q.rows == 0 {
            return Ok(());
        }
        // Every row at once, each over the positions up to its own.
        kv.attend(layer, &q.data, &mut out.data)
    }

    fn route(
        &self,
        logits: &HostAct,
        rule: &RouteRule,
        bias: Option<&Vec<f32>>,
    ) -> Result<Self::Routes, EngineError> {
        if logits.cols != rule.num_experts || bias.is_some_and(|b| b.len() != rule.num_experts) {
            return Err(shape_err(
                "route",
                format!(
                    "{} logits (bias of {}) for {} experts",
                    logits.cols,
                    bias.map_or_else(|| "none".to_string(), |b| b.len().to_string()),
                    rule.num_experts
                ),
            ));
        }
        let bias = bias.map(Vec::as_slice);
        Ok((0..logits.rows)
            .into_par_iter()
            .map(|r| route_row(rule, logits.row(r), bias))
            .collect())
    }

    fn moe(
        &self,
        experts: &mut PoolExperts,
        layer: usize,
        x: &HostAct,
        routes: &Self::Routes,
        out: &mut HostAct,
    ) -> Result<(), EngineError> {
        moe_shapes(x, routes, out)?;
        if let [chosen] = routes.as_slice() {
            let y = moe_row(experts, layer, x.row(0), chosen)?;
            out.row_mut(0).copy_from_slice(&y);
            return Ok(());
        }
        moe_rows(experts, layer, &x.data, routes, &mut out.data, None)
    }

    /// The experts run in batches of whatever is ready, each batch's
    /// experts in parallel and each expert's products on one thread (one
    /// fork-join per batch instead of one per product: 6% more tokens/s on
    /// the resident Qwen4-Exp demo model, 2 cores); `meanwhile` runs after
    /// the misses are started and before the first expert is computed.
    fn moe_meanwhile(
        &self,
        experts: &mut PoolExperts,
        layer: usize,
        x: &HostAct,
        routes: &Self::Routes,
        out: &mut HostAct,
        meanwhile: &mut dyn FnMut() -> Result<(), EngineError>,
    ) -> Result<(), EngineError> {
        moe_shapes(x, routes, out)?;
        moe_rows(
            experts,
            layer,
            &x.data,
            routes,
            &mut out.data,
            Some(meanwhile),
        )
    }

    fn hint_depth(&self) -> usize {
        experts::MAX_AHEAD
    }

    fn hint_ahead(
        &self,
        experts: &mut PoolExperts,
        distance: usize,
        layer: usize,
        routes: &Self::Routes,
    ) -> Result<(), EngineError> {
        if let [row] = routes.as_slice() {
            experts.hint_ahead(distance, layer, &crate::hint::ranked(row.iter().copied()));
        }
        Ok(())
    }

    fn read_ahead_now(
        &self,
        experts: &mut PoolExperts,
        layer: usize,
        routes: &Self::Routes,
    ) -> Result<(), EngineError> {
        if let [row] = routes.as_slice() {
            experts.read_ahead_now(layer, &crate::hint::ranked(row.iter().copied()))?;
        }
        Ok(())
    }

    fn hint(
        &self,
        experts: &mut PoolExperts,
        layer: usize,
        routes: &Self::Routes,
    ) -> Result<(), EngineError> {
        // One token's guess; a prompt chunk's rows would each guess apart.
        if let [row] = routes.as_slice() {
            // Strongest first: the tier scores ranks.
            experts.hint(layer, &crate::hint::ranked(row.iter().copied()));
        }
        Ok(())
    }

    fn copy_rows(
        &self,
        dst: &mut HostAct,
        dst_row: usize,
        src: &HostAct,
        src_row: usize,
        n: usize,
    ) -> Result<(), EngineError> {
        let c = src.cols;
        let fits = |row: usize, rows: usize| row.checked_add(n).is_some_and(|end| end <= rows);
        if dst.cols != c || n == 0 || !fits(src_row, src.rows) || !fits(dst_row, dst.rows) {
            return Err(shape_err(
                "copy_rows",
                format!(
                    "{n} rows from row {src_row} of {}x{c} to row {dst_row} of {}x{}",
                    src.rows, dst.rows, dst.cols
                ),
            ));
        }
        dst.data[dst_row * c..(dst_row + n) * c]
            .copy_from_slice(&src.data[src_row * c..(src_row + n) * c]);
        Ok(())
    }

    fn to_host(&self, x: &HostAct) -> Result<Vec<f32>, EngineError> {
        Ok(x.data.clone())
    }

    fn argmax_rows(&self, x: &HostAct) -> Result<Vec<u32>, EngineError> {
        Ok((0..x.rows).map(|r| argmax(x.row(r)) as u32).collect())
    }
}

fn check_rope(x: &HostAct, t: &HostRope, spec: RopeSpec, first: usize) -> Result<(), EngineError> {
    let last_col = spec.heads.saturating_sub(1) * spec.head_stride + spec.offset + spec.dims;
    if spec.dims % 2 != 0
        || spec.dims / 2 > t.inv_freq.len()
        || (spec.heads > 0 && last_col > x.cols)
    {
        return Err(shape_err(
            "rope",
            format!(
                "{spec} over {} columns and {} frequencies",
                x.cols,
                t.inv_freq.len()
            ),
        ));
    }
    if first + x.rows > t.positions {
        return Err(EngineError::ContextFull {
            len: first + x.rows,
            max: t.positions,
        });
    }
    Ok(())
}

fn check_copy(dst: &HostAct, src: &HostAct, s: HeadCopy) -> Result<(), EngineError> {
    let end = |stride: usize, off: usize| s.heads.saturating_sub(1) * stride + off + s.len;
    if dst.rows != src.rows
        || (s.heads > 0
            && (end(s.src_stride, s.src_offset) > src.cols
                || end(s.dst_stride, s.dst_offset) > dst.cols))
    {
        return Err(shape_err(
            "copy_heads",
            format!(
                "{s} from {}x{} to {}x{}",
                src.rows, src.cols, dst.rows, dst.cols
            ),
        ));
    }
    Ok(())
}
