//! [`HybridOps`] on the CPU: the host reference of Qwen4-Exp's operations,
//! in transformers' order of operations (sequential sums per row, so the
//! bits depend on the shapes alone). The sparse layers' cache is
//! [`HostSparse`] (`sparse.rs`).

use super::kernels::{dot, rms_norm, silu};
pub use super::sparse::HostSparse;
use super::sparse::check_sparse;
use super::{CpuDevice, HostAct, HostRope, shape_err};
use crate::device::Device;
use crate::device::hybrid::{ConvSpec, DeltaSpec, HybridOps, Map, SparseSpec, SparseState};
use crate::error::EngineError;

/// The logistic function.
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// torch's softplus (beta 1, linear above 20).
fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

/// torch's sign: -1, 0 or 1.
fn sign(x: f32) -> f32 {
    if x > 0.0 {
        1.0
    } else if x < 0.0 {
        -1.0
    } else {
        0.0
    }
}

/// `x / sqrt(sum(x^2) + 1e-6)` in place (the FLA-style L2 norm).
fn l2norm(x: &mut [f32]) {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    let inv = 1.0 / (ss + 1e-6).sqrt();
    x.iter_mut().for_each(|v| *v *= inv);
}

fn same(op: &'static str, a: &HostAct, b: &HostAct) -> Result<(), EngineError> {
    if a.rows != b.rows || a.cols != b.cols {
        return Err(shape_err(
            op,
            format!("{}x{} and {}x{}", a.rows, a.cols, b.rows, b.cols),
        ));
    }
    Ok(())
}

impl HybridOps for CpuDevice {
    type Sparse = HostSparse;
    type Landing = Option<HostAct>;

    fn state(&self, rows: usize, cols: usize) -> Result<HostAct, EngineError> {
        self.zeros(rows, cols)
    }

    fn upload(&self, rows: usize, cols: usize, data: &[f32]) -> Result<HostAct, EngineError> {
        HostAct::from_vec(rows, cols, data.to_vec())
    }

    fn landing(&self, _cols: usize) -> Result<Option<HostAct>, EngineError> {
        Ok(None)
    }

    fn land(&self, at: &mut Option<HostAct>, rows: usize, data: &[f32]) -> Result<(), EngineError> {
        let cols = data.len() / rows.max(1);
        *at = Some(HostAct::from_vec(rows, cols, data.to_vec())?);
        Ok(())
    }

    fn landed<'a>(&self, at: &'a Option<HostAct>) -> Result<&'a HostAct, EngineError> {
        at.as_ref().ok_or_else(no_rows_landed)
    }

    fn landed_read(&self, _at: &mut Option<HostAct>) -> Result<(), EngineError> {
        Ok(())
    }

    fn rms_norm_wide(
        &self,
        out: &mut HostAct,
        x: &HostAct,
        w: &Vec<f32>,
        group: usize,
        eps: f32,
    ) -> Result<(), EngineError> {
        same("rms_norm_wide", out, x)?;
        let width = w.len();
        if group == 0 || width == 0 || width % group != 0 || x.cols != width {
            return Err(shape_err(
                "rms_norm_wide",
                format!("{} columns, {width}-wide weight, groups of {group}", x.cols),
            ));
        }
        for (o, xi) in out
            .data
            .chunks_exact_mut(width)
            .zip(x.data.chunks_exact(width))
        {
            for ((og, xg), wg) in o
                .chunks_exact_mut(group)
                .zip(xi.chunks_exact(group))
                .zip(w.chunks_exact(group))
            {
                rms_norm(og, xg, wg, eps);
            }
        }
        Ok(())
    }

    fn map(&self, x: &mut HostAct, f: Map) -> Result<(), EngineError> {
        match f {
            Map::Silu { div } => x.data.iter_mut().for_each(|v| *v = silu(*v / div)),
            Map::Sigmoid { div, mul } => {
                x.data.iter_mut().for_each(|v| *v = mul * sigmoid(*v / div))
            }
        }
        Ok(())
    }

    fn mul_sigmoid(&self, x: &mut HostAct, gate: &HostAct) -> Result<(), EngineError> {
        same("mul_sigmoid", x, gate)?;
        for (v, g) in x.data.iter_mut().zip(&gate.data) {
            *v *= sigmoid(*g);
        }
        Ok(())
    }

    fn hc_mix(
        &self,
        out: &mut HostAct,
        gates: &HostAct,
        normed: &HostAct,
        streams: usize,
    ) -> Result<(), EngineError> {
        same("hc_mix", gates, normed)?;
        let h = out.cols;
        if streams == 0 || h == 0 || gates.cols != streams * h || gates.rows != out.rows {
            return Err(shape_err(
                "hc_mix",
                format!(
                    "{}x{} gates into {}x{h} over {streams} streams",
                    gates.rows, gates.cols, out.rows
                ),
            ));
        }
        for ((o, gr), nr) in out
            .data
            .chunks_exact_mut(h)
            .zip(gates.data.chunks_exact(streams * h))
            .zip(normed.data.chunks_exact(streams * h))
        {
            for (s, (gs, ns)) in gr.chunks_exact(h).zip(nr.chunks_exact(h)).enumerate() {
                for ((ov, g), n) in o.iter_mut().zip(gs).zip(ns) {
                    let v = sigmoid(*g) * n;
                    *ov = if s == 0 { v } else { *ov + v };
                }
            }
            o.iter_mut().for_each(|v| *v /= streams as f32);
        }
        Ok(())
    }

    fn hc_inject(
        &self,
        x: &mut HostAct,
        y: &HostAct,
        w: &HostAct,
        gate: Map,
    ) -> Result<(), EngineError> {
        let (h, streams) = (y.cols, w.cols);
        if x.rows != y.rows || w.rows != y.rows || x.cols != streams * h {
            return Err(shape_err(
                "hc_inject",
                format!(
                    "{}x{} block output, {}x{} weights into {}x{}",
                    y.rows, y.cols, w.rows, w.cols, x.rows, x.cols
                ),
            ));
        }
        if h == 0 || streams == 0 {
            return Ok(());
        }
        for ((xr, yr), wr) in x
            .data
            .chunks_exact_mut(streams * h)
            .zip(y.data.chunks_exact(h))
            .zip(w.data.chunks_exact(streams))
        {
            for (xs, &raw) in xr.chunks_exact_mut(h).zip(wr) {
                let ws = match gate {
                    Map::Silu { div } => silu(raw / div),
                    Map::Sigmoid { div, mul } => mul * sigmoid(raw / div),
                };
                for (xv, yv) in xs.iter_mut().zip(yr) {
                    *xv += yv * ws;
                }
            }
        }
        Ok(())
    }

    fn causal_conv(
        &self,
        state: &mut HostAct,
        x: &HostAct,
        w: &Vec<f32>,
        spec: ConvSpec,
        out: &mut HostAct,
    ) -> Result<(), EngineError> {
        same("causal_conv", out, x)?;
        let (c, k, dil) = (x.cols, spec.kernel, spec.dilation);
        let held = spec.state_rows();
        if k == 0
            || dil == 0
            || state.cols != c
            || state.rows != held
            || w.len() != c.saturating_mul(k)
        {
            return Err(shape_err(
                "causal_conv",
                format!(
                    "{k} taps every {dil} rows over {c} channels: state {}x{}, {} weights",
                    state.rows,
                    state.cols,
                    w.len()
                ),
            ));
        }
        let mut hist = std::mem::take(&mut state.data);
        hist.extend_from_slice(&x.data);
        for r in 0..x.rows {
            let t = held + r;
            for ch in 0..c {
                let wc = &w[ch * k..(ch + 1) * k];
                let mut acc = 0f32;
                for (m, wm) in wc.iter().enumerate() {
                    acc += wm * hist[(t - (k - 1 - m) * dil) * c + ch];
                }
                out.data[r * c + ch] = silu(acc);
            }
        }
        state.data = hist.split_off(hist.len() - held * c);
        Ok(())
    }

    fn gated_delta(
        &self,
        state: &mut HostAct,
        mixed: &HostAct,
        (b, a): (&HostAct, &HostAct),
        a_exp: &Vec<f32>,
        dt_bias: &Vec<f32>,
        spec: DeltaSpec,
        out: &mut HostAct,
    ) -> Result<(), EngineError> {
        let s = spec;
        let (kd, dk, dv, vh) = (s.k_heads * s.k_dim, s.k_dim, s.v_dim, s.v_heads);
        let rows = mixed.rows;
        let fits = s.k_heads > 0
            && vh % s.k_heads == 0
            && mixed.cols == s.mixed_cols()
            && b.rows == rows
            && a.rows == rows
            && b.cols == vh
            && a.cols == vh
            && a_exp.len() == vh
            && dt_bias.len() == vh
            && state.rows == vh
            && state.cols == dk * dv
            && out.rows == rows
            && out.cols == vh * dv;
        if !fits {
            return Err(shape_err(
                "gated_delta",
                format!(
                    "{}x{} projection, {}x{} state, {}x{} output for {} key heads of {dk} and {vh} \
                     value heads of {dv}",
                    rows, mixed.cols, state.rows, state.cols, out.rows, out.cols, s.k_heads
                ),
            ));
        }
        let per_k = vh / s.k_heads;
        let scale = 1.0 / (dk as f32).sqrt();
        for r in 0..rows {
            let row = mixed.row(r);
            let mut q = row[..kd].to_vec();
            let mut k = row[kd..2 * kd].to_vec();
            let v = &row[2 * kd..];
            for (qh, kh) in q.chunks_exact_mut(dk).zip(k.chunks_exact_mut(dk)) {
                l2norm(qh);
                l2norm(kh);
                qh.iter_mut().for_each(|x| *x *= scale);
            }
            let o = &mut out.data[r * vh * dv..(r + 1) * vh * dv];
            o.iter_mut().for_each(|x| *x = 0.0);
            for hv in 0..vh {
                let kh = hv / per_k;
                let (qv, kv) = (&q[kh * dk..(kh + 1) * dk], &k[kh * dk..(kh + 1) * dk]);
                let beta = sigmoid(b.data[r * vh + hv]);
                let decay = (-a_exp[hv] * softplus(a.data[r * vh + hv] + dt_bias[hv])).exp();
                let st = &mut state.data[hv * dk * dv..(hv + 1) * dk * dv];
                st.iter_mut().for_each(|x| *x *= decay);
                let mut delta = vec![0f32; dv];
                for (srow, kr) in st.chunks_exact(dv).zip(kv) {
                    for (d, sv) in delta.iter_mut().zip(srow) {
                        *d += sv * kr;
                    }
                }
                for (d, vv) in delta.iter_mut().zip(&v[hv * dv..(hv + 1) * dv]) {
                    *d = (vv - *d) * beta;
                }
                let oh = &mut o[hv * dv..(hv + 1) * dv];
                for ((srow, kr), qr) in st.chunks_exact_mut(dv).zip(kv).zip(qv) {
                    for ((sv, d), ov) in srow.iter_mut().zip(&delta).zip(oh.iter_mut()) {
                        *sv += kr * d;
                        *ov += *sv * qr;
                    }
                }
            }
        }
        Ok(())
    }

    fn gated_norm(
        &self,
        out: &mut HostAct,
        (o, z): (&HostAct, &HostAct),
        w: &Vec<f32>,
        eps: f32,
        sigmoid_gate: bool,
    ) -> Result<(), EngineError> {
        same("gated_norm", out, o)?;
        same("gated_norm", out, z)?;
        let dv = w.len();
        if dv == 0 || o.cols % dv != 0 {
            return Err(shape_err(
                "gated_norm",
                format!("{dv}-wide weight over {} columns", o.cols),
            ));
        }
        for ((d, oh), zh) in out
            .data
            .chunks_exact_mut(dv)
            .zip(o.data.chunks_exact(dv))
            .zip(z.data.chunks_exact(dv))
        {
            rms_norm(d, oh, w, eps);
            for (dv, zv) in d.iter_mut().zip(zh) {
                *dv *= if sigmoid_gate {
                    sigmoid(*zv)
                } else {
                    silu(*zv)
                };
            }
        }
        Ok(())
    }

    fn ple_gate(
        &self,
        gated: &mut HostAct,
        (key, query): (&HostAct, &HostAct),
        value: &HostAct,
    ) -> Result<(), EngineError> {
        same("ple_gate", gated, key)?;
        same("ple_gate", gated, query)?;
        let h = value.cols;
        if h == 0 || value.rows != gated.rows || gated.cols % h != 0 {
            return Err(shape_err(
                "ple_gate",
                format!(
                    "{}x{} values for {}x{} streams",
                    value.rows, value.cols, gated.rows, gated.cols
                ),
            ));
        }
        let wide = gated.cols;
        let root = (h as f32).sqrt();
        for r in 0..gated.rows {
            for s in 0..wide / h {
                let at = r * wide + s * h;
                let g = dot(&key.data[at..at + h], &query.data[at..at + h]) / root;
                let g = g.abs().max(1e-6).sqrt() * sign(g);
                let w = sigmoid(g);
                for (o, v) in gated.data[at..at + h].iter_mut().zip(value.row(r)) {
                    *o = w * v;
                }
            }
        }
        Ok(())
    }

    fn sparse_cache(&self, spec: &SparseSpec) -> Result<HostSparse, EngineError> {
        check_sparse(spec)?;
        Ok(HostSparse {
            spec: *spec,
            keys: Vec::new(),
            values: Vec::new(),
            index_keys: Vec::new(),
            block_keys: Vec::new(),
        })
    }

    fn sparse_clear(&self, cache: &mut HostSparse) -> Result<(), EngineError> {
        cache.keys.clear();
        cache.values.clear();
        cache.index_keys.clear();
        cache.block_keys.clear();
        Ok(())
    }

    fn sparse_attend(
        &self,
        cache: &mut HostSparse,
        (q, k, v): (&HostAct, &HostAct, &HostAct),
        (iq, ik): (&HostAct, &HostAct),
        k_norm: &Vec<f32>,
        table: &HostRope,
        out: &mut HostAct,
    ) -> Result<(), EngineError> {
        let s = cache.spec;
        let (qw, kvw) = (s.q_heads * s.head_dim, s.kv_heads * s.head_dim);
        let rows = q.rows;
        let first = cache.len();
        let fits = q.cols == qw
            && out.cols == qw
            && out.rows == rows
            && k.cols == kvw
            && v.cols == kvw
            && k.rows == rows
            && v.rows == rows
            && iq.cols == s.index_heads * s.index_dim
            && iq.rows == rows
            && ik.cols == s.index_dim
            && ik.rows == rows
            && k_norm.len() == s.index_dim
            && s.rope_dims / 2 <= table.inv_freq.len();
        if !fits {
            return Err(shape_err(
                "sparse_attend",
                format!(
                    "{rows}x{} queries, {}x{} keys, {}x{} index queries, {}x{} index keys, {} \
                     norm weights for {} query and {} key heads of {}, {} index heads of {}",
                    q.cols,
                    k.rows,
                    k.cols,
                    iq.rows,
                    iq.cols,
                    ik.rows,
                    ik.cols,
                    k_norm.len(),
                    s.q_heads,
                    s.kv_heads,
                    s.head_dim,
                    s.index_heads,
                    s.index_dim
                ),
            ));
        }
        if first + rows > s.capacity || first + rows > table.positions {
            return Err(EngineError::ContextFull {
                len: first + rows,
                max: s.capacity.min(table.positions),
            });
        }
        cache.keys.extend_from_slice(&k.data);
        cache.values.extend_from_slice(&v.data);
        cache.index_keys.extend_from_slice(&ik.data);
        cache.complete_blocks(k_norm, table);
        for r in 0..rows {
            let positions = cache.select(iq.row(r), first + r);
            cache.attend(q.row(r), &positions, &mut out.data[r * qw..(r + 1) * qw]);
        }
        Ok(())
    }
}

/// A landing read before anything was landed in it.
pub(crate) fn no_rows_landed() -> EngineError {
    EngineError::Shape {
        op: "ple rows",
        what: "read before any rows were landed".into(),
    }
}
