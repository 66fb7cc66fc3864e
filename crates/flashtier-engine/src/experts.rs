//! Where the engine gets expert weights: the [`ExpertSource`] trait, and
//! [`CheckpointExperts`], which reads them straight from the checkpoint's
//! safetensors under a byte budget.
//!
//! Bound: a `CheckpointExperts` holds at most `budget_bytes` of expert
//! records (each record is gate | up | down in the checkpoint's dtype); a
//! step whose own experts do not fit is [`EngineError::BudgetTooSmall`],
//! never an overrun. Eviction is least-recently-used among the records the
//! current step does not use. The bytes served are the checkpoint's bytes
//! whatever the budget, so streaming never changes results.

use std::collections::HashMap;
use std::time::Instant;

use rayon::prelude::*;

use crate::checkpoint::{Checkpoint, DType};
use crate::config::{Arch, ModelConfig};
use crate::error::EngineError;
use crate::kernels::{MatRef, f8_scale_grid};

/// One expert's three matrices: gate and up `[intermediate, hidden]`, down
/// `[hidden, intermediate]`, borrowed from wherever the record lives.
#[derive(Clone, Copy, Debug)]
pub struct ExpertView<'a> {
    /// Gate projection.
    pub gate: MatRef<'a>,
    /// Up projection.
    pub up: MatRef<'a>,
    /// Down projection.
    pub down: MatRef<'a>,
}

impl<'a> ExpertView<'a> {
    /// Split a record laid out gate | up | down (each `hidden x intermediate`
    /// elements of `dtype`) into its matrices. With `fp8_block` (FP8 E4M3
    /// records) the three matrices' float32 block scales follow, in the
    /// same order.
    pub fn from_record(
        record: &'a [u8],
        dtype: DType,
        hidden: usize,
        intermediate: usize,
        fp8_block: Option<[usize; 2]>,
    ) -> Result<Self, EngineError> {
        let mat_bytes = hidden * intermediate * dtype.size_bytes();
        let scales = match (dtype, fp8_block) {
            (DType::F8E4M3, Some(block)) => {
                Some((block, fp8_scale_bytes(hidden, intermediate, block)))
            }
            (DType::F8E4M3, None) => {
                return Err(EngineError::Experts(
                    "FP8 expert records need the block size of quantization_config".into(),
                ));
            }
            _ => None,
        };
        let need = 3 * mat_bytes + scales.map_or(0, |(_, s)| s.0 + s.1 + s.2);
        if record.len() < need {
            return Err(EngineError::Experts(format!(
                "record of {} bytes cannot hold three {hidden}x{intermediate} {} matrices \
                 ({need} bytes with their scales)",
                record.len(),
                dtype.name()
            )));
        }
        let (gate, up, down) = (
            &record[..mat_bytes],
            &record[mat_bytes..2 * mat_bytes],
            &record[2 * mat_bytes..3 * mat_bytes],
        );
        let Some((block, (sg, su, sd))) = scales else {
            return Ok(Self {
                gate: MatRef::Raw(gate, dtype),
                up: MatRef::Raw(up, dtype),
                down: MatRef::Raw(down, dtype),
            });
        };
        let at = 3 * mat_bytes;
        let f8 = |codes, scales, rows, cols| {
            MatRef::f8_block(codes, scales, rows, cols, block).map_err(EngineError::Experts)
        };
        Ok(Self {
            gate: f8(gate, &record[at..at + sg], intermediate, hidden)?,
            up: f8(up, &record[at + sg..at + sg + su], intermediate, hidden)?,
            down: f8(
                down,
                &record[at + sg + su..at + sg + su + sd],
                hidden,
                intermediate,
            )?,
        })
    }
}

/// Bytes of the float32 block scales of an expert's gate, up and down
/// (`[I, H]`, `[I, H]`, `[H, I]`) in `block` blocks.
pub fn fp8_scale_bytes(hidden: usize, inter: usize, block: [usize; 2]) -> (usize, usize, usize) {
    let bytes = |[r, c]: [usize; 2]| r * c * 4;
    let gu = bytes(f8_scale_grid(inter, hidden, block));
    (gu, gu, bytes(f8_scale_grid(hidden, inter, block)))
}

/// Counters of an expert source since it was made.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ExpertStats {
    /// Expert uses served from memory.
    pub hits: u64,
    /// Expert uses that needed a read.
    pub misses: u64,
    /// Bytes read from storage (misses and prefetches).
    pub bytes_read: u64,
    /// Of `bytes_read`, bytes read ahead on a [`ExpertSource::hint`].
    pub prefetch_bytes: u64,
    /// Nanoseconds the engine waited for expert reads.
    pub stall_ns: u64,
}

impl ExpertStats {
    /// Hits over uses (1.0 when nothing was used yet).
    pub fn hit_rate(&self) -> f64 {
        let uses = self.hits + self.misses;
        if uses == 0 {
            1.0
        } else {
            self.hits as f64 / uses as f64
        }
    }

    /// Counters accumulated since `earlier`.
    pub fn since(&self, earlier: &ExpertStats) -> ExpertStats {
        ExpertStats {
            hits: self.hits - earlier.hits,
            misses: self.misses - earlier.misses,
            bytes_read: self.bytes_read - earlier.bytes_read,
            prefetch_bytes: self.prefetch_bytes - earlier.prefetch_bytes,
            stall_ns: self.stall_ns - earlier.stall_ns,
        }
    }
}

/// Called with (position in the request, the expert's matrices).
pub type UseExpert<'f> = dyn FnMut(usize, ExpertView<'_>) -> Result<(), EngineError> + 'f;

/// Gives the engine the matrices of (layer, expert).
pub trait ExpertSource: Send {
    /// Make `experts` of `layer` available for one token and call
    /// `use_expert(i, view)` exactly once for each `experts[i]`, in any order:
    /// a streaming source serves resident experts first and the others as
    /// their reads land, so compute overlaps I/O. `layer` counts all decoder
    /// layers. The caller must not depend on the call order for its result.
    fn with_experts(
        &mut self,
        layer: usize,
        experts: &[usize],
        use_expert: &mut UseExpert<'_>,
    ) -> Result<(), EngineError>;

    /// A guess of the experts `layer` will ask for next (the engine applies
    /// that layer's router to the current layer's input, "pre-gating"). A
    /// streaming source may start reading them behind the current step's
    /// reads; the default ignores it. Never changes what is computed.
    fn hint(&mut self, layer: usize, experts: &[usize]) {
        let _ = (layer, experts);
    }

    /// Counters so far.
    fn stats(&self) -> ExpertStats;
}

/// Where the experts of one sparse layer sit in the checkpoint.
#[derive(Clone, Debug)]
enum LayerTensors {
    /// Hub layout: one tensor per expert matrix (`..experts.{e}.gate_proj.weight`).
    Split {
        gate: Vec<String>,
        up: Vec<String>,
        down: Vec<String>,
    },
    /// transformers-5 layout: `experts.gate_up_proj [E, 2I, H]`, `experts.down_proj [E, H, I]`.
    Fused { gate_up: String, down: String },
}

#[derive(Debug)]
struct Cached {
    record: Vec<u8>,
    last_used_step: u64,
}

/// Experts read from the checkpoint's safetensors on demand, cached under a budget.
#[derive(Debug)]
pub struct CheckpointExperts {
    ckpt: std::sync::Arc<Checkpoint>,
    layers: Vec<Option<LayerTensors>>,
    dtype: DType,
    /// FP8 block size when the experts are FP8 E4M3 (their scales are read too).
    fp8_block: Option<[usize; 2]>,
    hidden: usize,
    intermediate: usize,
    num_experts: usize,
    budget_bytes: u64,
    cache: HashMap<(usize, usize), Cached>,
    step: u64,
    stats: ExpertStats,
}

impl CheckpointExperts {
    /// Locate and shape-check every expert tensor; `budget_bytes` bounds the cache.
    pub fn new(
        ckpt: std::sync::Arc<Checkpoint>,
        cfg: &ModelConfig,
        budget_bytes: u64,
    ) -> Result<Self, EngineError> {
        let (h, i, e) = (cfg.hidden_size, cfg.expert_intermediate, cfg.num_experts);
        let mut layers = Vec::with_capacity(cfg.num_layers);
        let mut dtype = None;
        for (layer, sparse) in cfg.sparse_layers.iter().enumerate() {
            if !sparse {
                layers.push(None);
                continue;
            }
            let stem = format!("model.layers.{layer}.{}.experts", cfg.arch.moe_block_name());
            let fused = format!("model.layers.{layer}.mlp.experts");
            let (tensors, dts) = if ckpt.contains(&format!("{fused}.gate_up_proj")) {
                let gate_up = format!("{fused}.gate_up_proj");
                let down = format!("{fused}.down_proj");
                let a = ckpt.expect_shape(&gate_up, &[e, 2 * i, h])?;
                let b = ckpt.expect_shape(&down, &[e, h, i])?;
                (LayerTensors::Fused { gate_up, down }, vec![a, b])
            } else {
                let (g, u, d) = match cfg.arch {
                    Arch::Mixtral => ("w1", "w3", "w2"),
                    Arch::Qwen3Moe | Arch::Qwen2Moe | Arch::DeepseekV3 => {
                        ("gate_proj", "up_proj", "down_proj")
                    }
                };
                let names = |m: &str| {
                    (0..e)
                        .map(|x| format!("{stem}.{x}.{m}.weight"))
                        .collect::<Vec<_>>()
                };
                let (gate, up, down) = (names(g), names(u), names(d));
                let mut dts = Vec::with_capacity(3 * e);
                for x in 0..e {
                    for (name, rows, cols) in [(&gate[x], i, h), (&up[x], i, h), (&down[x], h, i)] {
                        let dt = ckpt.expect_shape(name, &[rows, cols])?;
                        if let (DType::F8E4M3, Some(block)) = (dt, cfg.fp8_block) {
                            ckpt.expect_shape(
                                &format!("{name}_scale_inv"),
                                &f8_scale_grid(rows, cols, block),
                            )
                            .and_then(|sdt| match sdt {
                                DType::F32 => Ok(()),
                                other => Err(EngineError::TensorDtype {
                                    name: format!("{name}_scale_inv"),
                                    dtype: format!("{} (FP8 scales must be F32)", other.name()),
                                }),
                            })?;
                        }
                        dts.push(dt);
                    }
                }
                (LayerTensors::Split { gate, up, down }, dts)
            };
            for dt in dts {
                if *dtype.get_or_insert(dt) != dt {
                    return Err(EngineError::Experts(format!(
                        "layer {layer}: expert tensors mix dtypes {} and {}",
                        dt.name(),
                        dtype.map_or("?", DType::name)
                    )));
                }
            }
            layers.push(Some(tensors));
        }
        let dtype = dtype.unwrap_or(DType::Bf16);
        let fp8_block = match (dtype, cfg.fp8_block) {
            (DType::F8E4M3, Some(block)) => Some(block),
            (DType::F8E4M3, None) => {
                return Err(EngineError::config(
                    "quantization_config",
                    "FP8 experts need quantization_config.weight_block_size",
                ));
            }
            _ => None,
        };
        if fp8_block.is_some()
            && layers
                .iter()
                .flatten()
                .any(|l| matches!(l, LayerTensors::Fused { .. }))
        {
            return Err(EngineError::Experts(
                "fused FP8 experts (gate_up_proj) are not supported: their scales' layout is not defined"
                    .into(),
            ));
        }
        Ok(Self {
            ckpt,
            layers,
            dtype,
            fp8_block,
            hidden: h,
            intermediate: i,
            num_experts: e,
            budget_bytes,
            cache: HashMap::new(),
            step: 0,
            stats: ExpertStats::default(),
        })
    }

    /// Bytes of one expert record.
    pub fn record_bytes(&self) -> u64 {
        let scales = self.fp8_block.map_or(0, |b| {
            let (g, u, d) = fp8_scale_bytes(self.hidden, self.intermediate, b);
            g + u + d
        });
        (3 * self.hidden * self.intermediate * self.dtype.size_bytes() + scales) as u64
    }

    /// Bytes currently cached.
    pub fn cached_bytes(&self) -> u64 {
        self.cache.len() as u64 * self.record_bytes()
    }

    fn read_record(&self, layer: usize, expert: usize) -> Result<Vec<u8>, EngineError> {
        let mat = self.hidden * self.intermediate * self.dtype.size_bytes();
        let tensors = self
            .layers
            .get(layer)
            .and_then(Option::as_ref)
            .ok_or_else(|| EngineError::Experts(format!("layer {layer} has no experts")))?;
        let mut record = Vec::with_capacity(3 * mat);
        match tensors {
            LayerTensors::Split { gate, up, down } => {
                let names = [&gate[expert], &up[expert], &down[expert]];
                for name in names {
                    record.extend(self.ckpt.read_range(name, 0, mat)?);
                }
                if let Some(block) = self.fp8_block {
                    let (g, u, d) = fp8_scale_bytes(self.hidden, self.intermediate, block);
                    for (name, len) in names.into_iter().zip([g, u, d]) {
                        record.extend(self.ckpt.read_range(
                            &format!("{name}_scale_inv"),
                            0,
                            len,
                        )?);
                    }
                }
            }
            LayerTensors::Fused { gate_up, down } => {
                record.extend(
                    self.ckpt
                        .read_range(gate_up, (expert * 2 * mat) as u64, 2 * mat)?,
                );
                record.extend(self.ckpt.read_range(down, (expert * mat) as u64, mat)?);
            }
        }
        Ok(record)
    }

    /// Evict least-recently-used records not in `keep` until `need` more bytes fit.
    fn make_room(&mut self, layer: usize, keep: &[usize], need: u64) {
        while self.cached_bytes() + need > self.budget_bytes {
            let victim = self
                .cache
                .iter()
                .filter(|((l, e), _)| !(*l == layer && keep.contains(e)))
                .min_by_key(|(key, c)| (c.last_used_step, **key))
                .map(|(key, _)| *key);
            match victim {
                Some(key) => {
                    self.cache.remove(&key);
                }
                None => break,
            }
        }
    }
}

impl ExpertSource for CheckpointExperts {
    fn with_experts(
        &mut self,
        layer: usize,
        experts: &[usize],
        use_expert: &mut UseExpert<'_>,
    ) -> Result<(), EngineError> {
        for &e in experts {
            if e >= self.num_experts || self.layers.get(layer).is_none_or(Option::is_none) {
                return Err(EngineError::ExpertOutOfRange {
                    layer,
                    expert: e,
                    layers: self.layers.len(),
                    experts: self.num_experts,
                });
            }
        }
        let need_step = self.record_bytes() * experts.len() as u64;
        if need_step > self.budget_bytes {
            return Err(EngineError::BudgetTooSmall {
                budget_bytes: self.budget_bytes,
                need_bytes: need_step,
                top_k: experts.len(),
            });
        }
        self.step += 1;
        let mut missing: Vec<usize> = experts
            .iter()
            .copied()
            .filter(|e| !self.cache.contains_key(&(layer, *e)))
            .collect();
        missing.sort_unstable();
        missing.dedup();
        self.stats.hits += (experts.len() - missing.len()) as u64;
        self.stats.misses += missing.len() as u64;
        if !missing.is_empty() {
            self.make_room(layer, experts, self.record_bytes() * missing.len() as u64);
            let started = Instant::now();
            let this = &*self;
            let records: Vec<Vec<u8>> = missing
                .par_iter()
                .map(|&e| this.read_record(layer, e))
                .collect::<Result<_, _>>()?;
            self.stats.stall_ns += started.elapsed().as_nanos() as u64;
            for (e, record) in missing.iter().zip(records) {
                self.stats.bytes_read += record.len() as u64;
                self.cache.insert(
                    (layer, *e),
                    Cached {
                        record,
                        last_used_step: 0,
                    },
                );
            }
        }
        let step = self.step;
        for e in experts {
            if let Some(c) = self.cache.get_mut(&(layer, *e)) {
                c.last_used_step = step;
            }
        }
        let (dtype, h, i, block) = (self.dtype, self.hidden, self.intermediate, self.fp8_block);
        for (pos, e) in experts.iter().enumerate() {
            let c = self.cache.get(&(layer, *e)).ok_or_else(|| {
                EngineError::Experts(format!("expert ({layer}, {e}) vanished from the cache"))
            })?;
            use_expert(pos, ExpertView::from_record(&c.record, dtype, h, i, block)?)?;
        }
        Ok(())
    }

    fn stats(&self) -> ExpertStats {
        self.stats
    }
}
