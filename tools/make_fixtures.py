#!/usr/bin/env python3
"""Make the decode engine's reference fixtures with HF transformers.

Writes small random-weight Qwen3-MoE, Qwen2-MoE (shared expert, q/k/v
bias) and Mixtral checkpoints (bf16
safetensors + config.json) and, for each, the reference prompt logits and
greedy tokens computed by transformers itself in f32 from the bf16 weights.
flashtier's engine tests (crates/flashtier/tests/engine_fixtures.rs) must
reproduce them.

Usage (needs torch, transformers, safetensors; CPU is enough):

    python3 tools/make_fixtures.py --out crates/flashtier-engine/tests/fixtures/engine

Each model folder gets:
  config.json            the config as transformers writes it
  model*.safetensors     bf16 weights (hub layout: one tensor per expert
                         matrix, or the fused transformers-5 layout, see
                         FIXTURES below), sharded with an index where asked
  reference.json         prompt_ids, prompt_logits [pos][vocab] (f32),
                         greedy_ids (new tokens), margins, versions
  tokenizer.json         (one model only) a tiny word-level tokenizer

Seeds are searched until the greedy choices and the router's top-k choices
have margins far above f32 rounding, so an exact implementation must
reproduce the tokens and the routing.
"""

import argparse
import json
import math
import os
import sys

import torch
import transformers

import fixture_kit
from fixture_kit import greedy_steps, save_shards, search_seeds, topk_gap

PROMPT_LEN = 6
NEW_TOKENS = 8
MIN_TOKEN_MARGIN = 2e-3
MIN_ROUTER_MARGIN = 2e-4

DEEPSEEK_V3 = {
    "name": "deepseek_v3",
    "arch": "deepseek_v3",
    "layout": "hub",
    "shards": 1,
    "tokenizer": False,
    # YaRN with mscale != mscale_all_dim, so both the cos/sin factor and
    # the softmax scale differ from plain RoPE.
    "rope": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8},
    "config": dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=24,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=2,
        n_routed_experts=16,
        routed_scaling_factor=2.5,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=3,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
        rope_theta=10000.0,
        num_mtp_layers=0,
    ),
}

FIXTURES = [
    {
        # Qwen3-MoE with YaRN as its long-context configs enable it
        # (rope_scaling type yarn, factor 4): cos/sin scaled by the YaRN
        # attention factor, no softmax correction.
        "name": "qwen3_moe_yarn",
        "arch": "qwen3_moe",
        "layout": "hub",
        "shards": 1,
        "tokenizer": False,
        "rope": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        "config": dict(
            vocab_size=320,
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=24,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            tie_word_embeddings=False,
            rms_norm_eps=1e-6,
            max_position_embeddings=256,
            rope_theta=10000.0,
        ),
    },
    DEEPSEEK_V3,
    # DeepSeek-V3 as the hub ships it: FP8 E4M3 matrices with a float32 scale
    # per block (weight_scale_inv); 16x16 blocks so a small model still has
    # several per matrix, and one shared expert. The reference runs
    # transformers in f32 on the dequantized weights.
    dict(DEEPSEEK_V3, name="deepseek_v3_fp8", fp8_block=[16, 16],
         config=dict(DEEPSEEK_V3["config"], n_shared_experts=1)),
    {
        "name": "qwen2_moe",
        "arch": "qwen2_moe",
        "layout": "hub",
        "shards": 1,
        "tokenizer": False,
        "config": dict(
            vocab_size=320,
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[2],
            tie_word_embeddings=False,
            rms_norm_eps=1e-6,
            max_position_embeddings=256,
            rope_theta=10000.0,
            use_sliding_window=False,
        ),
    },
    {
        "name": "qwen3_moe",
        "arch": "qwen3_moe",
        "layout": "hub",
        "shards": 1,
        "tokenizer": True,
        "config": dict(
            vocab_size=384,
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=24,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
            rms_norm_eps=1e-6,
            max_position_embeddings=256,
            rope_theta=10000.0,
        ),
    },
    {
        "name": "qwen3_moe_tied",
        "arch": "qwen3_moe",
        "layout": "fused",
        "shards": 2,
        "tokenizer": False,
        "config": dict(
            vocab_size=320,
            hidden_size=64,
            intermediate_size=80,
            moe_intermediate_size=40,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=False,
            decoder_sparse_step=2,
            mlp_only_layers=[],
            tie_word_embeddings=True,
            rms_norm_eps=1e-6,
            max_position_embeddings=256,
            rope_theta=1000000.0,
        ),
    },
    {
        "name": "mixtral",
        "arch": "mixtral",
        "layout": "hub",
        "shards": 1,
        "tokenizer": False,
        "config": dict(
            vocab_size=320,
            hidden_size=64,
            intermediate_size=40,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=8,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
            rms_norm_eps=1e-5,
            max_position_embeddings=256,
            rope_theta=1000000.0,
            sliding_window=None,
        ),
    },
]

WORDS = (
    "the a of to and in is it that was for on are with as his they be at one "
    "have this from or had by hot word but what some we can out other were all "
    "there when up use your how said an each she which do their time if will way "
    "about many then them write would like so these her long make thing see him "
    "two has look more day could go come did number sound no most people my over "
    "know water than call first who may down side been now find flash tier expert "
    "stream drive memory page cache token model fast slow quick brown fox jumps "
    "lazy dog"
).split()


def make_config(spec):
    cfg = dict(spec["config"])
    cls = {
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "qwen2_moe": transformers.Qwen2MoeConfig,
        "mixtral": transformers.MixtralConfig,
        "deepseek_v3": getattr(transformers, "DeepseekV3Config", None),
    }[spec["arch"]]
    if int(transformers.__version__.split(".")[0]) >= 5:
        # transformers 5 spells rope_theta inside rope_parameters.
        theta = cfg.pop("rope_theta")
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": theta, **spec.get("rope", {})}
    elif "rope" in spec:
        cfg["rope_scaling"] = dict(spec["rope"])
    config = cls(**cfg)
    config._attn_implementation = "eager"
    print(f"  config rope: {getattr(config, 'rope_parameters', None)} "
          f"{getattr(config, 'rope_theta', None)}", flush=True)
    return config


def make_model(spec, seed):
    config = make_config(spec)
    torch.manual_seed(seed)
    model = {
        "qwen3_moe": transformers.Qwen3MoeForCausalLM,
        "qwen2_moe": transformers.Qwen2MoeForCausalLM,
        "mixtral": transformers.MixtralForCausalLM,
        "deepseek_v3": getattr(transformers, "DeepseekV3ForCausalLM", None),
    }[spec["arch"]](config)
    model = model.float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                # RMSNorm weights and attention biases: near one, but not one.
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            elif "lm_head" in name:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) * (2.0 / math.sqrt(fan_in)))
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(fan_in))
        # DeepSeek-V3's routing bias (a buffer): small, so it changes choices.
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.05 * torch.randn(b.shape, generator=gen))
        # The weights the engine sees are bf16: make the reference use the same.
        for p in list(model.parameters()) + [
                b for n, b in model.named_buffers() if "e_score_correction_bias" in n]:
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    return model


def moe_block(layer):
    for attr in ("block_sparse_moe", "mlp"):
        block = getattr(layer, attr, None)
        if block is not None and hasattr(block, "experts"):
            return attr, block
    return None, None


def expert_matrices(experts, e, inter):
    """(gate [I,H], up [I,H], down [H,I]) of expert e, whatever the layout."""
    if hasattr(experts, "gate_up_proj"):
        gu = experts.gate_up_proj[e]
        down = experts.down_proj[e]
        if down.shape[-1] == inter:
            # transformers 5: gate_up_proj [E, 2I, H], down_proj [E, H, I].
            return gu[:inter], gu[inter:], down
        # the transposed spelling: gate_up_proj [E, H, 2I], down_proj [E, I, H].
        return gu[:, :inter].T, gu[:, inter:].T, down.T
    ex = experts[e]
    if hasattr(ex, "w1"):
        return ex.w1.weight, ex.w3.weight, ex.w2.weight
    return ex.gate_proj.weight, ex.up_proj.weight, ex.down_proj.weight


def export_state(model, spec):
    """The checkpoint's tensors, named as on the hub (or fused, if asked)."""
    state = {}
    moe_prefixes = []
    for i, layer in enumerate(model.model.layers):
        attr, block = moe_block(layer)
        if block is None:
            continue
        live = f"model.layers.{i}.{attr}."
        moe_prefixes.append(live)
        hub = f"model.layers.{i}.{'block_sparse_moe' if spec['arch'] == 'mixtral' else 'mlp'}."
        state[hub + "gate.weight"] = block.gate.weight.detach()
        inter = spec["config"].get("moe_intermediate_size", spec["config"]["intermediate_size"])
        mats = [expert_matrices(block.experts, e, inter) for e in range(spec_experts(spec))]
        if spec["layout"] == "fused":
            state[hub + "experts.gate_up_proj"] = torch.stack(
                [torch.cat([g, u], dim=0) for g, u, _ in mats]
            ).detach()
            state[hub + "experts.down_proj"] = torch.stack([d for _, _, d in mats]).detach()
        else:
            names = ("w1", "w3", "w2") if spec["arch"] == "mixtral" else (
                "gate_proj", "up_proj", "down_proj")
            for e, trio in enumerate(mats):
                for n, m in zip(names, trio):
                    state[f"{hub}experts.{e}.{n}.weight"] = m.detach()
        # Qwen2-MoE's shared expert and its sigmoid gate, DeepSeek's shared
        # experts and routing bias, as named on the hub.
        for n, p in list(block.named_parameters()) + list(block.named_buffers()):
            if n.startswith("shared_expert") or n.endswith("e_score_correction_bias"):
                state[hub + n] = p.detach()
    for k, v in model.state_dict().items():
        if any(k.startswith(p) for p in moe_prefixes):
            continue
        if k == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        state[k] = v
    return {k: v.to(torch.bfloat16).contiguous().clone() for k, v in state.items()}


def spec_experts(spec):
    c = spec["config"]
    return c.get("num_experts", c.get("num_local_experts", c.get("n_routed_experts")))


def router_margin(model, ids, k):
    """Smallest gap between the k-th and (k+1)-th router logit, all layers."""
    gaps = []
    hooks = []

    def hook(module, inputs, _output):
        x = inputs[0].reshape(-1, inputs[0].shape[-1])
        logits = x @ module.weight.T
        if hasattr(module, "e_score_correction_bias"):
            # DeepSeek-V3: sigmoid + bias, best groups by their top-2 sums,
            # then the top-k inside them: margins of both choices.
            s = logits.sigmoid() + module.e_score_correction_bias
            g = s.view(s.shape[0], module.num_group, -1)
            gs = g.topk(2, dim=-1).values.sum(-1)
            kg = module.topk_group
            if kg < module.num_group:
                top = torch.topk(gs, kg + 1, dim=-1).values
                gaps.append((top[:, kg - 1] - top[:, kg]).min().item())
            keep = torch.zeros_like(gs).scatter_(1, torch.topk(gs, kg, dim=-1).indices, 1)
            s = s.masked_fill(~keep.repeat_interleave(g.shape[-1], dim=1).bool(), float("-inf"))
            top = torch.topk(s, k + 1, dim=-1).values
            finite = torch.isfinite(top[:, k])
            gaps.append((top[:, k - 1] - torch.where(finite, top[:, k], top[:, k - 1] - 1.0)).min().item())
            return
        gaps.append(topk_gap(logits, k))

    for layer in model.model.layers:
        _, block = moe_block(layer)
        if block is not None:
            hooks.append(block.gate.register_forward_hook(hook))
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return min(gaps) if gaps else float("inf")


def greedy(model, prompt):
    new, margins, ids, _ = greedy_steps(
        lambda ids: model(ids).logits[0, -1].float(), prompt, NEW_TOKENS)
    return new, margins, ids


def make_tokenizer(vocab_size, out_dir):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0}
    for w in WORDS:
        if w not in vocab and len(vocab) < vocab_size:
            vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    text = "the quick brown fox jumps over the lazy dog"
    return text, tok.encode(text).ids


FP8_MAX = 448.0


def quantize_fp8(w, block):
    """(codes float8_e4m3fn, scale_inv f32 [ceil(r/br), ceil(c/bc)], dequantized f32)."""
    br, bc = block
    rows, cols = w.shape
    rb, cb = -(-rows // br), -(-cols // bc)
    scale = torch.zeros(rb, cb, dtype=torch.float32)
    deq = torch.zeros_like(w, dtype=torch.float32)
    codes = torch.zeros(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(rb):
        for j in range(cb):
            blk = w[i * br:(i + 1) * br, j * bc:(j + 1) * bc].float()
            s = max(blk.abs().max().item(), 1e-12) / FP8_MAX
            q = (blk / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            scale[i, j] = s
            codes[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = q
            deq[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = q.float() * scale[i, j]
    return codes, scale, deq


def quantized(name):
    """Whether the hub quantizes this tensor: every linear weight but the
    embedding, the LM head and the router."""
    return (name.endswith("_proj.weight") or name.endswith("kv_a_proj_with_mqa.weight")) \
        and "embed" not in name and "lm_head" not in name


def quantize_model(model, spec):
    """Quantize the model's linear weights to FP8 blocks in the hub's layout;
    the model keeps the dequantized values (its reference). Returns the FP8
    tensors and their scales by hub name."""
    state = export_state(model, spec)
    out = {}
    live = dict(model.named_parameters())
    inter = spec["config"]["moe_intermediate_size"]
    with torch.no_grad():
        for name, w in state.items():
            if w.dim() != 2 or not quantized(name):
                continue
            codes, scale, deq = quantize_fp8(w.float(), spec["fp8_block"])
            out[name] = codes
            out[name + "_scale_inv"] = scale
            if name in live:
                live[name].copy_(deq)
                continue
            # A routed expert's matrix: write it into the fused parameters.
            prefix, rest = name.split(".experts.")
            e, which = rest.split(".")[0], rest.split(".")[1]
            e = int(e)
            experts = live.get(prefix + ".experts.gate_up_proj")
            if experts is None:
                sys.exit(f"cannot place {name} in the model")
            if which == "gate_proj":
                experts[e, :inter].copy_(deq)
            elif which == "up_proj":
                experts[e, inter:].copy_(deq)
            else:
                live[prefix + ".experts.down_proj"][e].copy_(deq)
    return out


def build(spec, out_root):
    out_dir = os.path.join(out_root, spec["name"])
    os.makedirs(out_dir, exist_ok=True)
    k = spec["config"]["num_experts_per_tok"]
    vocab = spec["config"]["vocab_size"]

    def try_seed(seed):
        model = make_model(spec, seed)
        fp8 = quantize_model(model, spec) if "fp8_block" in spec else {}
        gen = torch.Generator().manual_seed(1000 + seed)
        prompt = torch.randint(1, vocab, (1, PROMPT_LEN), generator=gen)
        text, text_ids = None, None
        if spec["tokenizer"]:
            text, text_ids = make_tokenizer(vocab, out_dir)
            prompt = torch.tensor([text_ids])
        new, margins, full = greedy(model, prompt)
        rmargin = router_margin(model, full, k)
        clear = min(margins) >= MIN_TOKEN_MARGIN and rmargin >= MIN_ROUTER_MARGIN
        line = f"token margin {min(margins):.4g}, router margin {rmargin:.4g}"
        return clear, line, (model, fp8, prompt, text, text_ids, new, margins, rmargin)

    seed, found = search_seeds(spec["name"], try_seed)
    model, fp8, prompt, text, text_ids, new, margins, rmargin = found
    with torch.no_grad():
        prompt_logits = model(prompt).logits[0].float()
    state = export_state(model, spec)
    state.update(fp8)
    save_shards(state, out_dir, spec["shards"])
    if fp8:
        model.config.quantization_config = {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": spec["fp8_block"]}
    model.config.save_pretrained(out_dir)
    sparse = [i for i, layer in enumerate(model.model.layers) if moe_block(layer)[1] is not None]
    ref = {
        "arch": spec["arch"],
        "layout": spec["layout"],
        "seed": seed,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "compute": "f32 from bf16 weights, eager attention, CPU",
        "sparse_layers": sparse,
        "prompt_ids": prompt[0].tolist(),
        "greedy_ids": new,
        "token_margins": margins,
        "router_margin": rmargin,
        "prompt_logits": prompt_logits.tolist(),
        "tensor_names": sorted(state),
    }
    ref["reload_max_abs_diff"] = reload_check(out_dir, prompt, prompt_logits)
    if text is not None:
        ref["prompt_text"] = text
        ref["prompt_text_ids"] = text_ids
    with open(os.path.join(out_dir, "reference.json"), "w") as f:
        json.dump(ref, f)
    print(f"{spec['name']}: sparse layers {sparse}, prompt {ref['prompt_ids']}, "
          f"greedy {new}, {len(state)} tensors", flush=True)


def reload_check(out_dir, prompt, prompt_logits):
    """Load the written checkpoint back with transformers: same logits?"""
    return fixture_kit.reload_check(
        out_dir, prompt, prompt_logits, lambda m, ids: m(ids).logits[0].float())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", action="append", help="build only these fixtures (repeatable)")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}", flush=True)
    torch.set_num_threads(4)
    for spec in FIXTURES:
        if args.only and spec["name"] not in args.only:
            continue
        build(spec, args.out)


if __name__ == "__main__":
    main()
