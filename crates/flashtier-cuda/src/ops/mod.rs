//! The decode engine's kernels (`kernels/decode/`, compiled by NVRTC for
//! the device), behind safe launch functions that check every shape and
//! every byte range before a launch: a kernel never reads or writes outside
//! the buffers it is given.
//!
//! - [`buffers`]: activations (recycled), weight matrices, vectors, RoPE tables.
//! - [`dense`]: matrix-vector products for up to [`MAX_GEMV_ROWS`] rows per
//!   pass (more rows run in passes), embeddings, RMSNorm, RoPE and the
//!   elementwise kernels.
//! - [`gemm`]: a prompt chunk's products as tiles, and its routed experts
//!   grouped by expert.
//! - [`route`]: softmax and grouped-sigmoid top-k routing on the device.
//! - [`experts`]: the HBM expert slots, the device table of record
//!   addresses, and the routed-expert kernels.
//! - [`attn`]: the f32 KV cache and split decode attention.
//! - [`pick`]: the greedy argmax on the device, and the scratch of the
//!   grid-wide kernels (the fused router, the argmax).
//! - [`hint`]: asking L2 for weights a later kernel of the step reads.
//! - [`landing`]: a step's PLE rows into HBM through pinned memory and a
//!   copy stream.
//! - [`hybrid`] and [`sparse`]: the operations of hybrid decoders
//!   (Qwen4-Exp): stream mixers, the causal convolution, the gated delta
//!   rule, and sparse attention over the blocks an indexer keeps.
//!
//! Kernels that wait on their predecessor themselves (`pdl_wait`, listed
//! in the kernel table) may start early inside a recorded step's graph
//! (programmatic dependent launch, [`crate::launch`]): a GEMV asks L2 for
//! its weights while the kernel before it still runs.
//!
//! All work is queued on the [`Gpu`]'s compute stream, in issue order.

pub mod attn;
pub mod buffers;
pub mod dense;
pub mod experts;
pub mod gemm;
pub mod group;
pub mod hint;
pub mod hybrid;
pub mod landing;
pub mod lt;
pub mod mma;
pub mod moe;
pub mod norm;
pub mod pick;
pub mod route;
pub mod sparse;

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaModule, CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};

use crate::context::Gpu;
use crate::error::CudaError;
use crate::nvrtc::load_module;

pub use crate::settings::{
    DEFAULT_ATTN_AHEAD as ATTN_AHEAD, DEFAULT_DOWN_ROWS as DOWN_ROWS,
    DEFAULT_GEMV_LOADS as GEMV_LOADS, MAX_ATTN_AHEAD, MAX_DOWN_ROWS, MAX_GEMV_LOADS, Tuning,
};

/// Source of the decode kernels: the shared definitions, then each part
/// of `kernels/decode/` (later parts use earlier ones).
pub const DECODE_SRC: &str = concat!(
    include_str!("../kernels/common.cuh"),
    "\n",
    include_str!("../kernels/decode/gemv.cu"),
    "\n",
    include_str!("../kernels/decode/moe.cu"),
    "\n",
    include_str!("../kernels/decode/gemm.cu"),
    "\n",
    include_str!("../kernels/decode/mma.cu"),
    "\n",
    include_str!("../kernels/decode/route.cu"),
    "\n",
    include_str!("../kernels/decode/elementwise.cu"),
    "\n",
    include_str!("../kernels/decode/attend.cu"),
    "\n",
    include_str!("../kernels/decode/prompt_attn.cu"),
    "\n",
    include_str!("../kernels/decode/prompt_attn_tc.cu"),
    "\n",
    include_str!("../kernels/decode/hybrid.cu")
);

/// Rows one matrix-vector pass reads the weights for.
pub const MAX_GEMV_ROWS: usize = 8;

/// The kernels, and whether each starts with `griddepcontrol.wait` and
/// touches nothing an earlier kernel writes before it (`pdl_wait` in
/// kernels/decode/gemv.cu): a recorded graph may start those early. Only
/// the bandwidth probe does not wait (it never runs in a step).
pub(crate) const KERNELS: &[(&str, bool)] = &[
    ("gemv_bf16", true),
    ("gemv_f16", true),
    ("gemv_f32", true),
    ("gemv_fp8", true),
    ("gemv1_bf16", true),
    ("gemv1_f16", true),
    ("gemv1_f32", true),
    ("gemv1_fp8", true),
    ("moe_gate_up_bf16", true),
    ("moe_gate_up_f16", true),
    ("moe_gate_up_f32", true),
    ("moe_gate_up_fp8", true),
    ("moe_down_bf16", true),
    ("moe_down_f16", true),
    ("moe_down_f32", true),
    ("moe_down_fp8", true),
    ("gemm_bf16", true),
    ("gemm_f16", true),
    ("gemm_f32", true),
    ("gemm_fp8", true),
    ("moe_group_gate_up_bf16", true),
    ("moe_group_gate_up_f16", true),
    ("moe_group_gate_up_f32", true),
    ("moe_group_gate_up_fp8", true),
    ("moe_group_down_bf16", true),
    ("moe_group_down_f16", true),
    ("moe_group_down_f32", true),
    ("moe_group_down_fp8", true),
    ("moe_group_sum", true),
    ("group_count", true),
    ("group_offsets", true),
    ("group_place", true),
    ("split_bf16_rows", true),
    ("gemm_mma_bf16", true),
    ("moe_group_gate_up_mma_bf16", true),
    ("moe_group_down_mma_bf16", true),
    ("route_softmax", true),
    ("route_sigmoid_groups", true),
    ("router_softmax_bf16", true),
    ("router_softmax_f16", true),
    ("router_softmax_f32", true),
    ("router_softmax_fp8", true),
    ("rms_norm", true),
    ("add_rms_norm", true),
    ("add_inplace", true),
    ("add_bias", true),
    ("silu_mul", true),
    ("add_gated", true),
    ("copy_heads", true),
    ("rope", true),
    ("qk_norm_rope", true),
    ("embed_bf16", true),
    ("embed_f16", true),
    ("embed_f32", true),
    ("embed_fp8", true),
    ("argmax_rows", true),
    ("argmax_grid", true),
    ("prefetch_spans", true),
    ("kv_append", true),
    ("attn_partial", true),
    ("attn_merge", true),
    ("kv_append_rows", true),
    ("attn_rows_partial", true),
    ("attn_rows_merge", true),
    ("attn_prompt_64", true),
    ("attn_prompt_128", true),
    ("attn_prompt_256", true),
    ("attn_prompt_tc_64", true),
    ("attn_prompt_tc_128", true),
    ("zero_fill", true),
    ("rms_norm_wide", true),
    ("hy_map", true),
    ("mul_sigmoid", true),
    ("hc_mix", true),
    ("hc_inject", true),
    ("causal_conv", true),
    ("gated_delta", true),
    ("gated_delta_cols", true),
    ("gated_norm", true),
    ("ple_gate", true),
    ("sparse_append", true),
    ("sparse_block_keys", true),
    ("sparse_select", true),
    ("sparse_attend", true),
    ("read_words", false),
];

/// Let kernel `name` take `bytes` of dynamic shared memory; false where it
/// is not loaded or the device refuses (its blocks cannot have that much).
pub(crate) fn give_smem(
    funcs: &HashMap<&'static str, (CudaFunction, bool)>,
    name: &str,
    bytes: usize,
) -> bool {
    let bytes = i32::try_from(bytes).unwrap_or(i32::MAX);
    funcs.get(name).is_some_and(|(f, _)| {
        f.set_attribute(
            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes,
        )
        .is_ok()
    })
}

impl Tuning {
    /// The defaults, each overridden by its environment variable
    /// ([`crate::settings`]; a value out of range is an error naming it).
    pub fn from_env() -> Result<Self, CudaError> {
        Ok(Tuning::read(&flashtier_io::settings::Env::process())?)
    }

    /// The knobs clamped into their ranges.
    fn clamped(self) -> Self {
        Self {
            gemv_loads: self.gemv_loads.clamp(1, MAX_GEMV_LOADS),
            attn_ahead: self.attn_ahead.clamp(1, MAX_ATTN_AHEAD),
            down_rows: self.down_rows.clamp(1, MAX_DOWN_ROWS),
            mma_bk: if self.mma_bk == 32 { 32 } else { 64 },
            ..self
        }
    }

    /// The defines the decode kernels are compiled with for these knobs
    /// (clamped into their ranges).
    pub(crate) fn defines(&self) -> Vec<(&'static str, String)> {
        let t = self.clamped();
        let flag = |b: bool| if b { "1" } else { "0" }.to_owned();
        vec![
            ("STREAM_WEIGHTS", flag(t.stream_weights)),
            ("DOWN_ROWS", t.down_rows.to_string()),
            ("ATTN_AHEAD", t.attn_ahead.to_string()),
            ("GEMV_LOADS", t.gemv_loads.to_string()),
            ("GEMM_TM", t.tiles.0.tm.to_string()),
            ("GEMM_TN", t.tiles.0.tn.to_string()),
            ("GROUP_TM", t.tiles.1.tm.to_string()),
            ("GROUP_TN", t.tiles.1.tn.to_string()),
            ("MMA_BK", t.mma_bk.to_string()),
            ("PT_PIPE", flag(t.prompt_attn_pipe)),
        ]
    }
}

/// The compiled decode kernels of one device.
pub struct DecodeKernels {
    gpu: Gpu,
    _module: Arc<CudaModule>,
    funcs: HashMap<&'static str, (CudaFunction, bool)>,
    routes_pool: Arc<route::RoutePool>,
    scratch: pick::Scratch,
    picks: pick::Picks,
    /// Prompt chunks' products as tiles and their experts grouped
    /// ([`gemm`]); off ([`crate::settings::PROMPT_TILES`]), they run as
    /// GEMV passes and (row, expert) pairs instead.
    tiles_on: bool,
    /// BF16 tiles on the tensor cores ([`mma`]; [`crate::settings::PROMPT_MMA`]
    /// and a device of compute capability 8.0 or later).
    mma_on: bool,
    /// A BF16 prompt's dense products through cuBLASLt ([`lt`];
    /// [`crate::settings::PROMPT_BLAS`], where the tensor-core tiles would
    /// run and libcublasLt loads).
    lt: Option<lt::LtProducts>,
    /// A prompt chunk's attention as tiles of queries
    /// ([`crate::settings::PROMPT_ATTN`]).
    prompt_attn_on: bool,
    /// The head widths whose tiled prompt attention was given its shared
    /// memory (a device that cannot gives a wider head the per-row kernel).
    prompt_attn_widths: Vec<usize>,
    /// The head widths whose tensor-core prompt attention was given its
    /// shared memory; empty where [`crate::settings::PROMPT_ATTN_TC`] is
    /// off or the device predates compute capability 8.0 (`attn::prompt`).
    prompt_attn_tc_widths: Vec<usize>,
    /// The BF16 parts of the input of a product on the tensor cores
    /// ([`mma`]), grown to the largest and reused.
    split: std::cell::RefCell<Option<CudaSlice<u16>>>,
    /// The dense and grouped tile shapes compiled in.
    tiles: (gemm::TileShape, gemm::TileShape),
    /// Output rows per block of the experts' down product (compiled in).
    down_rows: usize,
    /// Group a resident prompt step's pairs on the device
    /// ([`crate::settings::DEVICE_GROUPS`]).
    device_groups: bool,
}

impl std::fmt::Debug for DecodeKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeKernels")
            .field("kernels", &self.funcs.len())
            .finish()
    }
}

impl DecodeKernels {
    /// Compile and load the kernels for the device of `gpu`, tuned as the
    /// environment says ([`Tuning::from_env`], [`crate::settings`]: the
    /// evict-first hint, [`GEMV_LOADS`], [`ATTN_AHEAD`], [`DOWN_ROWS`], the
    /// tiled prompt products and their tile shapes, none of which changes a
    /// result bit; and whether BF16 tiles run on the tensor cores, which
    /// changes the rounding, see [`mma`], and whether a prompt chunk's
    /// attention runs as tiles, which sums in another order, see [`attn`]).
    pub fn new(gpu: &Gpu) -> Result<Self, CudaError> {
        Self::with_tuning(gpu, Tuning::from_env()?)
    }

    /// Compile and load the kernels with the knobs of `t` (none of them
    /// changes a result bit but `prompt_mma` and `prompt_attn`; tests
    /// build several to show it).
    pub fn with_tuning(gpu: &Gpu, t: Tuning) -> Result<Self, CudaError> {
        let t = t.clamped();
        let (module, _) = load_module(gpu, "decode", DECODE_SRC, &t.defines())?;
        let mut funcs = HashMap::with_capacity(KERNELS.len());
        for &(name, waits) in KERNELS {
            let f = module
                .load_function(name)
                .map_err(CudaError::driver(format!("load kernel {name}")))?;
            funcs.insert(name, (f, waits));
        }
        let prompt_attn_widths =
            attn::prompt_attn_widths(&funcs, &attn::PROMPT_ATTN_KERNELS, attn::prompt_attn_smem);
        let prompt_attn_tc_widths = if t.prompt_attn_tc && gpu.info().compute_capability.0 >= 8 {
            attn::prompt_attn_widths(
                &funcs,
                &attn::PROMPT_ATTN_TC_KERNELS,
                attn::prompt_attn_tc_smem,
            )
        } else {
            Vec::new()
        };
        let mma_on = t.prompt_mma && gpu.info().compute_capability.0 >= 8;
        Ok(Self {
            gpu: gpu.clone(),
            _module: module,
            funcs,
            routes_pool: Arc::new(route::RoutePool::new(gpu.clone())),
            scratch: pick::Scratch::new(gpu)?,
            picks: pick::Picks::new(gpu)?,
            tiles_on: t.prompt_tiles,
            mma_on,
            lt: (mma_on && t.prompt_blas)
                .then(|| lt::LtProducts::open(gpu))
                .flatten(),
            prompt_attn_on: t.prompt_attn,
            prompt_attn_widths,
            prompt_attn_tc_widths,
            split: std::cell::RefCell::new(None),
            tiles: t.tiles,
            down_rows: t.down_rows as usize,
            device_groups: t.device_groups,
        })
    }

    /// The device.
    #[must_use]
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    pub(crate) fn func(&self, name: &str) -> Result<&CudaFunction, CudaError> {
        self.funcs
            .get(name)
            .map(|(f, _)| f)
            .ok_or_else(|| CudaError::invalid("kernel", format!("{name} is not loaded")))
    }

    /// Launch kernel `name` through the [`Gpu`] (queued while a step
    /// records).
    ///
    /// # Safety
    /// `args` match the kernel's parameters, and every buffer they point to
    /// stays allocated until the kernel ran (see [`Gpu::retire`]).
    pub(crate) unsafe fn launch(
        &self,
        name: &str,
        cfg: LaunchConfig,
        args: crate::launch::Args,
    ) -> Result<(), CudaError> {
        let (&name, (f, waits)) = self
            .funcs
            .get_key_value(name)
            .ok_or_else(|| CudaError::invalid("kernel", format!("{name} is not loaded")))?;
        // SAFETY: the caller's promise, passed on; `waits` is the kernel's
        // own (KERNELS, checked against the sources by a unit test).
        unsafe { self.gpu.launch((name, *waits), f, cfg, args) }
    }
}

impl DecodeKernels {
    /// HBM read bandwidth, bytes/s: the median of `reps` timed passes of a
    /// kernel reading every 16-byte word of a `bytes`-byte buffer once,
    /// after a warm-up (the ceiling of the memory-bound decode kernels).
    pub fn read_bandwidth(&self, bytes: usize, reps: usize) -> Result<f64, CudaError> {
        let words = bytes / 16;
        if words == 0 {
            return Err(CudaError::invalid(
                "read bandwidth",
                format!("{bytes} bytes"),
            ));
        }
        let stream = self.gpu.stream();
        let buf = stream
            .alloc_zeros::<u8>(words * 16)
            .map_err(CudaError::driver("allocate the read buffer"))?;
        let mut sink = stream
            .alloc_zeros::<u32>(1)
            .map_err(CudaError::driver("allocate the read sink"))?;
        let blocks = self.gpu.info().sm_count.max(1) * 4;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (512, 1, 1),
            shared_mem_bytes: 0,
        };
        let n = words as i64;
        let mut rates = Vec::with_capacity(reps + 1);
        for rep in 0..=reps.max(1) {
            let timer = crate::measure::EventTimer::start(stream)?;
            let mut b = stream.launch_builder(self.func("read_words")?);
            b.arg(&buf).arg(&n).arg(&mut sink);
            // SAFETY: matches `read_words`, which reads words 0..n of `buf`
            // (n * 16 bytes allocated) and at most writes sink[0].
            unsafe { b.launch(cfg) }.map_err(CudaError::driver("launch read_words"))?;
            let secs = timer.stop(stream)?;
            if rep > 0 {
                rates.push((words * 16) as f64 / secs);
            }
        }
        Ok(flashtier_io::measure::median(&rates))
    }
}

/// Device address of element `offset` of `buf`.
pub(crate) fn addr<T>(gpu: &Gpu, buf: &CudaSlice<T>, offset: usize) -> u64 {
    let (p, _sync) = buf.device_ptr(gpu.raw_stream());
    p + (offset * std::mem::size_of::<T>()) as u64
}

/// A 1-D launch of `n` threads in blocks of `block`.
pub(crate) fn linear_cfg(n: usize, block: u32) -> Result<LaunchConfig, CudaError> {
    let blocks = n.div_ceil(block as usize);
    let blocks = u32::try_from(blocks.max(1))
        .map_err(|_| CudaError::invalid("launch", format!("{n} threads")))?;
    Ok(LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// A grid dimension from a count, or an error.
pub(crate) fn dim(n: usize, what: &'static str) -> Result<u32, CudaError> {
    u32::try_from(n)
        .ok()
        .filter(|d| (1..=65_535).contains(d))
        .ok_or_else(|| CudaError::invalid("launch", format!("{what} grid dimension {n}")))
}

/// A `(x, y)` grid of 256-thread blocks (the kernels that give each block
/// one output element and its warps the parts of it).
pub(crate) fn blocks_cfg(x: usize, y: usize) -> Result<LaunchConfig, CudaError> {
    Ok(LaunchConfig {
        grid_dim: (dim(x.max(1), "x")?, dim(y, "y")?, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::{DECODE_SRC, KERNELS, Tuning};

    /// Every kernel source compiles with NVRTC alone, no GPU needed, for
    /// Hopper (the H100 and H200 the engine is measured on) and Ampere, at
    /// the default knobs and at the other extremes of the compiled-in ones:
    /// a CPU-only CI then catches a kernel that does not compile (`.ci/run`
    /// installs NVIDIA's NVRTC wheel for this). Skips, saying so, where
    /// libnvrtc is absent.
    #[test]
    fn kernel_sources_compile_without_a_gpu() {
        if !crate::nvrtc_present() {
            flashtier_io::skip::notice(
                "kernel_sources_compile_without_a_gpu",
                "no NVRTC: libnvrtc could not be loaded (pip install nvidia-cuda-nvrtc, then put its \
                 lib folder on LD_LIBRARY_PATH)",
            );
            return;
        }
        let other = Tuning {
            stream_weights: false,
            gemv_loads: 1,
            attn_ahead: 8,
            down_rows: 16,
            mma_bk: 32,
            ..Tuning::default()
        };
        let names: Vec<&str> = KERNELS.iter().map(|k| k.0).collect();
        for arch in ["sm_90", "sm_80"] {
            for t in [Tuning::default(), other] {
                let cubin = crate::nvrtc::compile_cubin("decode", DECODE_SRC, arch, &t.defines())
                    .unwrap_or_else(|e| panic!("{arch} {t:?}: {e}"));
                for name in &names {
                    assert!(
                        cubin.log.contains(&format!("'{name}'")),
                        "{arch}: kernel {name} is not in the compiled module"
                    );
                }
            }
            crate::nvrtc::compile_cubin("util", crate::nvrtc::UTIL_SRC, arch, &[])
                .unwrap_or_else(|e| panic!("{arch} util: {e}"));
        }
    }

    /// Every kernel the table says waits calls `pdl_enter` itself or
    /// through the helper its body runs; only the bandwidth probe does not
    /// (it never runs inside a step).
    #[test]
    fn kernels_marked_waiting_wait() {
        let plain: Vec<&str> = KERNELS.iter().filter(|k| !k.1).map(|k| k.0).collect();
        assert_eq!(plain, ["read_words"]);
        for helper in [
            "void gemv_multi(",
            "void moe_gate_up(",
            "void moe_down(",
            "void embed_rows(",
            "void gemm_multi(",
            "void moe_group_gate_up(",
            "void moe_group_down(",
        ] {
            let at = DECODE_SRC
                .find(helper)
                .unwrap_or_else(|| panic!("{helper}"));
            let body = &DECODE_SRC[at..];
            let end = body.find("\n}\n").unwrap_or(body.len());
            assert!(body[..end].contains("pdl_enter();"), "{helper}");
        }
        let calls = [
            "gemv_multi<",
            "moe_gate_up<",
            "moe_down<",
            "embed_rows<",
            "gemm_multi<",
            "moe_group_gate_up<",
            "moe_group_down<",
        ];
        for chunk in DECODE_SRC.split("__global__").skip(1) {
            let kernel = chunk.split("\n}\n").next().unwrap_or(chunk);
            if plain.iter().any(|n| kernel.contains(&format!("{n}("))) {
                continue;
            }
            assert!(
                kernel.contains("pdl_enter();") || calls.iter().any(|c| kernel.contains(c)),
                "a kernel marked waiting does not wait:\n{kernel}"
            );
        }
    }
}
