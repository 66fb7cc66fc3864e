//! FP8 E4M3 -> BF16 dequant on the GPU against the rows tier's CPU reference
//! (`flashtier::rows::fp8`) and the host decode, bit for bit, over every byte
//! value (NaN included) in packed Engram rows. Skips without a GPU.

mod common;

use common::{bf16, gpu_or_skip};
use flashtier::rows::ScaleFormat;
use flashtier_cuda::{Fp8Rows, UtilKernels};
use flashtier_format::fp8::e4m3_to_f32;
use rand::{Rng, SeedableRng};

#[test]
fn dequant_matches_host_decode() {
    let Some(gpu) = gpu_or_skip("dequant_matches_host_decode") else {
        return;
    };
    let kernels = UtilKernels::new(&gpu).expect("compile util kernels");
    // Packed Engram rows: 256 B of weights then 8 B (here two f32 group
    // scales live in a separate array; the stride skips the scale bytes).
    let geom = Fp8Rows {
        rows: 67,
        cols: 256,
        row_stride_bytes: 264,
        group: 128,
        scale_stride: 2,
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let mut w = vec![0u8; geom.rows * geom.row_stride_bytes];
    for (i, b) in w.iter_mut().enumerate() {
        *b = if i < 256 { i as u8 } else { rng.random() };
    }
    let scales: Vec<f32> = (0..geom.rows * 2)
        .map(|_| rng.random::<f32>() * 4.0 - 2.0)
        .collect();
    let s = gpu.stream();
    let dw = s.clone_htod(&w).expect("upload weights");
    let ds = s.clone_htod(&scales).expect("upload scales");
    let mut out = s.alloc_zeros::<u16>(geom.rows * geom.cols).expect("alloc");
    kernels
        .dequant_e4m3(&dw, &ds, geom, &mut out)
        .expect("dequant");
    let got = s.clone_dtoh(&out).expect("download");
    let mut nans = 0;
    for r in 0..geom.rows {
        // The rows tier's CPU reference on the packed row: weights, then the
        // two f32 block scales as little-endian bytes.
        let weight = &w[r * geom.row_stride_bytes..][..geom.cols];
        let scale: Vec<u8> = scales[r * 2..r * 2 + 2]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let mut want = vec![half::bf16::ZERO; geom.cols];
        flashtier::rows::fp8::dequant_row_bf16(weight, &scale, ScaleFormat::F32Blocks, &mut want)
            .expect("rows reference");
        for c in 0..geom.cols {
            let x = e4m3_to_f32(weight[c]) * scales[r * 2 + c / 128];
            let g = got[r * geom.cols + c];
            if x.is_nan() {
                nans += 1;
                assert!(
                    half::bf16::from_bits(g).is_nan(),
                    "row {r} col {c}: NaN expected"
                );
                assert!(
                    want[c].is_nan(),
                    "row {r} col {c}: the rows reference agrees"
                );
            } else {
                assert_eq!(g, bf16(x), "row {r} col {c}: {x}");
                assert_eq!(g, want[c].to_bits(), "row {r} col {c}: rows reference");
            }
        }
    }
    assert!(nans >= 2, "the byte sweep covers 0x7F and 0xFF");
}

#[test]
fn bad_geometry_is_rejected() {
    let Some(gpu) = gpu_or_skip("bad_geometry_is_rejected") else {
        return;
    };
    let kernels = UtilKernels::new(&gpu).expect("compile util kernels");
    let s = gpu.stream();
    let dw = s.alloc_zeros::<u8>(256).expect("w");
    let ds = s.alloc_zeros::<f32>(2).expect("s");
    let mut out = s.alloc_zeros::<u16>(256).expect("out");
    let geom = Fp8Rows {
        rows: 2,
        cols: 256,
        row_stride_bytes: 256,
        group: 128,
        scale_stride: 2,
    };
    assert!(
        kernels.dequant_e4m3(&dw, &ds, geom, &mut out).is_err(),
        "two rows do not fit one row of bytes"
    );
}
