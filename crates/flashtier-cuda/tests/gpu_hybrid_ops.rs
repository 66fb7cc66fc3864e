//! Hybrid decoders' kernels (Qwen4-Exp) against f64 references at the
//! real model's shapes and at edge shapes: the gated delta rule with its
//! state in registers (key heads of 128, a partial column tile) and with a
//! thread per column (key heads wider than the register kernel takes),
//! rows fed one launch at a time giving the bits of one launch over all of
//! them; and PLE rows landed through pinned memory on a copy stream, slot
//! after slot, read by the kernels queued after them. Skips with a printed
//! reason where there is no GPU.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers: a broken kernel must fail the test loudly"
)]

mod common;

use flashtier_cuda::ops::DecodeKernels;
use flashtier_cuda::ops::buffers::{ActPool, DevVector};
use flashtier_cuda::ops::hybrid::{DeltaHeads, MAX_DELTA_K_DIM_REGS, MapFn};
use flashtier_cuda::ops::landing::RowLanding;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use common::{act, gpu_or_skip, worst_rel};

/// The delta rule's inputs for `rows` rows.
struct DeltaCase {
    h: DeltaHeads,
    rows: usize,
    state: Vec<f32>,
    mixed: Vec<f32>,
    b: Vec<f32>,
    a: Vec<f32>,
    a_exp: Vec<f32>,
    dt_bias: Vec<f32>,
}

impl DeltaCase {
    fn random(h: DeltaHeads, rows: usize, seed: u64) -> Self {
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut v = |n: usize, lo: f32, hi: f32| -> Vec<f32> {
            (0..n).map(|_| rng.random_range(lo..hi)).collect()
        };
        let mc = 2 * h.k_heads * h.k_dim + h.v_heads * h.v_dim;
        Self {
            state: v(h.v_heads * h.k_dim * h.v_dim, -0.5, 0.5),
            mixed: v(rows * mc, -1.0, 1.0),
            b: v(rows * h.v_heads, -2.0, 2.0),
            a: v(rows * h.v_heads, -2.0, 2.0),
            a_exp: v(h.v_heads, 0.1, 1.0),
            dt_bias: v(h.v_heads, -0.5, 0.5),
            h,
            rows,
        }
    }

    /// The recurrence in f64: (outputs, final state).
    fn reference(&self) -> (Vec<f64>, Vec<f64>) {
        let h = &self.h;
        let (kd, vd) = (h.k_dim, h.v_dim);
        let kw = h.k_heads * kd;
        let mc = 2 * kw + h.v_heads * vd;
        let mut s: Vec<f64> = self.state.iter().map(|&x| f64::from(x)).collect();
        let mut out = vec![0f64; self.rows * h.v_heads * vd];
        for r in 0..self.rows {
            let row = &self.mixed[r * mc..(r + 1) * mc];
            for hv in 0..h.v_heads {
                let kh = hv / (h.v_heads / h.k_heads);
                let norm = |x: &[f32]| {
                    let n = x.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>();
                    let inv = 1.0 / (n + 1e-6).sqrt();
                    x.iter().map(|&v| f64::from(v) * inv).collect::<Vec<f64>>()
                };
                let scale = 1.0 / (kd as f64).sqrt();
                let q: Vec<f64> = norm(&row[kh * kd..(kh + 1) * kd])
                    .into_iter()
                    .map(|v| v * scale)
                    .collect();
                let k = norm(&row[kw + kh * kd..kw + (kh + 1) * kd]);
                let x = f64::from(self.b[r * h.v_heads + hv]);
                let beta = 1.0 / (1.0 + (-x).exp());
                let y = f64::from(self.a[r * h.v_heads + hv]) + f64::from(self.dt_bias[hv]);
                let softplus = if y > 20.0 { y } else { y.exp().ln_1p() };
                let decay = (-f64::from(self.a_exp[hv]) * softplus).exp();
                let st = &mut s[hv * kd * vd..(hv + 1) * kd * vd];
                for j in 0..vd {
                    let mut delta = 0.0;
                    for i in 0..kd {
                        st[i * vd + j] *= decay;
                        delta += st[i * vd + j] * k[i];
                    }
                    let d = (f64::from(row[2 * kw + hv * vd + j]) - delta) * beta;
                    let mut o = 0.0;
                    for i in 0..kd {
                        st[i * vd + j] += k[i] * d;
                        o += st[i * vd + j] * q[i];
                    }
                    out[r * h.v_heads * vd + hv * vd + j] = o;
                }
            }
        }
        (out, s)
    }
}

/// Run the kernel over rows `from..to` of `c` on `state` (on the device).
fn run_rows(
    k: &DecodeKernels,
    pool: &std::rc::Rc<ActPool>,
    c: &DeltaCase,
    state: &mut flashtier_cuda::ops::buffers::DevAct,
    (from, to): (usize, usize),
) -> Vec<f32> {
    let h = c.h;
    let n = to - from;
    let mc = 2 * h.k_heads * h.k_dim + h.v_heads * h.v_dim;
    let gpu = k.gpu();
    let mixed = act(k, pool, n, mc, &c.mixed[from * mc..to * mc]);
    let b = act(
        k,
        pool,
        n,
        h.v_heads,
        &c.b[from * h.v_heads..to * h.v_heads],
    );
    let a = act(
        k,
        pool,
        n,
        h.v_heads,
        &c.a[from * h.v_heads..to * h.v_heads],
    );
    let a_exp = DevVector::upload(gpu, &c.a_exp).unwrap();
    let dt_bias = DevVector::upload(gpu, &c.dt_bias).unwrap();
    let mut out = pool.take(gpu, n, h.v_heads * h.v_dim).unwrap();
    k.gated_delta(state, &mixed, (&b, &a), (&a_exp, &dt_bias), h, &mut out)
        .unwrap();
    out.to_host(gpu.stream()).unwrap()
}

#[test]
fn delta_rule_matches_f64_and_rows_one_at_a_time_give_the_same_bits() {
    let Some(gpu) = gpu_or_skip("delta_rule_matches_f64_and_rows_one_at_a_time") else {
        return;
    };
    let k = DecodeKernels::new(&gpu).unwrap();
    let pool = ActPool::new();
    let heads = |k_heads, v_heads, k_dim, v_dim| DeltaHeads {
        k_heads,
        v_heads,
        k_dim,
        v_dim,
    };
    let cases = [
        // Qwen4-Exp's heads (16 key heads of 128, 32 value heads), fewer.
        (heads(2, 4, 128, 128), 33),
        (heads(2, 4, 128, 128), 1),
        // A partial column tile, few state rows per warp, one key head.
        (heads(1, 3, 16, 40), 5),
        // Wider than the register kernel: a thread per column.
        (heads(1, 2, MAX_DELTA_K_DIM_REGS + 64, 48), 3),
    ];
    for (i, (h, rows)) in cases.into_iter().enumerate() {
        let c = DeltaCase::random(h, rows, 11 + i as u64);
        let (want_out, want_state) = c.reference();
        let cols = h.k_dim * h.v_dim;
        let mut state = act(&k, &pool, h.v_heads, cols, &c.state);
        let got = run_rows(&k, &pool, &c, &mut state, (0, rows));
        let got_state = state.to_host(gpu.stream()).unwrap();
        let (e_out, e_state) = (
            worst_rel(&got, &want_out),
            worst_rel(&got_state, &want_state),
        );
        println!("{h:?} x {rows} rows: output {e_out:.2e}, state {e_state:.2e}");
        assert!(e_out < 5e-5 && e_state < 5e-5, "{h:?}: {e_out} {e_state}");
        // The same rows, one launch each, from the same starting state.
        let mut one = act(&k, &pool, h.v_heads, cols, &c.state);
        let mut each = Vec::new();
        for r in 0..rows {
            each.extend(run_rows(&k, &pool, &c, &mut one, (r, r + 1)));
        }
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&each), bits(&got), "{h:?}: outputs row by row");
        assert_eq!(
            bits(&one.to_host(gpu.stream()).unwrap()),
            bits(&got_state),
            "{h:?}: state row by row"
        );
    }
}

#[test]
fn landed_rows_reach_the_kernels_queued_after_them_slot_after_slot() {
    let Some(gpu) = gpu_or_skip("landed_rows_reach_the_kernels_queued_after_them") else {
        return;
    };
    let k = DecodeKernels::new(&gpu).unwrap();
    let pool = ActPool::new();
    let cols = 96;
    let mut landing = RowLanding::new(&gpu, cols).unwrap();
    assert!(landing.rows().is_err(), "nothing landed yet");
    assert!(
        landing.land(2, &[0.0; 96]).is_err(),
        "2 rows need 192 values"
    );
    let mut rng = SmallRng::seed_from_u64(5);
    // Decode steps (one row) and prompt chunks (several), so both slots
    // see their buffers replaced and reused.
    for (step, rows) in [1usize, 1, 7, 1, 1, 3, 3, 1].into_iter().enumerate() {
        let vals: Vec<f32> = (0..rows * cols)
            .map(|_| rng.random_range(-4.0..4.0))
            .collect();
        landing.land(rows, &vals).unwrap();
        // A kernel on the compute stream reads the rows: x = silu(rows).
        let mut x = pool.take(&gpu, rows, cols).unwrap();
        k.copy_rows(&mut x, 0, landing.rows().unwrap(), 0, rows)
            .unwrap();
        k.map(&mut x, MapFn::Silu { div: 1.0 }).unwrap();
        landing.read_done().unwrap();
        let got = x.to_host(gpu.stream()).unwrap();
        let want: Vec<f64> = vals
            .iter()
            .map(|&v| f64::from(v) / (1.0 + (-f64::from(v)).exp()))
            .collect();
        let e = worst_rel(&got, &want);
        assert!(e < 1e-6, "step {step} ({rows} rows): {e}");
    }
}
