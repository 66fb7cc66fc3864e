//! The engine's side of the expert tier, shared by every device: where an
//! expert's three matrices sit inside a packed record ([`ExpertRecordLayout`],
//! checked against the config), the counters a tier reports
//! ([`ExpertStats`]), and how a store is opened as a pool
//! ([`StreamOptions`], [`open_pool`]), and how a device's tier takes the
//! records of a step as they land (`serve_landed`).
//!
//! The engine has one expert source: records packed into an expert store
//! (`flashtier pack experts`, or packed on first use into the store cache,
//! `flashtier_pack::cache`) and served by the tier's [`ExpertPool`]. A
//! record's bytes reach a kernel only after its read landed and its
//! checksum matched (the pool's contract).

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use flashtier::experts::{Backing, ExpertPool, ExpertsError, PoolConfig, StoreSet};
use flashtier_format::Dtype;
use flashtier_io::StorageBackend;

use crate::config::ModelConfig;
use crate::error::EngineError;
use crate::matrix::{MatRef, f8_scale_grid};

/// Counters of an expert tier since it was made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExpertStats {
    /// Expert uses served from memory.
    pub hits: u64,
    /// Expert uses that needed a read.
    pub misses: u64,
    /// Bytes read from storage (misses and prefetches).
    pub bytes_read: u64,
    /// Of `bytes_read`, bytes read ahead on a hint.
    pub prefetch_bytes: u64,
    /// Of `prefetch_bytes`, bytes of records that were then used (the rest
    /// was read for nothing: the hint was wrong or the record was evicted
    /// before its use).
    pub prefetch_used_bytes: u64,
    /// Nanoseconds the engine waited for expert reads.
    pub stall_ns: u64,
    /// Bytes copied from host memory to the device (GPU tiers; 0 on the CPU).
    pub h2d_bytes: u64,
    /// Expert records the steps used, each counted once per step and layer
    /// however many rows of the step used it: the expert weights the steps
    /// read (a batch of sequences sharing experts reads fewer per row).
    pub records_used: u64,
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
            hits: self.hits.saturating_sub(earlier.hits),
            misses: self.misses.saturating_sub(earlier.misses),
            bytes_read: self.bytes_read.saturating_sub(earlier.bytes_read),
            prefetch_bytes: self.prefetch_bytes.saturating_sub(earlier.prefetch_bytes),
            prefetch_used_bytes: self
                .prefetch_used_bytes
                .saturating_sub(earlier.prefetch_used_bytes),
            stall_ns: self.stall_ns.saturating_sub(earlier.stall_ns),
            h2d_bytes: self.h2d_bytes.saturating_sub(earlier.h2d_bytes),
            records_used: self.records_used.saturating_sub(earlier.records_used),
        }
    }
}

/// Byte range of one matrix inside a record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    /// Offset from the record's first byte.
    pub offset: usize,
    /// Length in bytes.
    pub len: usize,
}

impl Span {
    /// The span's bytes of `record`, or a layout error.
    pub fn of<'a>(&self, record: &'a [u8]) -> Result<&'a [u8], EngineError> {
        record
            .get(self.offset..self.offset + self.len)
            .ok_or_else(|| EngineError::Layout {
                what: format!("a record of {} bytes", record.len()),
                reason: format!(
                    "holds no bytes {}..{} (its layout says it should)",
                    self.offset,
                    self.offset + self.len
                ),
            })
    }
}

/// One expert's three matrices, borrowed from wherever the record lives:
/// gate and up `[intermediate, hidden]`, down `[hidden, intermediate]`.
#[derive(Clone, Copy, Debug)]
pub struct ExpertView<'a> {
    /// Gate projection.
    pub gate: MatRef<'a>,
    /// Up projection.
    pub up: MatRef<'a>,
    /// Down projection.
    pub down: MatRef<'a>,
    /// Gate and up as one `[2 intermediate, hidden]` matrix (gate's rows,
    /// then up's), where the record stores them side by side unscaled: one
    /// product of a prompt chunk's rows instead of two, the same bits.
    pub gate_up: Option<MatRef<'a>>,
}

/// Where gate, up and down (and FP8 block scales) sit in a store's record,
/// checked against the model's config: read from the store's
/// [`flashtier_format::RecordLayout`], the list of every tensor of a record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertRecordLayout {
    /// Gate, up, down.
    pub matrices: [Span; 3],
    /// Element type of the three matrices (BF16, F16, F32 or F8 E4M3).
    pub dtype: Dtype,
    /// FP8 records: the gate, up and down scale grids and the block size.
    pub fp8: Option<([Span; 3], [usize; 2])>,
    /// Residual width.
    pub hidden: usize,
    /// Expert width.
    pub intermediate: usize,
}

impl ExpertRecordLayout {
    /// Read the layout from a store's manifest tensors: gate/up `[I, H]`,
    /// down `[H, I]`, one dtype among BF16/F16/F32 without scales, or FP8
    /// E4M3 with each matrix's F32 block scales in `cfg.fp8_block` blocks.
    pub fn of_store(
        store: &Path,
        pool: &ExpertPool,
        cfg: &ModelConfig,
    ) -> Result<Self, EngineError> {
        let (h, i) = (cfg.hidden_size, cfg.expert_intermediate);
        let tensors = &pool.stores().full().store.tensors();
        let bad = |reason: String| EngineError::ExpertLayout {
            store: store.to_path_buf(),
            reason,
        };
        let find = |names: [&str; 2], shape: [usize; 2]| -> Result<(Span, Dtype), EngineError> {
            let t = tensors
                .iter()
                .find(|t| names.contains(&t.name.as_str()))
                .ok_or_else(|| bad(format!("no `{}` tensor in the records", names[0])))?;
            let want = [shape[0] as u64, shape[1] as u64];
            if t.shape != want {
                return Err(bad(format!(
                    "`{}` has shape {}, the config implies {}",
                    t.name,
                    dims(&t.shape),
                    dims(&want)
                )));
            }
            let span = Span {
                offset: usize::try_from(t.offset)
                    .map_err(|_| bad(format!("`{}` offset {} overflows", t.name, t.offset)))?,
                len: usize::try_from(t.len_bytes)
                    .map_err(|_| bad(format!("`{}` length {} overflows", t.name, t.len_bytes)))?,
            };
            Ok((span, t.dtype))
        };
        let (gate, dg) = find(["gate_proj.weight", "w1.weight"], [i, h])?;
        let (up, du) = find(["up_proj.weight", "w3.weight"], [i, h])?;
        let (down, dd) = find(["down_proj.weight", "w2.weight"], [h, i])?;
        if dg != du || du != dd {
            return Err(bad(format!(
                "expert matrices mix dtypes {}, {}, {}",
                dg.name(),
                du.name(),
                dd.name()
            )));
        }
        if !matches!(dg, Dtype::Bf16 | Dtype::F16 | Dtype::F32 | Dtype::F8E4M3) {
            return Err(bad(format!(
                "dtype {} is not supported (BF16, F16, F32, F8_E4M3 with block scales)",
                dg.name()
            )));
        }
        let fp8 = match (dg, cfg.fp8_block) {
            (Dtype::F8E4M3, Some(block)) => {
                let (gu, dn) = (f8_scale_grid(i, h, block), f8_scale_grid(h, i, block));
                let mut spans = [gate; 3];
                let names = [
                    (["gate_proj.weight_scale_inv", "w1.weight_scale_inv"], gu),
                    (["up_proj.weight_scale_inv", "w3.weight_scale_inv"], gu),
                    (["down_proj.weight_scale_inv", "w2.weight_scale_inv"], dn),
                ];
                for (k, (names, shape)) in names.into_iter().enumerate() {
                    let (span, sdt) = find(names, shape)?;
                    if sdt != Dtype::F32 {
                        return Err(bad(format!(
                            "`{}` is {}; FP8 block scales must be F32",
                            names[0],
                            sdt.name()
                        )));
                    }
                    spans[k] = span;
                }
                Some((spans, block))
            }
            (Dtype::F8E4M3, None) => {
                return Err(bad(
                    "FP8 records need the block size of the model's quantization_config".into(),
                ));
            }
            _ => {
                if let Some(t) = tensors.iter().find(|t| t.name.contains("scale")) {
                    return Err(bad(format!(
                        "tensor `{}`: scales on {} experts are not supported",
                        t.name,
                        dg.name()
                    )));
                }
                None
            }
        };
        Ok(Self {
            matrices: [gate, up, down],
            dtype: dg,
            fp8,
            hidden: h,
            intermediate: i,
        })
    }

    /// The three matrices of `record` (a record's exact bytes).
    pub fn view<'a>(&self, record: &'a [u8]) -> Result<ExpertView<'a>, EngineError> {
        let (h, i) = (self.hidden, self.intermediate);
        let shapes = [(i, h), (i, h), (h, i)];
        let mut mats = [MatRef::F32(&[]); 3];
        for (k, (span, (rows, cols))) in self.matrices.iter().zip(shapes).enumerate() {
            let bytes = span.of(record)?;
            mats[k] = match self.fp8 {
                None => MatRef::raw(bytes, self.dtype, rows, cols)?,
                Some((scales, block)) => {
                    MatRef::f8_block(bytes, scales[k].of(record)?, rows, cols, block)?
                }
            };
        }
        let [gate, up, down] = mats;
        let [g, u, _] = self.matrices;
        let gate_up = match self.fp8 {
            None if g.offset + g.len == u.offset => Some(MatRef::raw(
                Span {
                    offset: g.offset,
                    len: g.len + u.len,
                }
                .of(record)?,
                self.dtype,
                2 * i,
                h,
            )?),
            _ => None,
        };
        Ok(ExpertView {
            gate,
            up,
            down,
            gate_up,
        })
    }
}

fn dims(shape: &[u64]) -> String {
    let parts: Vec<String> = shape.iter().map(u64::to_string).collect();
    format!("[{}]", parts.join(", "))
}

/// How [`open_pool`] builds the pool.
#[derive(Clone, Copy, Debug)]
pub struct StreamOptions {
    /// Mapped (page cache) or slots (direct reads).
    pub backing: Backing,
    /// Memory budget for resident records, bytes.
    pub budget_bytes: u64,
    /// Reads in flight at most (posix backend threads).
    pub queue_depth: usize,
}

/// Open the expert store at `store` as a pool under `opts`, reading
/// through `backend`; returns the pool and the record layout checked
/// against `cfg`.
pub fn open_pool(
    store: &Path,
    cfg: &ModelConfig,
    opts: StreamOptions,
    backend: Arc<dyn StorageBackend>,
) -> Result<(ExpertPool, ExpertRecordLayout), EngineError> {
    let stores = StoreSet::open(store, opts.backing == Backing::Mapped)?;
    let config = PoolConfig {
        backing: opts.backing,
        budget_bytes: opts.budget_bytes,
        ..PoolConfig::default()
    };
    let pool = ExpertPool::new(stores, backend, config)?;
    let layout = ExpertRecordLayout::of_store(store, &pool, cfg)?;
    Ok((pool, layout))
}

/// A device's expert tier over an [`ExpertPool`], as [`serve_landed`] sees
/// it.
pub(crate) trait PoolTier {
    /// The pool whose step is open.
    fn pool_mut(&mut self) -> &mut ExpertPool;
    /// Count `ns` nanoseconds spent blocked on reads.
    fn add_stall_ns(&mut self, ns: u64);
}

/// Hand each `(tag, record)` of `pending`, records of `tier`'s open step,
/// to `use_landed` exactly once, as soon as its read has landed and been
/// verified: every landed one in a pass, and when a pass finds none,
/// waiting (the stall) for whichever pending read lands first.
///
/// Bound: at most `pending.len()` waits, since each one lands a record.
pub(crate) fn serve_landed<C: PoolTier, T: Copy>(
    tier: &mut C,
    mut pending: Vec<(T, usize)>,
    mut use_landed: impl FnMut(&mut C, T, usize) -> Result<(), EngineError>,
) -> Result<(), EngineError> {
    while !pending.is_empty() {
        // Whatever landed is verified in parallel before it is used.
        tier.pool_mut().collect_landed()?;
        let mut progressed = false;
        let mut k = 0;
        while k < pending.len() {
            let (tag, r) = pending[k];
            match tier.pool_mut().bytes(r) {
                Ok(_) => {
                    use_landed(tier, tag, r)?;
                    pending.swap_remove(k);
                    progressed = true;
                }
                Err(ExpertsError::NotLanded { .. }) => k += 1,
                Err(e) => return Err(e.into()),
            }
        }
        if !progressed {
            let started = Instant::now();
            let records: Vec<usize> = pending.iter().map(|&(_, r)| r).collect();
            tier.pool_mut().wait_any(&records);
            tier.add_stall_ns(started.elapsed().as_nanos() as u64);
        }
    }
    Ok(())
}
