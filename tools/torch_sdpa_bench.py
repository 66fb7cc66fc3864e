#!/usr/bin/env python3
"""Torch side of `flashtier bench gpu`: decode attention through
torch.nn.functional.scaled_dot_product_attention on the same shapes.

q: [batch, q_heads, 1, head_dim], k/v: [batch, kv_heads, context, head_dim]
in --dtype (bfloat16 by default; `flashtier bench gpu` asks for float32, the
engine's KV type), contiguous (SDPA's native layout), enable_gqa=True. Every SDPA backend
that accepts the shape is timed; the fastest is reported. Timing: CUDA events
around `iters` back-to-back calls queued behind a spin (so host launch
overhead stays out), rotating over enough input sets to exceed the L2 cache;
median of `reps` such runs. Prints one JSON object on stdout.
"""

import argparse
import json
import sys
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def parse_list(s):
    return [int(x) for x in s.split(",") if x]


def time_call(fn, iters, reps):
    times = []
    for _ in range(reps):
        torch.cuda._sleep(20_000_000)  # ~10 ms of GPU cycles: queue ahead
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(iters):
            fn(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    times.sort()
    return times[len(times) // 2]


def bench_shape(batch, ctx, hq, hkv, d, iters, reps, l2_bytes, dtype):
    elem = torch.tensor([], dtype=dtype).element_size()
    kv_bytes = 2 * batch * hkv * ctx * d * elem
    sets = max(1, min(32, -(-4 * l2_bytes // kv_bytes)))
    gen = torch.Generator(device="cuda").manual_seed(batch * 1_000_003 + ctx)
    qs = [torch.rand(batch, hq, 1, d, device="cuda", dtype=dtype, generator=gen) * 2 - 1
          for _ in range(sets)]
    ks = [torch.rand(batch, hkv, ctx, d, device="cuda", dtype=dtype, generator=gen) * 2 - 1
          for _ in range(sets)]
    vs = [torch.rand(batch, hkv, ctx, d, device="cuda", dtype=dtype, generator=gen) * 2 - 1
          for _ in range(sets)]
    results = {}
    backends = {
        "default": None,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "math": SDPBackend.MATH,
    }
    for name, be in backends.items():
        def call(i, be=be):
            j = i % sets
            if be is None:
                return F.scaled_dot_product_attention(qs[j], ks[j], vs[j], enable_gqa=True)
            with sdpa_kernel([be]):
                return F.scaled_dot_product_attention(qs[j], ks[j], vs[j], enable_gqa=True)
        try:
            for i in range(3):
                call(i)
            torch.cuda.synchronize()
            results[name] = time_call(call, iters, reps)
        except Exception as e:  # a backend that refuses the shape
            results[name] = None
            print(f"torch sdpa {name} b{batch} ctx{ctx}: {type(e).__name__}: {str(e)[:120]}",
                  file=sys.stderr)
    timed = {k: v for k, v in results.items() if v is not None}
    best = min(timed, key=timed.get) if timed else None
    bytes_moved = kv_bytes + 2 * batch * hq * d * elem
    del qs, ks, vs
    torch.cuda.empty_cache()
    return {
        "batch": batch,
        "context": ctx,
        "best_backend": best,
        "best_us": timed.get(best) if best else None,
        "per_backend_us": results,
        "bytes": bytes_moved,
        "bytes_per_s": bytes_moved / (timed[best] * 1e-6) if best else None,
        "rotation_sets": sets,
    }


def main():
    warnings.filterwarnings("ignore")  # backend refusals are reported once per shape below
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--contexts", default="4096,8192,16384,32768,65536,131072")
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 60 << 20)
    rows = []
    for b in parse_list(a.batches):
        for c in parse_list(a.contexts):
            rows.append(bench_shape(b, c, a.q_heads, a.kv_heads, a.head_dim, a.iters, a.reps, l2, dtype))
    print(json.dumps({
        "torch": torch.__version__,
        "device": props.name,
        "dtype": a.dtype,
        "shapes": rows,
    }))


if __name__ == "__main__":
    main()
