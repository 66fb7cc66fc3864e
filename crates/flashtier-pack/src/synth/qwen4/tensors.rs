//! The tensors of a synthetic Qwen4-Exp checkpoint, layer by layer, in
//! the names and shapes transformers saves.

use flashtier_format::{Dtype, xxh3_64};

use super::*;
use crate::synth::{Init, SynthTensor};

impl Qwen4Spec {
    /// Every tensor, in file order (see the module docs for the values).
    #[must_use]
    pub fn tensors(&self) -> Vec<SynthTensor> {
        let mut t = Tensors::default();
        let embed = "model.embed_tokens.weight";
        t.push(embed, &[self.vocab, self.hidden], Init::Uniform(1.0));
        for l in 0..self.layers {
            self.layer(&mut t, l);
        }
        self.mixer(&mut t, "model.hyper_connection_mixer", false);
        let shift = SUCCESSOR_SHIFT % self.vocab.max(1);
        t.push(
            "lm_head.weight",
            &[self.vocab, self.hidden],
            Init::ShiftedRows {
                scale: 1.0,
                of: xxh3_64(embed.as_bytes()),
                shift,
                rows: self.vocab,
                cols: self.hidden,
            },
        );
        t.0
    }

    fn layer(&self, t: &mut Tensors, l: u32) {
        let p = format!("model.layers.{l}");
        let one = l + 1;
        if let Some(rank) = self.ple_layers.iter().position(|&x| x == one) {
            self.ple(t, &p, rank);
        }
        self.mixer(t, &format!("{p}.attn_hyper_connection"), true);
        if self.is_linear(one) {
            self.linear_attention(t, &p);
        } else {
            self.sparse_attention(t, &p);
        }
        self.mixer(t, &format!("{p}.mlp_hyper_connection"), true);
        self.moe(t, &p);
    }

    fn mixer(&self, t: &mut Tensors, p: &str, inject: bool) {
        let wide = self.hidden * u64::from(self.hc_count);
        t.vector(
            &format!("{p}.hc_norm.weight"),
            wide,
            Init::Uniform(NORM_NOISE),
        );
        t.matrix(
            &format!("{p}.input_mix_weight_down.weight"),
            self.hc_lowrank,
            wide,
            1.0,
        );
        t.matrix(
            &format!("{p}.input_mix_weight_up.weight"),
            wide,
            self.hc_lowrank,
            1.0,
        );
        if inject {
            let hc = u64::from(self.hc_count);
            t.matrix(&format!("{p}.block_inject_weight.weight"), hc, wide, 1.0);
        }
    }

    fn linear_attention(&self, t: &mut Tensors, p: &str) {
        let h = self.hidden;
        let kd = u64::from(self.linear_k_heads) * self.linear_head_dim;
        let vd = u64::from(self.linear_v_heads) * self.linear_head_dim;
        let vh = u64::from(self.linear_v_heads);
        let a = format!("{p}.linear_attn");
        t.push(&format!("{a}.A_log"), &[vh], Init::Uniform(0.5));
        t.push(
            &format!("{a}.conv1d.weight"),
            &[2 * kd + vd, 1, 4],
            Init::Uniform(0.5),
        );
        t.push(&format!("{a}.dt_bias"), &[vh], Init::Uniform(0.5));
        t.matrix(&format!("{a}.in_proj_a.weight"), vh, h, 1.0);
        t.matrix(&format!("{a}.in_proj_b.weight"), vh, h, 1.0);
        t.matrix(&format!("{a}.in_proj_qkv.weight"), 2 * kd + vd, h, 1.0);
        t.matrix(&format!("{a}.in_proj_z.weight"), vd, h, 1.0);
        t.vector(
            &format!("{a}.norm.weight"),
            self.linear_head_dim,
            Init::NearOne(NORM_NOISE),
        );
        t.matrix(&format!("{a}.out_proj.weight"), h, vd, RESIDUAL_WRITE_SCALE);
    }

    fn sparse_attention(&self, t: &mut Tensors, p: &str) {
        let (h, d, di) = (self.hidden, self.head_dim, self.indexer_head_dim);
        let q = u64::from(self.heads) * d;
        let kv = u64::from(self.kv_heads) * d;
        let a = format!("{p}.self_attn");
        let noise = Init::Uniform(NORM_NOISE);
        t.matrix(
            &format!("{a}.indexer.index_qk_proj.weight"),
            (u64::from(self.indexer_heads) + 1) * di,
            h,
            1.0,
        );
        t.vector(&format!("{a}.indexer.k_layernorm.weight"), di, noise);
        t.vector(&format!("{a}.indexer.q_layernorm.weight"), di, noise);
        t.vector(&format!("{a}.k_norm.weight"), d, noise);
        t.matrix(&format!("{a}.k_proj.weight"), kv, h, 1.0);
        t.matrix(&format!("{a}.o_proj.weight"), h, q, RESIDUAL_WRITE_SCALE);
        t.vector(&format!("{a}.q_norm.weight"), d, noise);
        t.matrix(&format!("{a}.q_proj.weight"), 2 * q, h, 1.0);
        t.matrix(&format!("{a}.v_proj.weight"), kv, h, 1.0);
    }

    fn moe(&self, t: &mut Tensors, p: &str) {
        let h = self.hidden;
        for e in 0..self.experts {
            mlp(t, &format!("{p}.mlp.experts.{e}"), h, self.intermediate);
        }
        t.matrix(
            &format!("{p}.mlp.gate.weight"),
            u64::from(self.experts),
            h,
            1.0,
        );
        mlp(
            t,
            &format!("{p}.mlp.shared_expert"),
            h,
            self.shared_intermediate,
        );
        t.matrix(&format!("{p}.mlp.shared_expert_gate.weight"), 1, h, 1.0);
    }

    fn ple(&self, t: &mut Tensors, p: &str, rank: usize) {
        let (h, wide) = (self.hidden, self.hidden * u64::from(self.hc_count));
        let a = format!("{p}.ple");
        let noise = Init::Uniform(NORM_NOISE);
        t.push(
            &format!("{a}.conv1d.weight"),
            &[wide, 1, 4],
            Init::Uniform(0.5),
        );
        t.matrix(&format!("{a}.key_proj.weight"), wide, h, 1.0);
        for n in ["norm_conv", "norm_key", "norm_query"] {
            t.vector(&format!("{a}.{n}.weight"), wide, noise);
        }
        let rows = self.table_rows(rank);
        let parts = u64::from(self.split_parts.max(1));
        let per = rows.div_ceil(parts);
        for k in 0..parts {
            let n = per.min(rows.saturating_sub(k * per));
            t.push(
                &format!("{a}.ple_embedding.ngram_embedding.shard_{k}.weight"),
                &[n, self.row_dim()],
                Init::Uniform(1.0),
            );
        }
        t.matrix(
            &format!("{a}.value_proj.weight"),
            h,
            h,
            RESIDUAL_WRITE_SCALE,
        );
    }
}

/// One MLP's gate, up and down projections under `p`.
fn mlp(t: &mut Tensors, p: &str, hidden: u64, inter: u64) {
    t.matrix(&format!("{p}.gate_proj.weight"), inter, hidden, 1.0);
    t.matrix(&format!("{p}.up_proj.weight"), inter, hidden, 1.0);
    t.matrix(
        &format!("{p}.down_proj.weight"),
        hidden,
        inter,
        RESIDUAL_WRITE_SCALE,
    );
}

/// The tensor list being built (every tensor BF16).
#[derive(Default)]
struct Tensors(Vec<SynthTensor>);

impl Tensors {
    fn push(&mut self, name: &str, shape: &[u64], init: Init) {
        self.0.push(SynthTensor {
            name: name.to_string(),
            dtype: Dtype::Bf16,
            shape: shape.to_vec(),
            init,
        });
    }

    fn vector(&mut self, name: &str, len: u64, init: Init) {
        self.push(name, &[len], init);
    }

    /// `rows x cols`, uniform at `k / sqrt(cols)`.
    fn matrix(&mut self, name: &str, rows: u64, cols: u64, k: f32) {
        let scale = k / (cols as f32).sqrt();
        self.push(name, &[rows, cols], Init::Uniform(scale));
    }
}
