//! Per-Layer Embedding (PLE): hashed n-gram rows injected into every
//! hyper-connection stream of a `linear_attention` layer, before its mixer.
//!
//! For each token: the layer's n-gram ids ([`super::ngram`]) pick one row
//! per head from the layer's table; the rows, concatenated (`e`), give one
//! value `value_proj(e)` and one key per stream `norm_key(key_proj(e))`;
//! stream `s`'s gate is `g = (key_s . norm_query(x)_s) / sqrt(hidden)`,
//! signed-square-rooted (`sign(g) sqrt(max(|g|, 1e-6))`), and the stream
//! gets `sigmoid(g) value` plus a dilated depthwise conv (kernel
//! `ple_conv_kernel_size`, dilation `ngram_size`, SiLU) over the normed
//! gated values (`norm_conv`); the conv state is the last
//! `(kernel - 1) * ngram_size` of them (zeros before the first).
//!
//! Rows are read from the checkpoint's `ngram_embedding.shard_K.weight`
//! shards (`split_ngram_parts` of them, concatenated in order, or one
//! unsplit `ngram_embedding.weight`): all of a step's rows as one batch of
//! ranged reads through the checkpoint's backend, so no table is resident;
//! or, with [`super::rows::PleRowOptions`], from the row store
//! ([`super::rows`]: packed shards, a RAM cache, the step's reads started
//! for every PLE layer before the first layer runs, and in a long prompt
//! the next step's reads right behind them, `PleLayer::read_ahead`). Both
//! give the same bytes, so the same output bits. On the device the rows
//! land through [`HybridOps::land`] (pinned memory and a copy stream on the
//! GPU).

use flashtier_format::Dtype;
use flashtier_format::widen::to_f32;

use crate::checkpoint::Checkpoint;
use crate::config::qwen4::Qwen4Config;
use crate::device::Activation;
use crate::device::hybrid::{ConvSpec, HybridOps};
use crate::error::EngineError;
use crate::load::weights::Loader;

use super::ngram::{NgramSpec, PleNgramHasher};
use super::ops::one_plus;
use super::rows::{LayerRows, PleRowOptions, PleRowStats, table_names, table_stem};

/// One row shard of a PLE table.
struct Shard {
    name: String,
    first_row: u64,
    rows: u64,
    dtype: Dtype,
}

/// One PLE layer with its n-gram context and conv state.
pub struct PleLayer<D: HybridOps> {
    hasher: PleNgramHasher,
    shards: Vec<Shard>,
    row_dim: usize,
    streams: usize,
    hidden: usize,
    eps: f32,
    key_proj: D::Mat,
    value_proj: D::Mat,
    norm_key: D::Vector,
    norm_query: D::Vector,
    norm_conv: D::Vector,
    /// `[streams * hidden][kernel]`.
    conv: D::Vector,
    conv_spec: ConvSpec,
    /// The last `(kernel - 1) * dilation` normed gated values, oldest first.
    conv_state: D::Act,
    /// Table rows read so far.
    pub rows_read: u64,
    /// The row store's shards, when rows come from it.
    rows: Option<LayerRows>,
    /// This step's ids, computed before the layers run ([`Self::start_step`]).
    step_ids: Option<Vec<u64>>,
    /// Where the step's rows land on the device.
    landing: D::Landing,
    /// This step's rows were landed before the step's first kernel
    /// ([`Self::land`]).
    landed: bool,
}

impl<D: HybridOps> PleLayer<D> {
    /// Load `{prefix}.ple.*` of the PLE layer of rank `rank`.
    pub fn load(
        l: &Loader<'_, D>,
        cfg: &Qwen4Config,
        prefix: &str,
        rank: usize,
    ) -> Result<Self, EngineError> {
        let ckpt = l.ckpt;
        let p = cfg
            .ple
            .as_ref()
            .ok_or_else(|| EngineError::config("ple_layer_ids", "missing"))?;
        let hasher = PleNgramHasher::new(NgramSpec::of_config(cfg.vocab_size, p), rank);
        check_hash_buffers(ckpt, &format!("{prefix}.ple.ple_embedding"), &hasher)?;
        let (h, hc) = (cfg.hidden_size, cfg.hc_count);
        let wide = h * hc;
        let pre = format!("{prefix}.ple");
        let norm = |n: &str| -> Result<D::Vector, EngineError> {
            let w = ckpt.load_f32(&format!("{pre}.{n}.weight"), &[wide])?;
            l.dev.vector(one_plus(w))
        };
        let shards = table_shards(
            ckpt,
            &table_stem(prefix),
            p.split_parts,
            p.row_dim(),
            hasher.rows(),
        )?;
        let conv_spec = ConvSpec {
            kernel: p.conv_kernel,
            dilation: p.ngram_size,
        };
        let conv = ckpt.load_f32(&format!("{pre}.conv1d.weight"), &[wide, 1, p.conv_kernel])?;
        Ok(Self {
            shards,
            row_dim: p.row_dim(),
            streams: hc,
            hidden: h,
            eps: cfg.rms_norm_eps,
            key_proj: l.matrix(&format!("{pre}.key_proj.weight"), [wide, p.embed_dim])?,
            value_proj: l.matrix(&format!("{pre}.value_proj.weight"), [h, p.embed_dim])?,
            norm_key: norm("norm_key")?,
            norm_query: norm("norm_query")?,
            norm_conv: norm("norm_conv")?,
            conv: l.dev.vector(conv)?,
            conv_state: l.dev.state(conv_spec.state_rows(), wide)?,
            conv_spec,
            rows_read: 0,
            hasher,
            rows: None,
            step_ids: None,
            landing: l.dev.landing(p.embed_dim)?,
            landed: false,
        })
    }

    /// Serve this layer's rows from the row store (PLE layer `layer`,
    /// `cache_bytes` of cache per shard).
    pub(crate) fn use_row_store(
        &mut self,
        ckpt: &Checkpoint,
        layer: usize,
        opts: &PleRowOptions,
        cache_bytes: u64,
    ) -> Result<(), EngineError> {
        let names: Vec<String> = self.shards.iter().map(|s| s.name.clone()).collect();
        self.rows = Some(LayerRows::open(ckpt, layer, &names, opts, cache_bytes)?);
        Ok(())
    }

    /// Shards of the table.
    pub(crate) fn shard_count(&self) -> usize {
        self.shards.len()
    }

    /// Row-store counters (`None` when rows come from the checkpoint).
    pub(crate) fn row_stats(&self) -> Option<PleRowStats> {
        let mut s = self.rows.as_ref()?.stats();
        s.lookups = self.rows_read;
        Some(s)
    }

    /// Hash `tokens` into this step's ids and start their row reads (the
    /// row store's prefetch; nothing to start for checkpoint reads).
    pub(crate) fn start_step(&mut self, tokens: &[u32]) -> Result<(), EngineError> {
        let ids: Vec<u64> = self.hasher.step(tokens).into_iter().flatten().collect();
        if let Some(rows) = &mut self.rows {
            rows.prefetch(&per_shard(&self.shards, &ids)?)?;
        }
        self.step_ids = Some(ids);
        Ok(())
    }

    /// Start reading the rows of `next`, the prompt's tokens after this
    /// step's (after [`Self::start_step`]), while this step computes; the
    /// next step's reads wait for them first. Nothing to start for
    /// checkpoint reads. Changes reads, never results.
    pub(crate) fn read_ahead(&mut self, next: &[u32]) -> Result<(), EngineError> {
        let Some(rows) = &mut self.rows else {
            return Ok(());
        };
        let ids: Vec<u64> = self
            .hasher
            .ids(next, self.hasher.eos_segments)
            .into_iter()
            .flatten()
            .collect();
        rows.read_ahead(&per_shard(&self.shards, &ids)?)
    }

    /// Row-store prefetches started ahead and not yet waited for.
    #[cfg(test)]
    pub(crate) fn reads_ahead(&self) -> usize {
        self.rows.as_ref().map_or(0, LayerRows::ahead_len)
    }

    /// Make EOS start no segment (only to show the fixture needs it).
    #[cfg(test)]
    pub(crate) fn ignore_eos_segments(&mut self) {
        self.hasher.eos_segments = false;
    }

    /// Forget the sequence.
    pub fn reset(&mut self, dev: &D) -> Result<(), EngineError> {
        self.hasher.reset();
        self.step_ids = None;
        if let Some(r) = &mut self.rows {
            r.forget_ahead();
        }
        self.landed = false;
        self.conv_state = dev.state(self.conv_state.rows(), self.conv_state.cols())?;
        Ok(())
    }

    /// Where row `id` lives: shard tensor, byte offset, length, dtype.
    fn locate(&self, id: u64) -> Result<(&str, u64, usize, Dtype), EngineError> {
        let (k, _) = locate_shard(&self.shards, id)?;
        let shard = &self.shards[k];
        let row_bytes = self.row_dim * shard.dtype.size_bytes() as usize;
        let offset = (id - shard.first_row) * row_bytes as u64;
        Ok((shard.name.as_str(), offset, row_bytes, shard.dtype))
    }

    /// The rows `ids` (all of a step's), read as one batch and concatenated
    /// in order, widened to f32.
    fn gather(&mut self, ckpt: &Checkpoint, ids: &[u64]) -> Result<Vec<f32>, EngineError> {
        if self.rows.is_some() {
            return self.gather_from_store(ids);
        }
        let places = ids
            .iter()
            .map(|&id| self.locate(id))
            .collect::<Result<Vec<_>, _>>()?;
        let ranges: Vec<(&str, u64, usize)> = places.iter().map(|p| (p.0, p.1, p.2)).collect();
        let bufs = ckpt.read_ranges(&ranges)?;
        let mut out = Vec::with_capacity(ids.len() * self.row_dim);
        for (buf, place) in bufs.iter().zip(&places) {
            out.extend(to_f32(buf, place.3));
        }
        self.rows_read += ids.len() as u64;
        Ok(out)
    }

    /// Read this step's rows (the reads [`Self::start_step`] started) and
    /// land them on the device now, before the step's first kernel: a
    /// device that records a step's launches (the GPU, with every expert
    /// resident) then has no copy in the middle of the recording. The same
    /// bytes as read in [`Self::forward`], so the same output.
    pub(crate) fn land(
        &mut self,
        dev: &D,
        ckpt: &Checkpoint,
        tokens: &[u32],
    ) -> Result<(), EngineError> {
        self.land_rows(dev, ckpt, tokens)?;
        self.landed = true;
        Ok(())
    }

    /// Read this step's rows (`tokens.len() x embed_dim`) and land them.
    fn land_rows(&mut self, dev: &D, ckpt: &Checkpoint, tokens: &[u32]) -> Result<(), EngineError> {
        if self.step_ids.is_none() {
            self.start_step(tokens)?;
        }
        let ids = self.step_ids.take().unwrap_or_default();
        let rows = self.gather(ckpt, &ids)?;
        dev.land(&mut self.landing, tokens.len(), &rows)
    }

    /// Add the layer's injection for `tokens` into `x` (`rows x streams * hidden`).
    pub fn forward(
        &mut self,
        dev: &D,
        ckpt: &Checkpoint,
        x: &mut D::Act,
        tokens: &[u32],
    ) -> Result<(), EngineError> {
        let rows = tokens.len();
        let (h, wide) = (self.hidden, self.hidden * self.streams);
        if !std::mem::take(&mut self.landed) {
            self.land_rows(dev, ckpt, tokens)?;
        }
        let e = dev.landed(&self.landing)?;
        let mut key_raw = dev.zeros(rows, wide)?;
        dev.linear(&mut key_raw, &self.key_proj, e)?;
        let mut key = dev.zeros(rows, wide)?;
        dev.rms_norm_wide(&mut key, &key_raw, &self.norm_key, h, self.eps)?;
        let mut value = dev.zeros(rows, h)?;
        dev.linear(&mut value, &self.value_proj, e)?;
        dev.landed_read(&mut self.landing)?;
        let mut query = dev.zeros(rows, wide)?;
        dev.rms_norm_wide(&mut query, x, &self.norm_query, h, self.eps)?;
        let mut gated = dev.zeros(rows, wide)?;
        dev.ple_gate(&mut gated, (&key, &query), &value)?;
        let mut normed = dev.zeros(rows, wide)?;
        dev.rms_norm_wide(&mut normed, &gated, &self.norm_conv, h, self.eps)?;
        let mut conv = dev.zeros(rows, wide)?;
        dev.causal_conv(
            &mut self.conv_state,
            &normed,
            &self.conv,
            self.conv_spec,
            &mut conv,
        )?;
        // `x + (gated + conv)`, as the reference adds them.
        dev.add(&mut gated, &conv)?;
        dev.add(x, &gated)
    }
}

/// `ids` by shard: each shard's local row indices, in order.
fn per_shard(shards: &[Shard], ids: &[u64]) -> Result<Vec<Vec<u64>>, EngineError> {
    let mut out = vec![Vec::new(); shards.len()];
    for &id in ids {
        let (k, local) = locate_shard(shards, id)?;
        out[k].push(local);
    }
    Ok(out)
}

/// The shard holding row `id` and the row's index in it.
fn locate_shard(shards: &[Shard], id: u64) -> Result<(usize, u64), EngineError> {
    shards
        .iter()
        .position(|s| id >= s.first_row && id < s.first_row + s.rows)
        .map(|k| (k, id - shards[k].first_row))
        .ok_or_else(|| EngineError::Shape {
            op: "ple row",
            what: format!("row {id} is outside the table"),
        })
}

impl<D: HybridOps> PleLayer<D> {
    /// [`Self::gather`] through the row store: each shard's rows looked up
    /// as one batch, put back in the order of `ids`.
    fn gather_from_store(&mut self, ids: &[u64]) -> Result<Vec<f32>, EngineError> {
        let dtype = self.shards.first().map_or(Dtype::Bf16, |s| s.dtype);
        let row_bytes = self.row_dim * dtype.size_bytes() as usize;
        let mut per_shard: Vec<(Vec<usize>, Vec<u64>)> =
            vec![Default::default(); self.shards.len()];
        for (at, &id) in ids.iter().enumerate() {
            let (k, local) = locate_shard(&self.shards, id)?;
            per_shard[k].0.push(at);
            per_shard[k].1.push(local);
        }
        let mut bytes = vec![0u8; ids.len() * row_bytes];
        let Some(rows) = self.rows.as_mut() else {
            return Err(EngineError::Shape {
                op: "ple row",
                what: "no row store".into(),
            });
        };
        for (k, (places, local)) in per_shard.iter().enumerate() {
            if local.is_empty() {
                continue;
            }
            let mut buf = vec![0u8; local.len() * row_bytes];
            rows.lookup(k, local, &mut buf)?;
            for (&at, row) in places.iter().zip(buf.chunks_exact(row_bytes)) {
                bytes[at * row_bytes..(at + 1) * row_bytes].copy_from_slice(row);
            }
        }
        self.rows_read += ids.len() as u64;
        Ok(to_f32(&bytes, dtype))
    }
}

/// The shards of table `stem` (`{stem}.shard_K.weight`, or one
/// `{stem}.weight`), checked to be `row_dim` wide and `rows` long together.
fn table_shards(
    ckpt: &Checkpoint,
    stem: &str,
    parts: usize,
    row_dim: usize,
    rows: u64,
) -> Result<Vec<Shard>, EngineError> {
    let names = table_names(ckpt.source(), stem, parts);
    let mut shards = Vec::with_capacity(names.len());
    let mut first_row = 0u64;
    for name in names {
        let (info, dtype) = ckpt.info(&name)?;
        let n = match info.shape.as_slice() {
            [n, w] if *w == row_dim as u64 => *n,
            _ => {
                return Err(EngineError::TensorShape {
                    name,
                    got: info.shape.clone(),
                    want: vec![rows.div_ceil(parts as u64), row_dim as u64],
                });
            }
        };
        shards.push(Shard {
            name,
            first_row,
            rows: n,
            dtype,
        });
        first_row += n;
    }
    if first_row != rows {
        return Err(EngineError::ConfigMismatch {
            field: "ngram_vocab_size_base".into(),
            value: format!("{rows} hashed rows"),
            found: format!("the table `{stem}` holds {first_row} rows"),
        });
    }
    Ok(shards)
}

/// Where the checkpoint keeps transformers' hash buffers, they must equal
/// the ones the config gives (a different `seed`, vocabulary base or
/// n-gram shape would otherwise pick other rows silently).
fn check_hash_buffers(
    ckpt: &Checkpoint,
    stem: &str,
    h: &PleNgramHasher,
) -> Result<(), EngineError> {
    let buffers = [
        ("layer_multipliers", h.multipliers(), "seed"),
        (
            "ngram_heads_vocab_sizes",
            h.head_sizes(),
            "ngram_vocab_size_base",
        ),
        (
            "ngram_heads_offsets",
            h.head_offsets(),
            "ngram_vocab_size_base",
        ),
    ];
    for (buffer, want, field) in buffers {
        let name = format!("{stem}.{buffer}");
        if !ckpt.contains(&name) {
            continue;
        }
        let got = ckpt.load_i64(&name, want.len())?;
        if got
            .iter()
            .zip(want)
            .any(|(g, w)| u64::try_from(*g).ok() != Some(*w))
        {
            return Err(EngineError::ConfigMismatch {
                field: field.into(),
                value: format!("the hash parameters {}", list(want)),
                found: format!("the checkpoint's `{name}` holds {}", list(&got)),
            });
        }
    }
    Ok(())
}

/// `1, 2, 3` for a message.
fn list<T: std::fmt::Display>(v: &[T]) -> String {
    v.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}
