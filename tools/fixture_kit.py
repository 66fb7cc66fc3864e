"""What tools/make_fixtures.py and tools/make_qwen4_fixtures.py share: the
seed search, the greedy reference decode with its margins, the top-k gap of
a router, the sharded safetensors writer and the reload check.

Imported by those scripts (run from the repository root as
`python3 tools/make_*.py`, so this folder is on the import path).
"""

import json
import math
import os
import sys

import torch
import transformers
from safetensors.torch import save_file


def search_seeds(name, try_seed, seeds=40):
    """The first seed in range(seeds) whose try_seed(seed) gives
    (clear, line, result) with clear true; prints each seed's line. Exits
    when no seed has clear margins. Returns (seed, result)."""
    for seed in range(seeds):
        clear, line, result = try_seed(seed)
        print(f"{name} seed {seed}: {line}", flush=True)
        if clear:
            return seed, result
    sys.exit(f"{name}: no seed with clear margins")


def greedy_steps(last_logits, prompt, new_tokens):
    """Greedy decoding by full recompute: last_logits(ids) gives the f32
    logits of the last position. Returns the new tokens, each choice's
    margin (top-1 minus top-2), the whole sequence, and the logits each
    choice was made from."""
    ids = prompt.clone()
    new, margins, rows = [], [], []
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = last_logits(ids)
            rows.append(logits.tolist())
            top = torch.topk(logits, 2).values
            margins.append((top[0] - top[1]).item())
            nxt = int(torch.argmax(logits))
            new.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return new, margins, ids, rows


def topk_gap(scores, k):
    """Smallest gap over rows between the k-th and (k+1)-th score."""
    top = torch.topk(scores, k + 1, dim=-1).values
    return (top[:, k - 1] - top[:, k]).min().item()


def save_shards(state, out_dir, shards):
    """Write `state` as model.safetensors (shards == 1) or as `shards`
    files model-0000K-of-0000N.safetensors with an index. Returns the
    tensor bytes."""
    keys = sorted(state)
    total = sum(state[k].numel() * state[k].element_size() for k in keys)
    if shards == 1:
        save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        return total
    per = math.ceil(len(keys) / shards)
    weight_map = {}
    for s in range(shards):
        part = keys[s * per:(s + 1) * per]
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: state[k] for k in part}, os.path.join(out_dir, fname),
                  metadata={"format": "pt"})
        for k in part:
            weight_map[k] = fname
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    return total


def reload_check(out_dir, prompt, prompt_logits, logits_of):
    """Load the written checkpoint back with transformers (f32, eager
    attention): the largest difference of logits_of(model, prompt) from
    prompt_logits, or None (reported) when it does not load."""
    try:
        try:
            m = transformers.AutoModelForCausalLM.from_pretrained(
                out_dir, dtype=torch.float32, attn_implementation="eager")
        except TypeError:
            m = transformers.AutoModelForCausalLM.from_pretrained(
                out_dir, torch_dtype=torch.float32, attn_implementation="eager")
        with torch.no_grad():
            got = logits_of(m.eval(), prompt)
        diff = (got - prompt_logits).abs().max().item()
    except Exception as exc:  # report, keep the fixture: the engine test decides
        print(f"  reload check failed: {exc!r}", flush=True)
        return None
    print(f"  reload check: max abs diff {diff:.3g}", flush=True)
    return diff
