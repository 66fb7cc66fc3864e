//! Tiled decode attention on the GPU, with the CPU reference's contract
//! (`flashtier::kv`): `begin_step` resets the running (m, l, o) state of every
//! (sequence, query head), `step_tile` folds one tile of KV blocks into it
//! with the online softmax, `finalize` writes `o / l` as BF16.
//!
//! - GQA: `num_q_heads` is a multiple of `num_kv_heads`; the query heads of
//!   one KV head are computed together (the KV bytes are read once per group).
//! - Layouts: any stride triple (block, token, kv head) in elements
//!   ([`KvStrides`], the workspace's one KV tile layout), e.g. the paged
//!   `[block, token, kv_head, dim]` ([`KvStrides::paged`]) and the slot
//!   `[slot, K|V, kv_head, token, dim]` ([`KvStrides::slot`]) layouts.
//! - The last block of a sequence may be partly filled.
//! - Split-KV (flash-decoding): each tile is cut into splits so that the whole
//!   GPU streams it; partial (m, l, o) are merged with a log-sum-exp.
//!
//! Kernel limits, checked with a typed error: `head_dim` a multiple of 16 and
//! at most 256; strides multiples of 8 elements (16-byte vector loads).
//!
//! Bounds: the state is sized once for `max_seqs` and reused every step; the
//! split partials for at most [`MAX_SPLITS`] splits per (sequence, head).

use std::sync::Arc;

use cudarc::driver::sys::CUfunction_attribute_enum as FnAttr;
use cudarc::driver::{
    CudaFunction, CudaModule, CudaSlice, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
};

use flashtier_format::kv::KvStrides;

use crate::context::Gpu;
use crate::error::CudaError;
use crate::nvrtc::{ATTENTION_SRC, load_module};
use crate::plan::{WARPS, plan_splits};

pub use crate::plan::MAX_SPLITS;
use shape::tile_tokens;
pub use shape::{AttnDims, MAX_HEAD_DIM, MAX_SEQS, TileTable};

mod check;
mod config;
mod merge;
mod shape;

use config::{MAX_STAGES, env_flag_or, split_smem_bytes};
pub(crate) use config::{split_stages, use_kreg};

#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct SplitArgs {
    num_q_heads: i32,
    group: i32,
    block_size: i32,
    tile_capacity: i32,
    blk_stride: i64,
    tok_stride: i64,
    kvh_stride: i64,
    sub_total: i32,
    scale_log2: f32,
}

// SAFETY: plain-old-data with the same C layout as `SplitArgs` in attention.cu.
unsafe impl DeviceRepr for SplitArgs {}

/// The GPU decode attention of one shape.
pub struct DecodeAttention {
    gpu: Gpu,
    dims: AttnDims,
    _module: Arc<CudaModule>,
    f_split: CudaFunction,
    f_merge: CudaFunction,
    f_finalize: CudaFunction,
    split_smem_bytes: u32,
    stages: usize,
    ctas_per_sm: u32,
    st_m: CudaSlice<f32>,
    st_l: CudaSlice<f32>,
    st_o: CudaSlice<f32>,
    part_m: CudaSlice<f32>,
    part_l: CudaSlice<f32>,
    part_o: CudaSlice<f32>,
    scale: f32,
    step_seqs: Option<usize>,
    fresh: bool,
    pdl: bool,
    pdl_split: bool,
    splits_override: Option<usize>,
    ptxas_log: String,
}

impl std::fmt::Debug for DecodeAttention {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeAttention")
            .field("dims", &self.dims)
            .field("ctas_per_sm", &self.ctas_per_sm)
            .finish()
    }
}

impl DecodeAttention {
    /// Compile the kernels for `dims.head_dim` and allocate the state. The
    /// softmax scale is `1 / sqrt(head_dim)`.
    pub fn new(gpu: &Gpu, dims: AttnDims) -> Result<Self, CudaError> {
        dims.validate()?;
        let kreg = use_kreg(dims.head_dim);
        // FLASHTIER_ATTN_STAGES overrides the depth (tuning runs only).
        let stages = std::env::var("FLASHTIER_ATTN_STAGES")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .map_or_else(
                || {
                    let info = gpu.info();
                    split_stages(
                        dims.head_dim,
                        kreg,
                        info.smem_per_sm_bytes,
                        info.max_smem_per_block_optin_bytes,
                    )
                },
                |v| v.clamp(2, MAX_STAGES),
            );
        let (module, cubin) = load_module(
            gpu,
            &format!("attention_d{}", dims.head_dim),
            ATTENTION_SRC,
            &[
                ("HEAD_DIM", dims.head_dim.to_string()),
                ("STAGES", stages.to_string()),
                ("KREG", u8::from(kreg).to_string()),
                // KV copies: L2 128-byte prefetch hint and evict-first policy
                // (measured on the H200: 43.4 -> 40.3 µs at batch 1 / 64K,
                // 517 -> 506 µs at batch 16 / 64K); FLASHTIER_ATTN_L2PF=0|1|2
                // and FLASHTIER_ATTN_EVICT_FIRST=0|1 override (tuning runs).
                ("L2_PF", env_flag_or("FLASHTIER_ATTN_L2PF", 1)),
                ("EVICT_FIRST", env_flag_or("FLASHTIER_ATTN_EVICT_FIRST", 1)),
            ],
        )?;
        let func = |name: &str| {
            module
                .load_function(name)
                .map_err(CudaError::driver(format!("load kernel {name}")))
        };
        let f_split = func("attn_split")?;
        let f_merge = func("attn_merge")?;
        let f_finalize = func("attn_finalize")?;
        let smem = split_smem_bytes(dims.head_dim, kreg, stages);
        if smem > gpu.info().max_smem_per_block_optin_bytes {
            return Err(CudaError::invalid(
                "attention dims",
                format!(
                    "head_dim {} needs {smem} bytes of shared memory; the device allows {}",
                    dims.head_dim,
                    gpu.info().max_smem_per_block_optin_bytes
                ),
            ));
        }
        let smem_i32 = i32::try_from(smem).unwrap_or(i32::MAX);
        f_split
            .set_attribute(
                FnAttr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem_i32,
            )
            .map_err(CudaError::driver("raise dynamic shared memory limit"))?;
        let ctas_per_sm = f_split
            .occupancy_max_active_blocks_per_multiprocessor((WARPS * 32) as u32, smem, None)
            .map_err(CudaError::driver("occupancy"))?
            .max(1);
        let n_state = dims.max_seqs * dims.num_q_heads;
        let alloc = |n: usize| {
            gpu.stream()
                .alloc_zeros::<f32>(n.max(1))
                .map_err(CudaError::driver(format!(
                    "allocate {n} floats of attention state"
                )))
        };
        Ok(Self {
            gpu: gpu.clone(),
            dims,
            _module: module,
            f_split,
            f_merge,
            f_finalize,
            split_smem_bytes: u32::try_from(smem).unwrap_or(u32::MAX),
            stages,
            ctas_per_sm,
            st_m: alloc(n_state)?,
            st_l: alloc(n_state)?,
            st_o: alloc(n_state * dims.head_dim)?,
            part_m: alloc(n_state * MAX_SPLITS)?,
            part_l: alloc(n_state * MAX_SPLITS)?,
            part_o: alloc(n_state * MAX_SPLITS * dims.head_dim)?,
            scale: 1.0 / (dims.head_dim as f32).sqrt(),
            step_seqs: None,
            fresh: true,
            pdl: true,
            // FLASHTIER_ATTN_PDL_SPLIT=0 launches the split kernel plainly,
            // FLASHTIER_ATTN_SPLITS=<n> fixes the splits (tuning runs only).
            pdl_split: std::env::var("FLASHTIER_ATTN_PDL_SPLIT").map_or(true, |v| v != "0"),
            splits_override: std::env::var("FLASHTIER_ATTN_SPLITS")
                .ok()
                .and_then(|v| v.parse().ok()),
            ptxas_log: cubin.log,
        })
    }

    /// The shape.
    #[must_use]
    pub fn dims(&self) -> &AttnDims {
        &self.dims
    }

    /// Resident split CTAs per multiprocessor (occupancy).
    #[must_use]
    pub fn ctas_per_sm(&self) -> u32 {
        self.ctas_per_sm
    }

    /// cp.async pipeline depth per warp.
    #[must_use]
    pub fn stages(&self) -> usize {
        self.stages
    }

    /// ptxas's register / shared-memory / spill report for this module.
    #[must_use]
    pub fn ptxas_log(&self) -> &str {
        &self.ptxas_log
    }

    /// Upload and validate one tile: `blocks[s]` are the pool block ids of
    /// sequence `s` in this tile (at most `tile_capacity`), and
    /// `last_valid_slots[s]` the filled tokens of its last block (`1..=block_size`).
    pub fn tile_table(
        &self,
        blocks: &[&[u32]],
        last_valid_slots: &[usize],
    ) -> Result<TileTable, CudaError> {
        let d = &self.dims;
        let n = blocks.len();
        if n == 0 || n > d.max_seqs || last_valid_slots.len() != n {
            return Err(CudaError::invalid(
                "tile",
                format!(
                    "{n} sequences with {} last-block counts (max_seqs {})",
                    last_valid_slots.len(),
                    d.max_seqs
                ),
            ));
        }
        let mut flat = vec![0i32; n * d.tile_capacity];
        let mut tokens = Vec::with_capacity(n);
        let mut max_block = 0usize;
        for (s, (seq_blocks, &last)) in blocks.iter().zip(last_valid_slots).enumerate() {
            let t = tile_tokens(d, s, seq_blocks.len(), last)?;
            for (j, &b) in seq_blocks.iter().enumerate() {
                let b_i32 = i32::try_from(b).map_err(|_| {
                    CudaError::invalid("tile", format!("block id {b} of sequence {s} too large"))
                })?;
                if let Some(slot) = flat.get_mut(s * d.tile_capacity + j) {
                    *slot = b_i32;
                }
                max_block = max_block.max(b as usize);
            }
            tokens.push(i32::try_from(t).unwrap_or(i32::MAX));
        }
        let max_tokens = tokens.iter().copied().max().unwrap_or(0).max(0) as usize;
        let stream = self.gpu.stream();
        Ok(TileTable {
            blocks: stream
                .clone_htod(&flat)
                .map_err(CudaError::driver("upload tile blocks"))?,
            tokens: stream
                .clone_htod(&tokens)
                .map_err(CudaError::driver("upload tile tokens"))?,
            num_seqs: n,
            max_tokens,
            max_block,
        })
    }

    /// Reset the running state of `num_seqs` sequences for a new decode step.
    pub fn begin_step(&mut self, num_seqs: usize) -> Result<(), CudaError> {
        if num_seqs == 0 || num_seqs > self.dims.max_seqs {
            return Err(CudaError::invalid(
                "begin_step",
                format!("num_seqs {num_seqs} outside 1..={}", self.dims.max_seqs),
            ));
        }
        // The reset is folded into the next merge (`fresh`), saving a launch.
        self.step_seqs = Some(num_seqs);
        self.fresh = true;
        Ok(())
    }
}

impl DecodeAttention {
    /// Fold one tile into the running state: `q` is `[num_seqs, num_q_heads,
    /// head_dim]` BF16 (as raw `u16`), `k_pool` / `v_pool` the KV pools in
    /// `layout`. Two launches on the compute stream, no host sync.
    pub fn step_tile(
        &mut self,
        q: &CudaSlice<u16>,
        k_pool: &CudaSlice<u16>,
        v_pool: &CudaSlice<u16>,
        layout: KvStrides,
        tile: &TileTable,
    ) -> Result<(), CudaError> {
        self.step_impl(q, k_pool, v_pool, layout, tile, None)
    }

    /// The step's last tile and [`finalize`](Self::finalize) in one: the merge
    /// also writes `o / l` to `out`, saving a launch.
    pub fn step_tile_final(
        &mut self,
        q: &CudaSlice<u16>,
        k_pool: &CudaSlice<u16>,
        v_pool: &CudaSlice<u16>,
        layout: KvStrides,
        tile: &TileTable,
        out: &mut CudaSlice<u16>,
    ) -> Result<(), CudaError> {
        self.check_out(out)?;
        self.step_impl(q, k_pool, v_pool, layout, tile, Some(out))?;
        self.step_seqs = None;
        Ok(())
    }

    fn step_impl(
        &mut self,
        q: &CudaSlice<u16>,
        k_pool: &CudaSlice<u16>,
        v_pool: &CudaSlice<u16>,
        layout: KvStrides,
        tile: &TileTable,
        out: Option<&mut CudaSlice<u16>>,
    ) -> Result<(), CudaError> {
        let num_seqs = self.check_step(q, k_pool, v_pool, layout, tile)?;
        let d = self.dims;
        let qgroups = d.group().div_ceil(16);
        let pairs = num_seqs * d.num_kv_heads * qgroups;
        let slots = self.gpu.info().sm_count as usize * self.ctas_per_sm as usize;
        let plan = plan_splits(tile.max_tokens, pairs, slots, self.splits_override);
        let args = SplitArgs {
            num_q_heads: as_i32(d.num_q_heads),
            group: as_i32(d.group()),
            block_size: as_i32(d.block_size),
            tile_capacity: as_i32(d.tile_capacity),
            blk_stride: layout.block as i64,
            tok_stride: layout.token as i64,
            kvh_stride: layout.kv_head as i64,
            sub_total: as_i32(plan.sub_total),
            scale_log2: self.scale * std::f32::consts::LOG2_E,
        };
        let stream = self.gpu.stream().clone();
        let cfg = LaunchConfig {
            grid_dim: (
                plan.splits as u32,
                (d.num_kv_heads * qgroups) as u32,
                num_seqs as u32,
            ),
            block_dim: ((WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: self.split_smem_bytes,
        };
        let mut args = args;
        let dev16 = |b: &CudaSlice<u16>| b.device_ptr(&stream).0;
        let dev32 = |b: &CudaSlice<i32>| b.device_ptr(&stream).0;
        let devf = |b: &CudaSlice<f32>| b.device_ptr(&stream).0;
        let mut split_ptrs = [
            dev16(q),
            dev16(k_pool),
            dev16(v_pool),
            dev32(&tile.blocks),
            dev32(&tile.tokens),
            devf(&self.part_m),
            devf(&self.part_l),
            devf(&self.part_o),
        ];
        let mut params: Vec<*mut std::ffi::c_void> = split_ptrs
            .iter_mut()
            .map(|p| (&raw mut *p).cast())
            .collect();
        params.push((&raw mut args).cast());
        let f = self.f_split.clone();
        let pdl_split = self.pdl_split;
        // SAFETY: `params` point at live locals in `attn_split`'s parameter
        // order and types (eight device pointers, then `SplitArgs` by value);
        // `check_step` proved every address the kernel forms (q rows, pool
        // blocks, tile entries, partials for `plan.splits <= MAX_SPLITS`)
        // lies inside its buffer.
        unsafe {
            self.launch_pdl(
                &stream,
                &f,
                cfg,
                &mut params,
                pdl_split,
                "launch attn_split",
            )
        }?;

        let splits = as_i32(plan.splits);
        let fresh = i32::from(self.fresh);
        let cfg = LaunchConfig {
            grid_dim: (d.num_q_heads as u32, num_seqs as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let out_ptr = out.map_or(0u64, |o| o.device_ptr(&stream).0);
        let dev = |b: &CudaSlice<f32>| b.device_ptr(&stream).0;
        let ptrs = [
            dev(&self.st_m),
            dev(&self.st_l),
            dev(&self.st_o),
            dev(&self.part_m),
            dev(&self.part_l),
            dev(&self.part_o),
        ];
        self.launch_merge(&stream, cfg, ptrs, splits, fresh, out_ptr)?;
        self.fresh = false;
        Ok(())
    }

    /// Write `o / l` of the step's sequences to `out` (`[num_seqs,
    /// num_q_heads, head_dim]` BF16); a head that saw no token gets zeros.
    pub fn finalize(&mut self, out: &mut CudaSlice<u16>) -> Result<(), CudaError> {
        let d = self.dims;
        let num_seqs = self.check_out(out)?;
        let empty = i32::from(self.fresh);
        let cfg = LaunchConfig {
            grid_dim: (d.num_q_heads as u32, num_seqs as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let stream = self.gpu.stream().clone();
        let mut launch = stream.launch_builder(&self.f_finalize);
        launch.arg(&self.st_l).arg(&self.st_o).arg(out).arg(&empty);
        // SAFETY: matches `attn_finalize`; `out` holds `need` elements (checked).
        unsafe { launch.launch(cfg) }.map_err(CudaError::driver("launch attn_finalize"))?;
        self.step_seqs = None;
        Ok(())
    }
}

fn as_i32(v: usize) -> i32 {
    i32::try_from(v).unwrap_or(i32::MAX)
}
