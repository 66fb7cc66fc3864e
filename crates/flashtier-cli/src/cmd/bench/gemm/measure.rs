//! The device side of `bench gemm`: one shape's operands on the GPU in
//! each product's form, and the products timed with CUDA events.
//!
//! Each repetition runs every variant once, the first one rotating, so
//! none always inherits another's caches; before each timed product a
//! buffer of twice the L2 size is zeroed (outside the events), so every
//! product reads its weights from HBM. Warm-up runs come first (cuBLAS
//! picks its kernels and allocates its workspace there).
//!
//! Memory: per shape, the weights three times (BF16 for ours and cuBLAS
//! BF16, f32 for cuBLAS f32), the activations twice (f32, BF16), four
//! `[m, n]` f32 outputs, and the scrub buffer once for the run.

use std::rc::Rc;

use anyhow::Context;
use flashtier_cuda::blas::{Blas, BlasMath, GemmDims};
use flashtier_cuda::cudarc::driver::CudaSlice;
use flashtier_cuda::measure::EventTimer;
use flashtier_cuda::ops::DecodeKernels;
use flashtier_cuda::ops::buffers::{ActPool, DevMatrix, WeightType};
use flashtier_cuda::{Gpu, blas};
use serde::Serialize;

use super::shape::{GemmShape, Operands};

/// The products compared, in report order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Variant {
    /// `DecodeKernels::gemm_many`: BF16 weights, f32 activations, one f32
    /// multiply-add chain per output.
    Ours,
    /// cuBLAS on f32 copies, pedantic f32 compute: the exact-f32 peer.
    CublasF32Pedantic,
    /// cuBLAS on f32 copies, default math mode (f32 compute, no TF32).
    CublasF32,
    /// cuBLAS on BF16 weights and BF16-rounded activations, f32
    /// accumulation and outputs: tensor-core speed, not exact.
    CublasBf16,
}

impl Variant {
    /// Every variant, in report order.
    pub const ALL: [Self; 4] = [
        Self::Ours,
        Self::CublasF32Pedantic,
        Self::CublasF32,
        Self::CublasBf16,
    ];

    /// Name in the table.
    #[must_use]
    pub fn label(self) -> &'static str {
        match self {
            Self::Ours => "ours bf16w/f32x",
            Self::CublasF32Pedantic => "cublas f32 pedantic",
            Self::CublasF32 => "cublas f32 default",
            Self::CublasBf16 => "cublas bf16 tensor",
        }
    }
}

/// The device, our kernels, a cuBLAS handle and the L2 scrub buffer.
pub struct Bench {
    /// The device.
    pub gpu: Gpu,
    kernels: DecodeKernels,
    /// The cuBLAS handle.
    pub blas: Blas,
    pool: Rc<ActPool>,
    scrub: CudaSlice<u8>,
}

impl Bench {
    /// Open device 0, compile our kernels and create a cuBLAS handle. A
    /// machine without libcublas fails first, naming the library.
    pub fn open() -> anyhow::Result<Self> {
        if !blas::cublas_present() {
            return Err(blas::no_cublas()).context("flashtier bench gemm compares against cuBLAS");
        }
        let gpu = Gpu::open(0).context("flashtier bench gemm: open GPU 0")?;
        let kernels = DecodeKernels::new(&gpu)?;
        let blas = Blas::new(&gpu)?;
        let scrub_bytes = (2 * gpu.info().l2_bytes).max(64 << 20);
        let scrub = gpu.stream().alloc_zeros::<u8>(scrub_bytes)?;
        Ok(Self {
            gpu,
            kernels,
            blas,
            pool: ActPool::new(),
            scrub,
        })
    }

    /// Bytes zeroed before each timed product.
    #[must_use]
    pub fn scrub_bytes(&self) -> usize {
        self.scrub.len()
    }

    /// The dense tile (`rows x cols`) our kernels were compiled with.
    #[must_use]
    pub fn tile(&self) -> String {
        let t = self.kernels.tile_shapes().0;
        format!("{}x{}", t.rows(), t.cols())
    }

    /// Time every variant on `shape`: `warmup` untimed rounds, then
    /// `reps` timed ones. Per variant (in [`Variant::ALL`] order) the
    /// seconds of every repetition and the whole output.
    pub fn run_shape(
        &mut self,
        shape: GemmShape,
        ops: &Operands,
        warmup: usize,
        reps: usize,
    ) -> anyhow::Result<Vec<(Vec<f64>, Vec<f32>)>> {
        let GemmShape { m, n, k } = shape;
        let gpu = self.gpu.clone();
        let s = gpu.stream();
        let w_bytes: Vec<u8> = ops.w_bf16.iter().flat_map(|b| b.to_le_bytes()).collect();
        let w = DevMatrix::upload(&gpu, n, k, WeightType::Bf16, &w_bytes, None)?;
        let mut x = self.pool.take(&gpu, m, k)?;
        x.upload(s, &ops.x)?;
        let mut ours = self.pool.take(&gpu, m, n)?;
        let w32 = s.clone_htod(&ops.w_f32())?;
        let x32 = s.clone_htod(&ops.x)?;
        let wb = s.clone_htod(&ops.w_bf16)?;
        let xb = s.clone_htod(&ops.x_bf16())?;
        let mut outs = [
            s.alloc_zeros::<f32>(m * n)?,
            s.alloc_zeros::<f32>(m * n)?,
            s.alloc_zeros::<f32>(m * n)?,
        ];
        let dims = GemmDims { m, n, k };
        let (kernels, blas) = (&self.kernels, &self.blas);
        let mut launch = |v: Variant| -> anyhow::Result<()> {
            let [ped, def, b16] = &mut outs;
            match v {
                Variant::Ours => kernels.gemm_many(&mut [&mut ours], &[&w], &x)?,
                Variant::CublasF32Pedantic => {
                    blas.rows_f32(BlasMath::F32Pedantic, dims, &w32, &x32, ped)?;
                }
                Variant::CublasF32 => blas.rows_f32(BlasMath::F32, dims, &w32, &x32, def)?,
                Variant::CublasBf16 => blas.rows_bf16(dims, &wb, &xb, b16)?,
            }
            Ok(())
        };
        for _ in 0..warmup {
            for v in Variant::ALL {
                launch(v)?;
            }
        }
        gpu.synchronize()?;
        let count = Variant::ALL.len();
        let mut secs = vec![Vec::with_capacity(reps); count];
        for rep in 0..reps {
            for i in 0..count {
                let at = (rep + i) % count;
                s.memset_zeros(&mut self.scrub)?;
                let timer = EventTimer::start(s)?;
                launch(Variant::ALL[at])?;
                secs[at].push(timer.stop(s)?);
            }
        }
        gpu.synchronize()?;
        let mut results = Vec::with_capacity(count);
        let mut secs = secs.into_iter();
        results.push((secs.next().unwrap_or_default(), ours.to_host(s)?));
        for (out, t) in outs.iter().zip(secs) {
            results.push((t, s.clone_dtoh(out)?));
        }
        Ok(results)
    }
}
