//! [`PoolExperts`]: the engine's [`ExpertSource`] over the expert tier's
//! [`ExpertPool`], for experts packed into a store (`flashtier pack experts`).
//!
//! Per sparse layer of a token: `acquire` the top-k records (pinned until
//! `finish`), `plan` and `run_tracked` the misses, then hand each record to
//! the engine as soon as it is ready: resident records first, the others as
//! their reads land (the engine computes one expert while the next is still
//! in flight). The time spent blocked on reads is the stall. The pool's
//! bound (`budget_bytes / stride` records) is the memory bound; a step
//! needing more records than that is [`EngineError::Pool`] (`PoolTooSmall`).

use std::time::Instant;

use flashtier_format::Dtype;

use crate::checkpoint::DType;
use crate::config::ModelConfig;
use crate::error::EngineError;
use crate::experts::{ExpertSource, ExpertStats, ExpertView, UseExpert};
use crate::kernels::{MatRef, f8_scale_grid};
use flashtier::experts::{ExpertPool, ExpertsError, Precision};

/// Byte range of one matrix inside a record.
#[derive(Clone, Copy, Debug)]
struct Span {
    offset: usize,
    len: usize,
}

/// Experts served by an [`ExpertPool`].
pub struct PoolExperts {
    pool: ExpertPool,
    gate: Span,
    up: Span,
    down: Span,
    dtype: DType,
    /// FP8 records: the gate, up and down block scales, and the block size.
    fp8: Option<([Span; 3], [usize; 2])>,
    hidden: usize,
    intermediate: usize,
    stall_ns: u64,
    /// The engine's guess for the next sparse layer, read behind the next step's misses.
    hint: Option<(u32, Vec<u32>)>,
}

impl std::fmt::Debug for PoolExperts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolExperts")
            .field("dtype", &self.dtype)
            .finish()
    }
}

impl PoolExperts {
    /// Check the store's record layout against `cfg` (gate/up `[I, H]`, down
    /// `[H, I]`, one dtype among BF16/F16/F32 without scales, or FP8 E4M3
    /// with each matrix's F32 block scales in `cfg.fp8_block` blocks) and
    /// wrap `pool`.
    pub fn new(pool: ExpertPool, cfg: &ModelConfig) -> Result<Self, EngineError> {
        let (h, i) = (cfg.hidden_size as u64, cfg.expert_intermediate as u64);
        let tensors = pool.stores().full().store.tensors().to_vec();
        let bad = |reason: String| EngineError::Experts(format!("expert store: {reason}"));
        let find = |names: [&str; 2], shape: [u64; 2]| -> Result<(Span, Dtype), EngineError> {
            let t = tensors
                .iter()
                .find(|t| names.contains(&t.name.as_str()))
                .ok_or_else(|| bad(format!("no `{}` tensor in the records", names[0])))?;
            if t.shape != shape {
                return Err(bad(format!(
                    "`{}` has shape {:?}, the config implies {shape:?}",
                    t.name, t.shape
                )));
            }
            let span = Span {
                offset: usize::try_from(t.offset)
                    .map_err(|_| bad("record offset overflow".into()))?,
                len: usize::try_from(t.len_bytes)
                    .map_err(|_| bad("record length overflow".into()))?,
            };
            Ok((span, t.dtype))
        };
        let (gate, dg) = find(["gate_proj.weight", "w1.weight"], [i, h])?;
        let (up, du) = find(["up_proj.weight", "w3.weight"], [i, h])?;
        let (down, dd) = find(["down_proj.weight", "w2.weight"], [h, i])?;
        if dg != du || du != dd {
            return Err(bad(format!(
                "expert matrices mix dtypes {dg:?}, {du:?}, {dd:?}"
            )));
        }
        let dtype = match dg {
            Dtype::Bf16 => DType::Bf16,
            Dtype::F16 => DType::F16,
            Dtype::F32 => DType::F32,
            Dtype::F8E4M3 => DType::F8E4M3,
            other => {
                return Err(bad(format!(
                    "dtype {other:?} is not supported (BF16, F16, F32, F8_E4M3 with block scales)"
                )));
            }
        };
        let fp8 = match (dtype, cfg.fp8_block) {
            (DType::F8E4M3, Some(block)) => {
                let grid = |rows: u64, cols: u64| {
                    f8_scale_grid(rows as usize, cols as usize, block).map(|n| n as u64)
                };
                let (gu, dn) = (grid(i, h), grid(h, i));
                let mut spans = [gate; 3];
                for (k, (names, shape)) in [
                    (["gate_proj.weight_scale_inv", "w1.weight_scale_inv"], gu),
                    (["up_proj.weight_scale_inv", "w3.weight_scale_inv"], gu),
                    (["down_proj.weight_scale_inv", "w2.weight_scale_inv"], dn),
                ]
                .into_iter()
                .enumerate()
                {
                    let (span, sdt) = find(names, shape)?;
                    if sdt != Dtype::F32 {
                        return Err(bad(format!(
                            "`{}` is {sdt:?}; FP8 block scales must be F32",
                            names[0]
                        )));
                    }
                    spans[k] = span;
                }
                Some((spans, block))
            }
            (DType::F8E4M3, None) => {
                return Err(bad(
                    "FP8 records need the block size of the model's quantization_config".into(),
                ));
            }
            _ => {
                if let Some(t) = tensors.iter().find(|t| t.name.contains("scale")) {
                    return Err(bad(format!(
                        "tensor `{}`: scales on {dtype:?} experts are not supported",
                        t.name
                    )));
                }
                None
            }
        };
        Ok(Self {
            pool,
            gate,
            up,
            down,
            dtype,
            fp8,
            hidden: cfg.hidden_size,
            intermediate: cfg.expert_intermediate,
            stall_ns: 0,
            hint: None,
        })
    }

    /// The pool (stats, read rows).
    pub fn pool(&self) -> &ExpertPool {
        &self.pool
    }

    /// Serve every record of the open step, ready ones first.
    fn serve(
        &mut self,
        records: &[usize],
        use_expert: &mut UseExpert<'_>,
    ) -> Result<(), EngineError> {
        let mut pending: Vec<(usize, usize)> = records.iter().copied().enumerate().collect();
        while !pending.is_empty() {
            let mut progressed = false;
            let mut k = 0;
            while k < pending.len() {
                let (pos, r) = pending[k];
                match self.pool.bytes(r) {
                    Ok(_) => {
                        self.use_record(pos, r, use_expert)?;
                        pending.swap_remove(k);
                        progressed = true;
                    }
                    Err(ExpertsError::NotLanded { .. }) => k += 1,
                    Err(e) => return Err(e.into()),
                }
            }
            if !progressed {
                let started = Instant::now();
                self.pool.wait_ready(pending[0].1)?;
                self.stall_ns += started.elapsed().as_nanos() as u64;
            }
        }
        Ok(())
    }

    fn use_record(
        &mut self,
        pos: usize,
        r: usize,
        use_expert: &mut UseExpert<'_>,
    ) -> Result<(), EngineError> {
        let addr = self.pool.addr(r)?;
        if addr.precision != Precision::Full {
            return Err(EngineError::Experts(format!(
                "record {r} is a {:?} copy; the engine computes with exact records only",
                addr.precision
            )));
        }
        let (gate, up, down, dtype, fp8) = (self.gate, self.up, self.down, self.dtype, self.fp8);
        let (h, i) = (self.hidden, self.intermediate);
        let record = self.pool.bytes(r)?;
        let view = match fp8 {
            None => Self::layout_view(record, gate, up, down, dtype)?,
            Some(([sg, su, sd], block)) => {
                let part = |s: Span| {
                    record.get(s.offset..s.offset + s.len).ok_or_else(|| {
                        EngineError::Experts(format!(
                            "record of {} bytes is shorter than its layout",
                            record.len()
                        ))
                    })
                };
                let f8 = |m: Span, s: Span, rows, cols| {
                    MatRef::f8_block(part(m)?, part(s)?, rows, cols, block)
                        .map_err(EngineError::Experts)
                };
                ExpertView {
                    gate: f8(gate, sg, i, h)?,
                    up: f8(up, su, i, h)?,
                    down: f8(down, sd, h, i)?,
                }
            }
        };
        use_expert(pos, view)
    }

    fn layout_view(
        record: &[u8],
        gate: Span,
        up: Span,
        down: Span,
        dtype: DType,
    ) -> Result<ExpertView<'_>, EngineError> {
        let part = |s: Span| {
            record
                .get(s.offset..s.offset + s.len)
                .map(|b| MatRef::Raw(b, dtype))
                .ok_or_else(|| {
                    EngineError::Experts(format!(
                        "record of {} bytes is shorter than its layout",
                        record.len()
                    ))
                })
        };
        Ok(ExpertView {
            gate: part(gate)?,
            up: part(up)?,
            down: part(down)?,
        })
    }
}

impl ExpertSource for PoolExperts {
    fn with_experts(
        &mut self,
        layer: usize,
        experts: &[usize],
        use_expert: &mut UseExpert<'_>,
    ) -> Result<(), EngineError> {
        let layer_id =
            u32::try_from(layer).map_err(|_| EngineError::Experts(format!("layer {layer}")))?;
        let records = experts
            .iter()
            .map(|&e| {
                let id =
                    u32::try_from(e).map_err(|_| EngineError::Experts(format!("expert {e}")))?;
                Ok(self.pool.index_of(layer_id, id)?)
            })
            .collect::<Result<Vec<_>, EngineError>>()?;
        let need = self.pool.acquire(&records)?;
        let served = (|| {
            let plan = self.pool.plan(&need)?;
            self.pool.run_tracked(plan)?;
            if let Some((layer, experts)) = self.hint.take() {
                // Behind this step's misses: the drive stays busy while the
                // engine computes this layer.
                self.pool.prefetch(layer, &experts)?;
            }
            self.serve(&records, use_expert)
        })();
        let finished = self.pool.finish();
        served?;
        finished?;
        Ok(())
    }

    fn hint(&mut self, layer: usize, experts: &[usize]) {
        let ids = experts
            .iter()
            .filter_map(|&e| u32::try_from(e).ok())
            .collect();
        self.hint = u32::try_from(layer).ok().map(|l| (l, ids));
    }

    fn stats(&self) -> ExpertStats {
        let s = self.pool.stats();
        ExpertStats {
            hits: s.hits,
            misses: s.accesses - s.hits,
            bytes_read: s.bytes_read,
            prefetch_bytes: s.prefetch_bytes,
            stall_ns: self.stall_ns,
        }
    }
}

/// How [`open_pool`] builds the pool.
#[derive(Clone, Copy, Debug)]
pub struct StreamOptions {
    /// Mapped (page cache) or slots (direct reads).
    pub backing: flashtier::experts::Backing,
    /// Memory budget for resident records, bytes.
    pub budget_bytes: u64,
    /// Reads in flight at most (posix backend threads).
    pub queue_depth: usize,
}

/// Open the expert store at `store` as a pool for `cfg` (posix backend with
/// `queue_depth` reader threads).
pub fn open_pool(
    store: &std::path::Path,
    cfg: &ModelConfig,
    opts: StreamOptions,
) -> Result<PoolExperts, EngineError> {
    let backend = std::sync::Arc::new(flashtier_io::PosixBackend::new(opts.queue_depth.max(1))?);
    open_pool_with(store, cfg, opts, backend)
}

/// [`open_pool`] over any storage backend (io_uring, the simulator, a logger).
pub fn open_pool_with(
    store: &std::path::Path,
    cfg: &ModelConfig,
    opts: StreamOptions,
    backend: std::sync::Arc<dyn flashtier_io::StorageBackend>,
) -> Result<PoolExperts, EngineError> {
    use flashtier::experts::{Backing, PoolConfig, StoreSet};
    let stores = StoreSet::open(store, opts.backing == Backing::Mapped)?;
    let config = PoolConfig {
        backing: opts.backing,
        budget_bytes: opts.budget_bytes,
        ..PoolConfig::default()
    };
    PoolExperts::new(ExpertPool::new(stores, backend, config)?, cfg)
}
