//! Sampling the next token from a row of logits: the OpenAI/vLLM knobs
//! (temperature, top-k, top-p, min-p, repetition, presence and frequency
//! penalties, logit bias, a seed) and the logprobs a client asks for.
//!
//! Order, as vLLM applies it: logit bias, then the penalties, then
//! temperature, then top-k, top-p and min-p over the tempered
//! distribution, then one draw. Temperature 0 is greedy: the lowest index
//! of the largest (biased, penalised) logit, the same token
//! [`crate::model::Want::Greedy`] picks when no bias or penalty applies.
//!
//! Reproducibility: a [`Sampler`] with a seed draws from ChaCha8 seeded
//! with it, one `u64` per token, and walks the kept tokens in a fixed
//! order (probability descending, then index ascending), so the same seed,
//! logits and parameters give the same tokens on any machine. Without a
//! seed the generator is seeded from the OS.
//!
//! Logprobs are those of the model's own distribution (the log-softmax of
//! the raw logits, before bias, penalties and temperature: vLLM's default),
//! so a client can score text independently of how it was sampled.
//!
//! Bounds: a sampler holds one count per distinct token it has seen (at
//! most the vocabulary); a pick sorts at most the kept candidates and never
//! allocates more than three vocabulary-sized buffers.

use std::collections::HashMap;

use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

mod filter;

use filter::{keep, unit, walk, walk_all};

/// The most alternatives a pick reports per position (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// A bad sampling parameter or logits row.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum SampleError {
    /// A parameter outside its range; names it, its value and the range.
    #[error("{name} = {value}: {range}")]
    Param {
        /// The parameter.
        name: &'static str,
        /// Its value, printed.
        value: String,
        /// What is allowed.
        range: &'static str,
    },
    /// A logit bias for a token the vocabulary does not have.
    #[error("logit_bias names token {token}, past the vocabulary of {vocab}")]
    BiasToken {
        /// The token.
        token: u32,
        /// The vocabulary size.
        vocab: usize,
    },
    /// The logits row is not a whole vocabulary, or holds NaN.
    #[error("logits row of {len} values for a vocabulary of {vocab}{}", if *.nan { " (NaN in it)" } else { "" })]
    Logits {
        /// Values given.
        len: usize,
        /// Values expected.
        vocab: usize,
        /// Whether a NaN was found.
        nan: bool,
    },
}

/// How to pick tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0: greedy; else logits are divided by it. Range [0, 100].
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the fewest most likely tokens whose mass reaches `top_p`
    /// (1: all). Range (0, 1].
    pub top_p: f32,
    /// Keep tokens at least `min_p` times as likely as the most likely
    /// (0: all). Range [0, 1].
    pub min_p: f32,
    /// HF/vLLM repetition penalty over the prompt and the output: a
    /// positive logit is divided by it, a negative one multiplied (1: off).
    /// Range (0, 100].
    pub repetition_penalty: f32,
    /// OpenAI presence penalty, subtracted once from every token the
    /// output holds. Range [-2, 2].
    pub presence_penalty: f32,
    /// OpenAI frequency penalty, subtracted once per occurrence in the
    /// output. Range [-2, 2].
    pub frequency_penalty: f32,
    /// Added to the named tokens' logits first. Each bias in [-100, 100].
    pub logit_bias: Vec<(u32, f32)>,
    /// The generator's seed (`None`: from the OS).
    pub seed: Option<u64>,
    /// Alternatives to report per position, with the chosen token's
    /// logprob (`None`: no logprobs). At most [`MAX_TOP_LOGPROBS`].
    pub logprobs: Option<usize>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self::greedy()
    }
}

impl SamplingParams {
    /// Greedy decoding, nothing else.
    #[must_use]
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            seed: None,
            logprobs: None,
        }
    }

    /// Whether a pick is the plain device argmax: greedy with no bias,
    /// penalty or logprobs (the server then asks the device for the token
    /// alone, never copying the logits).
    #[must_use]
    pub fn is_plain_greedy(&self) -> bool {
        self.temperature == 0.0
            && self.logit_bias.is_empty()
            && self.repetition_penalty == 1.0
            && self.presence_penalty == 0.0
            && self.frequency_penalty == 0.0
            && self.logprobs.is_none()
    }

    /// Check every parameter against its range and `vocab`.
    pub fn validate(&self, vocab: usize) -> Result<(), SampleError> {
        fn check(
            name: &'static str,
            v: f32,
            ok: bool,
            range: &'static str,
        ) -> Result<(), SampleError> {
            if ok && v.is_finite() {
                Ok(())
            } else {
                Err(SampleError::Param {
                    name,
                    value: v.to_string(),
                    range,
                })
            }
        }
        let t = self.temperature;
        check("temperature", t, (0.0..=100.0).contains(&t), "in [0, 100]")?;
        let p = self.top_p;
        check("top_p", p, p > 0.0 && p <= 1.0, "in (0, 1]")?;
        let m = self.min_p;
        check("min_p", m, (0.0..=1.0).contains(&m), "in [0, 1]")?;
        let r = self.repetition_penalty;
        check(
            "repetition_penalty",
            r,
            r > 0.0 && r <= 100.0,
            "in (0, 100]",
        )?;
        let pp = self.presence_penalty;
        check(
            "presence_penalty",
            pp,
            (-2.0..=2.0).contains(&pp),
            "in [-2, 2]",
        )?;
        let fp = self.frequency_penalty;
        check(
            "frequency_penalty",
            fp,
            (-2.0..=2.0).contains(&fp),
            "in [-2, 2]",
        )?;
        for &(token, bias) in &self.logit_bias {
            if token as usize >= vocab {
                return Err(SampleError::BiasToken { token, vocab });
            }
            check(
                "logit_bias",
                bias,
                (-100.0..=100.0).contains(&bias),
                "each bias in [-100, 100]",
            )?;
        }
        if let Some(n) = self.logprobs
            && n > MAX_TOP_LOGPROBS
        {
            return Err(SampleError::Param {
                name: "top_logprobs",
                value: n.to_string(),
                range: "at most 20",
            });
        }
        Ok(())
    }
}

/// One picked token, with its logprobs when asked for.
#[derive(Clone, Debug, PartialEq)]
pub struct Pick {
    /// The token.
    pub token: u32,
    /// Its logprob under the model's distribution (when asked for).
    pub logprob: Option<f32>,
    /// The most likely tokens and their logprobs, most likely first, ties
    /// to the lower index (as many as asked for).
    pub top: Vec<(u32, f32)>,
}

/// Picks a sequence's tokens: its parameters, its generator and the
/// counts the penalties need.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    /// Tokens of the output, with their counts (presence, frequency).
    output: HashMap<u32, u32>,
    /// Tokens of the prompt (repetition).
    prompt: HashMap<u32, u32>,
    vocab: usize,
}

impl Sampler {
    /// A sampler for one sequence whose prompt is `prompt`.
    pub fn new(params: SamplingParams, vocab: usize, prompt: &[u32]) -> Result<Self, SampleError> {
        params.validate(vocab)?;
        let seed = params.seed.unwrap_or_else(rand::random);
        let mut p = HashMap::new();
        if params.repetition_penalty != 1.0 {
            for &t in prompt {
                *p.entry(t).or_insert(0) += 1;
            }
        }
        Ok(Self {
            params,
            rng: ChaCha8Rng::seed_from_u64(seed),
            output: HashMap::new(),
            prompt: p,
            vocab,
        })
    }

    /// The parameters.
    #[must_use]
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Pick the next token from `logits` (one vocabulary row) and count it
    /// as output.
    pub fn pick(&mut self, logits: &[f32]) -> Result<Pick, SampleError> {
        if logits.is_empty() || logits.len() != self.vocab || logits.iter().any(|v| v.is_nan()) {
            return Err(SampleError::Logits {
                len: logits.len(),
                vocab: self.vocab,
                nan: logits.iter().any(|v| v.is_nan()),
            });
        }
        let token = if self.needs_processing() {
            let mut z = logits.to_vec();
            self.process(&mut z);
            self.draw(&z)
        } else {
            self.draw(logits)
        };
        let (logprob, top) = match self.params.logprobs {
            Some(n) => {
                let (lp, top) = logprobs(logits, token, n);
                (Some(lp), top)
            }
            None => (None, Vec::new()),
        };
        self.accept(token);
        Ok(Pick {
            token,
            logprob,
            top,
        })
    }

    /// Count `token` as output without picking it (a token the device
    /// picked greedily, or a forced one).
    pub fn accept(&mut self, token: u32) {
        if self.params.presence_penalty != 0.0
            || self.params.frequency_penalty != 0.0
            || self.params.repetition_penalty != 1.0
        {
            *self.output.entry(token).or_insert(0) += 1;
        }
    }

    fn needs_processing(&self) -> bool {
        let p = &self.params;
        !p.logit_bias.is_empty()
            || p.repetition_penalty != 1.0
            || p.presence_penalty != 0.0
            || p.frequency_penalty != 0.0
    }

    /// Bias and penalties, in place.
    fn process(&self, z: &mut [f32]) {
        let p = &self.params;
        for &(t, b) in &p.logit_bias {
            if let Some(v) = z.get_mut(t as usize) {
                *v += b;
            }
        }
        if p.repetition_penalty != 1.0 {
            let r = p.repetition_penalty;
            let seen = self.prompt.keys().chain(self.output.keys());
            let mut done = std::collections::HashSet::new();
            for &t in seen {
                if done.insert(t)
                    && let Some(v) = z.get_mut(t as usize)
                {
                    *v = if *v > 0.0 { *v / r } else { *v * r };
                }
            }
        }
        for (&t, &n) in &self.output {
            if let Some(v) = z.get_mut(t as usize) {
                *v -= p.presence_penalty + p.frequency_penalty * n as f32;
            }
        }
    }

    /// Temperature, the filters and one draw over processed logits.
    fn draw(&mut self, z: &[f32]) -> u32 {
        let p = &self.params;
        if p.temperature == 0.0 {
            return argmax(z);
        }
        let inv_t = 1.0 / f64::from(p.temperature);
        let max = f64::from(z.iter().copied().fold(f32::NEG_INFINITY, f32::max));
        if max == f64::NEG_INFINITY {
            // Every token biased away: the lowest index, as greedy would.
            return argmax(z);
        }
        // Unnormalised probabilities of the tempered distribution.
        let w: Vec<f64> = z
            .iter()
            .map(|&v| ((f64::from(v) - max) * inv_t).exp())
            .collect();
        let filtering = p.top_k != 0 || p.top_p < 1.0 || p.min_p > 0.0;
        let u = unit(self.rng.next_u64());
        if !filtering {
            return walk_all(&w, u);
        }
        let kept = keep(&w, p.top_k, p.top_p, p.min_p);
        walk(&w, &kept, u)
    }
}

/// The lowest index of the largest value (NaN-free input).
#[must_use]
pub fn argmax(z: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &v) in z.iter().enumerate() {
        if v > z[best] {
            best = i;
        }
    }
    best as u32
}

/// The log-softmax of `logits` at `token`, and its `n` largest entries
/// (most likely first, ties to the lower index).
#[must_use]
pub fn logprobs(logits: &[f32], token: u32, n: usize) -> (f32, Vec<(u32, f32)>) {
    let max = f64::from(logits.iter().copied().fold(f32::NEG_INFINITY, f32::max));
    let lse = max
        + logits
            .iter()
            .map(|&v| (f64::from(v) - max).exp())
            .sum::<f64>()
            .ln();
    let lp = |i: u32| (f64::from(logits[i as usize]) - lse) as f32;
    let mut top = Vec::new();
    if n > 0 {
        let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
        let by = |a: &u32, b: &u32| {
            logits[*b as usize]
                .total_cmp(&logits[*a as usize])
                .then(a.cmp(b))
        };
        let n = n.min(ids.len());
        if n < ids.len() {
            ids.select_nth_unstable_by(n - 1, by);
        }
        ids.truncate(n);
        ids.sort_unstable_by(by);
        top = ids.into_iter().map(|i| (i, lp(i))).collect();
    }
    (lp(token), top)
}

#[cfg(test)]
mod tests;
