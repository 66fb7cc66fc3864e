//! Shared by the GPU tests: open the device or say why the test is skipped.
#![allow(dead_code, reason = "each test binary uses a subset of these helpers")]

use flashtier_cuda::ops::DecodeKernels;
use flashtier_cuda::ops::buffers::{ActPool, DevAct, WeightType};
use flashtier_cuda::ops::experts::ExpertSpec;
use flashtier_cuda::{CudaError, Gpu, nvrtc_present};
use rand::Rng;
use rand::rngs::SmallRng;

/// The GPU, or `None` with a printed reason (no driver, no device, no NVRTC).
pub fn gpu_or_skip(test: &str) -> Option<Gpu> {
    match Gpu::open(0) {
        Ok(g) => {
            if nvrtc_present() {
                Some(g)
            } else {
                flashtier_io::skip::notice(test, "libnvrtc not found, kernels cannot be compiled");
                None
            }
        }
        Err(e @ (CudaError::NoDriver | CudaError::NoDevice { .. })) => {
            flashtier_io::skip::notice(test, &e.to_string());
            None
        }
        Err(e) => panic!("{test}: opening the GPU failed: {e}"),
    }
}

/// Round-to-nearest-even f32 -> bf16 bits.
pub fn bf16(x: f32) -> u16 {
    half::bf16::from_f32(x).to_bits()
}

/// bf16 bits -> f32.
pub fn f32_of(b: u16) -> f32 {
    half::bf16::from_bits(b).to_f32()
}

pub fn e4m3(b: u8) -> f32 {
    flashtier_format::fp8::e4m3_to_f32(b)
}

/// A random matrix of `ty` as stored bytes, its scales, and its f64 values.
pub fn random_matrix(
    rng: &mut SmallRng,
    rows: usize,
    cols: usize,
    ty: WeightType,
) -> (Vec<u8>, Option<Vec<u8>>, Vec<f64>) {
    let n = rows * cols;
    match ty {
        WeightType::Bf16 => {
            let bits: Vec<u16> = (0..n).map(|_| bf16(rng.random_range(-1.0..1.0))).collect();
            let vals = bits.iter().map(|&b| f64::from(f32_of(b))).collect();
            (
                bits.iter().flat_map(|b| b.to_le_bytes()).collect(),
                None,
                vals,
            )
        }
        WeightType::F16 => {
            let h: Vec<half::f16> = (0..n)
                .map(|_| half::f16::from_f32(rng.random_range(-1.0..1.0)))
                .collect();
            let vals = h.iter().map(|v| f64::from(v.to_f32())).collect();
            (h.iter().flat_map(|v| v.to_le_bytes()).collect(), None, vals)
        }
        WeightType::F32 => {
            let v: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
            (
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                None,
                v.iter().map(|&x| f64::from(x)).collect(),
            )
        }
        WeightType::Fp8 { block: [br, bc] } => {
            let codes: Vec<u8> = (0..n)
                .map(|_| {
                    let c: u8 = rng.random();
                    if c & 0x7F == 0x7F { c - 1 } else { c }
                })
                .collect();
            let [sr, sc] = ty.scale_grid(rows, cols);
            let scales: Vec<f32> = (0..sr * sc)
                .map(|_| rng.random_range(0.001..0.01))
                .collect();
            let vals = (0..n)
                .map(|i| {
                    let (r, c) = (i / cols, i % cols);
                    f64::from(e4m3(codes[i])) * f64::from(scales[(r / br) * sc + c / bc])
                })
                .collect();
            (
                codes,
                Some(scales.iter().flat_map(|s| s.to_le_bytes()).collect()),
                vals,
            )
        }
    }
}

/// An activation of `rows x cols` holding `vals`.
pub fn act(
    k: &DecodeKernels,
    pool: &std::rc::Rc<ActPool>,
    rows: usize,
    cols: usize,
    vals: &[f32],
) -> DevAct {
    let mut a = pool
        .take(k.gpu(), rows, cols)
        .expect("an activation buffer");
    a.upload(k.gpu().stream(), vals)
        .expect("upload an activation");
    a
}

/// Largest error against the reference, relative to its largest magnitude.
pub fn worst_rel(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().map(|v| v.abs()).fold(1e-6, f64::max);
    got.iter()
        .zip(want)
        .map(|(g, w)| (f64::from(*g) - w).abs() / scale)
        .fold(0.0, f64::max)
}

/// One expert record: gate | up | down at 4096-aligned offsets, FP8 scales after.
pub fn record(
    rng: &mut SmallRng,
    h: usize,
    i: usize,
    ty: WeightType,
) -> (Vec<u8>, ExpertSpec, [Vec<f64>; 3]) {
    let align = |n: usize| n.div_ceil(4096) * 4096;
    let (g, gs, gv) = random_matrix(rng, i, h, ty);
    let (u, us, uv) = random_matrix(rng, i, h, ty);
    let (d, ds, dv) = random_matrix(rng, h, i, ty);
    let mut rec = Vec::new();
    let mut offs = [0usize; 3];
    for (k, m) in [&g, &u, &d].into_iter().enumerate() {
        offs[k] = rec.len();
        rec.extend_from_slice(m);
        rec.resize(align(rec.len()), 0);
    }
    let mut soffs = [0usize; 3];
    for (k, s) in [gs, us, ds].into_iter().enumerate() {
        if let Some(s) = s {
            soffs[k] = rec.len();
            rec.extend_from_slice(&s);
            rec.resize(align(rec.len()), 0);
        }
    }
    let spec = ExpertSpec {
        hidden: h,
        inter: i,
        ty,
        matrices: offs,
        scales: soffs,
    };
    (rec, spec, [gv, uv, dv])
}

/// Each row's routed experts in f64: `sum_j w[r][j] * down_e(silu(gate_e
/// x[r]) * up_e x[r])` for `e = ids[r * top + j]`, `mats[e]` the expert's
/// gate, up and down values; `(hidden, inter, top)`.
pub fn moe_reference(
    mats: &[&[Vec<f64>; 3]],
    ids: &[u32],
    wts: &[f32],
    x: &[f32],
    (h, i, top): (usize, usize, usize),
) -> Vec<f64> {
    let rows = ids.len() / top;
    let mut want = vec![0f64; rows * h];
    for r in 0..rows {
        for j in 0..top {
            let [gv, uv, dv] = mats[ids[r * top + j] as usize];
            let xr = &x[r * h..(r + 1) * h];
            let a: Vec<f64> = (0..i)
                .map(|o| {
                    let g: f64 = (0..h).map(|c| gv[o * h + c] * f64::from(xr[c])).sum();
                    let u: f64 = (0..h).map(|c| uv[o * h + c] * f64::from(xr[c])).sum();
                    g / (1.0 + (-g).exp()) * u
                })
                .collect();
            for o in 0..h {
                let y: f64 = (0..i).map(|c| dv[o * i + c] * a[c]).sum();
                want[r * h + o] += f64::from(wts[r * top + j]) * y;
            }
        }
    }
    want
}
