#!/usr/bin/env python3
"""Greedy decode and prefill speed of HF transformers on a checkpoint, for
`flashtier bench decode --hf-script tools/hf_decode_bench.py`.

Modes:
  gpu      the whole model on GPU 0 in its stored dtype, SDPA attention
  offload  accelerate's device_map="auto" with max_memory={0: GPU_MEM,
           "cpu": ...}: what does not fit the GPU budget lives in host RAM

Decode tok/s = (N - 1) / (T(N) - T(1)), where T(n) is the wall time of
generate(max_new_tokens=n) from the same prompt (so the prompt and the first
token cancel out), CUDA synchronised around each call, median of `--reps`
after a warm-up run of the full length.
Prefill tok/s = prefill_len / time of one forward over a prefill_len-token
prompt. Prints one JSON object on stdout.
"""

import argparse
import json
import os
import statistics
import sys
import time


def cpu_model():
    """The host CPU's model name (batch-1 decode in transformers is bound by
    the host launching kernels, so it moves with the host)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--mode", choices=["gpu", "offload"], default="gpu")
    ap.add_argument("--gpu-mem", default="4GiB", help="offload: GPU budget")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--prefill", type=int, default=0)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    load_before = list(os.getloadavg())

    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    t0 = time.time()
    kw = dict(dtype="auto", attn_implementation="sdpa")
    if a.mode == "gpu":
        kw["device_map"] = "cuda:0"
    else:
        kw["device_map"] = "auto"
        kw["max_memory"] = {0: a.gpu_mem, "cpu": "120GiB"}
    model = AutoModelForCausalLM.from_pretrained(a.model, **kw)
    model.eval()
    load_s = time.time() - t0
    vocab = model.config.vocab_size
    prompt = torch.tensor([[(i * 7919 + 13) % vocab for i in range(a.prompt_len)]], device="cuda:0")

    def gen(n):
        torch.cuda.synchronize()
        t = time.time()
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 num_beams=1, pad_token_id=0)
        torch.cuda.synchronize()
        return time.time() - t, out[0, a.prompt_len:].tolist()

    # Warm-up at the full length: kernels, caches, the allocator and every
    # KV length the timed runs reach (a 2-token warm-up left the first timed
    # repetition a third as fast as the others).
    gen(a.tokens)
    decode = []
    tokens = []
    first = []
    for _ in range(a.reps):
        t1, _ = gen(1)
        tn, tokens = gen(a.tokens)
        first.append(t1)
        decode.append((a.tokens - 1) / max(tn - t1, 1e-9))
    result = {
        "mode": a.mode,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "load_secs": load_s,
        "decode_tokens_per_sec": statistics.median(decode),
        "decode_tokens_per_sec_reps": decode,
        "generated_ids": tokens,
        "first_token_secs_reps": first,
        "host": {
            "cpu": cpu_model(),
            "cpus": os.cpu_count(),
            "loadavg_before": load_before,
            "loadavg_after_decode": list(os.getloadavg()),
            "gpu": torch.cuda.get_device_name(0),
        },
    }
    if a.prefill > 0:
        ids = torch.tensor([[(i * 104729 + 7) % vocab for i in range(a.prefill)]], device="cuda:0")
        times = []
        with torch.no_grad():
            for _ in range(a.reps + 1):
                torch.cuda.synchronize()
                t = time.time()
                model(ids, use_cache=False)
                torch.cuda.synchronize()
                times.append(time.time() - t)
        result["prefill_tokens"] = a.prefill
        result["prefill_tokens_per_sec"] = a.prefill / statistics.median(times[1:])
    if a.mode == "offload":
        result["gpu_mem"] = a.gpu_mem
        result["hf_device_map_devices"] = sorted({str(v) for v in getattr(model, "hf_device_map", {}).values()})
    json.dump(result, sys.stdout)
    print()


if __name__ == "__main__":
    main()
