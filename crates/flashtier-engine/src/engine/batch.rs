//! Several sequences through one [`Engine`]: the device-independent face
//! of [`Model::step_batch`] that a server's scheduler drives. Each
//! sequence owns a [`SeqKv`] ([`Engine::new_seq`]); a step takes any mix of
//! prompt chunks and decode tokens ([`EngineStep`]).
//!
//! Qwen4-Exp's decoder keeps its one sequence's state inside the model, so
//! it runs one sequence at a time ([`Engine::max_batch`] is 1): a step of a
//! sequence at position 0 starts it over, and a step of any other sequence
//! than the one the model holds is refused ([`EngineError::Shape`]), never
//! computed on another sequence's state.

use crate::device::KvState;
use crate::device::cpu::kernels::argmax;
use crate::device::cpu::kv::KvCache;
use crate::device::cuda::kv::CudaKv;
use crate::device::tier_stats::KvTierStats;
use crate::error::EngineError;
use crate::model::{Decoder, PREFILL_CHUNK, RowOut, SeqStep, Want};

use super::Engine;

/// One sequence's KV cache, on the engine's device.
pub enum SeqKv {
    /// The CPU engine's cache.
    Cpu(Box<KvCache>),
    /// A GPU cache.
    Cuda(Box<CudaKv>),
    /// Qwen4-Exp: the model holds the state; this counts positions.
    Qwen4 {
        /// Positions taken.
        len: usize,
        /// Positions it may take.
        capacity: usize,
        /// Which sequence, to refuse steps of another one.
        id: u64,
    },
}

impl std::fmt::Debug for SeqKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self {
            Self::Cpu(_) => "cpu",
            Self::Cuda(_) => "cuda",
            Self::Qwen4 { .. } => "qwen4",
        };
        write!(f, "SeqKv({kind}, {}/{})", self.len(), self.capacity())
    }
}

impl SeqKv {
    /// Positions held.
    #[must_use]
    pub fn len(&self) -> usize {
        match self {
            Self::Cpu(k) => k.len(),
            Self::Cuda(k) => k.len(),
            Self::Qwen4 { len, .. } => *len,
        }
    }

    /// Whether it holds nothing.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Positions it can hold.
    #[must_use]
    pub fn capacity(&self) -> usize {
        match self {
            Self::Cpu(k) => k.capacity(),
            Self::Cuda(k) => k.capacity(),
            Self::Qwen4 { capacity, .. } => *capacity,
        }
    }

    /// What the KV tier did for this cache (`None`: every position stays
    /// in the device's memory; today only a GPU cache past its HBM budget
    /// offloads).
    #[must_use]
    pub fn tier_stats(&self) -> Option<KvTierStats> {
        match self {
            Self::Cpu(k) => k.tier_stats(),
            Self::Cuda(k) => k.tier_stats(),
            Self::Qwen4 { .. } => None,
        }
    }

    /// Whether [`SeqKv::truncate`] can take positions back (a cache with
    /// chunks offloaded to a drive, and Qwen4-Exp's recurrent state,
    /// cannot).
    #[must_use]
    pub fn rewinds(&self) -> bool {
        match self {
            Self::Cpu(k) => k.rewinds(),
            Self::Cuda(k) => k.rewinds(),
            Self::Qwen4 { .. } => false,
        }
    }

    /// Keep the first `len` positions (a prefix another prompt shares);
    /// the next step writes after them.
    pub fn truncate(&mut self, len: usize) -> Result<(), EngineError> {
        let held = self.len();
        if len > held {
            return Err(EngineError::Shape {
                op: "kv truncate",
                what: format!("to {len} positions of a cache holding {held}"),
            });
        }
        match self {
            Self::Cpu(k) => k.rewind(held - len),
            Self::Cuda(k) => k.rewind(held - len),
            Self::Qwen4 { .. } if len == held => Ok(()),
            Self::Qwen4 { .. } => Err(EngineError::Shape {
                op: "kv truncate",
                what: "Qwen4-Exp's recurrent state cannot take positions back".to_string(),
            }),
        }
    }
}

/// One sequence's part of an engine step.
#[derive(Debug)]
pub struct EngineStep<'a> {
    /// The sequence.
    pub kv: &'a mut SeqKv,
    /// Its tokens this step.
    pub tokens: &'a [u32],
    /// What it wants of its last row.
    pub want: Want,
}

impl Engine {
    /// Logits per row.
    #[must_use]
    pub fn vocab_size(&self) -> usize {
        match self {
            Self::Cpu(m) => m.config().vocab_size,
            Self::Cuda(m) => m.config().vocab_size,
            Self::Qwen4(m) => m.config().vocab_size,
        }
    }

    /// The most positions a sequence may hold.
    #[must_use]
    pub fn context_limit(&self) -> usize {
        match self {
            Self::Cpu(m) => m.context_limit(),
            Self::Cuda(m) => m.context_limit(),
            Self::Qwen4(m) => m.positions().1,
        }
    }

    /// The most sequences one step takes (1 for Qwen4-Exp).
    #[must_use]
    pub fn max_batch(&self) -> usize {
        match self {
            Self::Qwen4(_) => 1,
            _ => PREFILL_CHUNK,
        }
    }

    /// The most rows (tokens of all sequences) one step of several
    /// sequences takes.
    #[must_use]
    pub fn max_step_rows(&self) -> usize {
        PREFILL_CHUNK
    }

    /// The most rows one step of a sequence alone takes, for a sequence
    /// that will hold `len` positions after them: the device's prompt step
    /// (1024 rows on a GPU without a KV budget, fewer for long contexts;
    /// one chunk on the CPU and for Qwen4-Exp).
    #[must_use]
    pub fn max_step_rows_alone(&self, len: usize) -> usize {
        match self {
            Self::Cpu(m) => m.prompt_rows(len),
            Self::Cuda(m) => m.prompt_rows(len),
            Self::Qwen4(_) => PREFILL_CHUNK,
        }
    }

    /// An empty sequence of at most `capacity` positions; `id` names it
    /// (Qwen4-Exp refuses steps of a sequence it does not hold).
    pub fn new_seq(&self, capacity: usize, id: u64) -> Result<SeqKv, EngineError> {
        match self {
            Self::Cpu(m) => Ok(SeqKv::Cpu(Box::new(m.new_kv(capacity)?))),
            Self::Cuda(m) => Ok(SeqKv::Cuda(Box::new(m.new_kv(capacity)?))),
            Self::Qwen4(m) => {
                let max = m.positions().1;
                if capacity == 0 || capacity > max {
                    return Err(EngineError::ContextFull { len: capacity, max });
                }
                Ok(SeqKv::Qwen4 {
                    len: 0,
                    capacity,
                    id,
                })
            }
        }
    }

    /// One forward step of every entry (see [`Model::step_batch`]):
    /// per entry, what its [`Want`] asked for.
    ///
    /// [`Model::step_batch`]: crate::model::Model::step_batch
    pub fn step_batch(&mut self, batch: &mut [EngineStep<'_>]) -> Result<Vec<RowOut>, EngineError> {
        match self {
            Self::Cpu(m) => {
                let mut steps = batch
                    .iter_mut()
                    .map(|e| match &mut *e.kv {
                        SeqKv::Cpu(kv) => Ok(SeqStep {
                            kv: &mut **kv,
                            tokens: e.tokens,
                            want: e.want,
                        }),
                        other => Err(foreign(other)),
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                rayon::scope(|_| m.step_batch(&mut steps))
            }
            Self::Cuda(m) => {
                let mut steps = batch
                    .iter_mut()
                    .map(|e| match &mut *e.kv {
                        SeqKv::Cuda(kv) => Ok(SeqStep {
                            kv: &mut **kv,
                            tokens: e.tokens,
                            want: e.want,
                        }),
                        other => Err(foreign(other)),
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                m.step_batch(&mut steps)
            }
            Self::Qwen4(m) => {
                let [e] = batch else {
                    return Err(EngineError::Shape {
                        op: "step_batch",
                        what: format!(
                            "{} Qwen4-Exp sequences in one step (one at a time)",
                            batch.len()
                        ),
                    });
                };
                let m = m.as_mut();
                qwen4_step(m, e)
            }
        }
    }
}

/// Which Qwen4-Exp sequence the model holds is the one whose id its last
/// step named; a fresh sequence (position 0) starts the model over.
fn qwen4_step(
    m: &mut super::Qwen4Engine,
    e: &mut EngineStep<'_>,
) -> Result<Vec<RowOut>, EngineError> {
    let SeqKv::Qwen4 { len, capacity, id } = e.kv else {
        return Err(foreign(e.kv));
    };
    if *len == 0 {
        m.reset()?;
        m.set_owner(*id);
    } else if m.owner() != Some(*id) || m.positions().0 != *len {
        return Err(EngineError::Shape {
            op: "step_batch",
            what: format!("Qwen4-Exp holds another sequence than {id} (one sequence at a time)"),
        });
    }
    if *len + e.tokens.len() > *capacity {
        return Err(EngineError::ContextFull {
            len: *len + e.tokens.len(),
            max: *capacity,
        });
    }
    let vocab = m.vocab();
    let logits = m.forward(e.tokens, false)?;
    *len += e.tokens.len();
    let last = logits
        .len()
        .checked_sub(vocab)
        .and_then(|s| logits.get(s..))
        .ok_or_else(|| EngineError::Shape {
            op: "step_batch",
            what: "Qwen4-Exp gave no logits row".to_string(),
        })?;
    Ok(vec![match e.want {
        Want::Nothing => RowOut::Nothing,
        Want::Greedy => RowOut::Token(argmax(last) as u32),
        Want::Logits => RowOut::Logits(last.to_vec()),
    }])
}

fn foreign(kv: &SeqKv) -> EngineError {
    EngineError::Shape {
        op: "step_batch",
        what: format!("{kv:?} is not this engine's device"),
    }
}

impl Engine {
    /// [`Engine::generate`] with tokens picked by `params` ([`Sampler`]):
    /// the prompt in steps of at most [`PREFILL_CHUNK`] tokens on a fresh
    /// sequence, then one step per token until `max_new` tokens or a token
    /// of `stop_ids` (kept as the last generated id). Temperature 0 with no
    /// penalty or bias picks on the device, as greedy decoding does: the
    /// same tokens as [`Engine::generate`].
    ///
    /// [`Sampler`]: crate::sample::Sampler
    pub fn generate_sampled(
        &mut self,
        prompt: &[u32],
        max_new: usize,
        stop_ids: &[u32],
        params: &crate::sample::SamplingParams,
        mut on_token: impl FnMut(u32),
    ) -> Result<crate::model::Generation, EngineError> {
        use std::time::Instant;
        let vocab = self.vocab_size();
        let mut sampler = crate::sample::Sampler::new(params.clone(), vocab, prompt)
            .map_err(|e| EngineError::config("sampling", e.to_string()))?;
        let want = if params.is_plain_greedy() {
            Want::Greedy
        } else {
            Want::Logits
        };
        let need = prompt.len() + max_new.max(1);
        let mut kv = self.new_seq(need.min(self.context_limit()), 0)?;
        let start = self.expert_stats();
        let t0 = Instant::now();
        let mut out = RowOut::Nothing;
        let rows = self.max_step_rows_alone(prompt.len()).max(1);
        let chunks: Vec<&[u32]> = prompt.chunks(rows).collect();
        for (i, chunk) in chunks.iter().enumerate() {
            let w = if i + 1 == chunks.len() {
                want
            } else {
                Want::Nothing
            };
            let mut step = [EngineStep {
                kv: &mut kv,
                tokens: chunk,
                want: w,
            }];
            out = self.step_batch(&mut step)?.remove(0);
        }
        let prefill_secs = t0.elapsed().as_secs_f64();
        let after_prefill = self.expert_stats();
        let t1 = Instant::now();
        let mut generated = Vec::new();
        let mut steps = 0u64;
        loop {
            let token = match std::mem::replace(&mut out, RowOut::Nothing) {
                RowOut::Token(t) => {
                    sampler.accept(t);
                    t
                }
                RowOut::Logits(z) => {
                    sampler
                        .pick(&z)
                        .map_err(|e| EngineError::config("sampling", e.to_string()))?
                        .token
                }
                RowOut::Nothing => break,
            };
            generated.push(token);
            on_token(token);
            if generated.len() >= max_new || stop_ids.contains(&token) || kv.len() >= kv.capacity()
            {
                break;
            }
            let t = [token];
            let mut step = [EngineStep {
                kv: &mut kv,
                tokens: &t,
                want,
            }];
            out = self.step_batch(&mut step)?.remove(0);
            steps += 1;
        }
        let end = self.expert_stats();
        Ok(crate::model::Generation {
            generated_ids: generated,
            prompt_tokens: prompt.len(),
            prefill_secs,
            decode_secs: t1.elapsed().as_secs_f64(),
            decode_steps: steps,
            prefill_experts: after_prefill.since(&start),
            decode_experts: end.since(&after_prefill),
            total_experts: end.since(&start),
            ..Default::default()
        })
    }
}

impl Engine {
    /// [`crate::model::Model::decode_chained`] on the GPU: one greedy
    /// sequence's decode steps chained on the device, `take` deciding when
    /// to stop (a stop token, a new request to batch with). `None` where
    /// steps do not chain (the CPU engines, a cache with offloaded
    /// chunks): the caller steps with [`Engine::step_batch`].
    pub fn decode_chained(
        &mut self,
        kv: &mut SeqKv,
        first: u32,
        max_new: usize,
        take: &mut dyn FnMut(u32) -> bool,
    ) -> Result<Option<usize>, EngineError> {
        match (self, kv) {
            (Self::Cuda(m), SeqKv::Cuda(kv)) => m.decode_chained(kv, first, max_new, take),
            _ => Ok(None),
        }
    }
}
