#!/usr/bin/env python3
"""Make the table that pins flashtier's top-k to torch's CPU `topk`.

torch breaks ties in `topk` by whatever its selection algorithm leaves
behind (libstdc++'s `nth_element`, or `partial_sort` when k * 64 <= n), not
by index. flashtier must keep exactly the set torch keeps, so this script
asks torch directly on tie-heavy vectors and records what it kept.

The vectors are not stored: both this script and the Rust test
(`crates/flashtier-engine/tests/torch_topk.rs`) rebuild them from a kind, a
length and a seed with the same splitmix64 stream (`values` below). For
each vector the table holds one FNV-1a 64-bit digest over every k from 1 to
n of (k, the kept indices ascending), and, for short vectors, the kept sets
themselves so a failure can name the first differing k.

Usage (needs torch; CPU only, a minute or so):

    python3 tools/make_topk_table.py --out crates/flashtier-engine/tests/fixtures/topk/torch_topk.json
"""

import argparse
import json
import os
import struct
import tempfile

import torch

MASK = (1 << 64) - 1
KINDS = ["zeros", "binary", "few", "relu", "nan", "ramp", "valley", "distinct"]
# Every n up to ALL_N, then these longer lengths (Qwen4-Exp routes over 512
# experts; DeepSeek-V3 over 256).
ALL_N = 320
LONG_N = [384, 511, 512, 513, 640, 1000, 1024]
# Kept sets are listed in full for vectors this short.
LISTED_N = 24


def splitmix64(state):
    state = (state + 0x9E3779B97F4A7C15) & MASK
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return state, z ^ (z >> 31)


def values(kind, n, seed):
    """The f32 bit patterns of vector (kind, n, seed)."""
    state = seed
    out = []
    for i in range(n):
        state, r = splitmix64(state)
        if kind == "zeros":
            v = -0.0 if r & 1 else 0.0
        elif kind == "binary":
            v = float((r >> 11) & 1)
        elif kind == "few":
            v = [0.0, 0.5, 1.0, 2.0][(r >> 11) & 3]
        elif kind == "relu":
            # Multiples of 1/16 in [0, 0.5): half the entries are exactly 0.
            v = max(0.0, ((r >> 40) - (1 << 23)) / float(1 << 24))
            v = float(int(v * 16)) / 16.0
        elif kind == "nan":
            v = float("nan") if (r >> 11) % 5 == 0 else [0.0, 1.0, 3.0][(r >> 13) % 3]
        elif kind == "ramp":
            v = float(i // 3)
        elif kind == "valley":
            v = float(min(i, n - 1 - i) // 2)
        elif kind == "distinct":
            v = float(r >> 40)
        else:
            raise ValueError(kind)
        out.append(struct.unpack("<I", struct.pack("<f", v))[0])
    return out


def fnv1a(digest, word):
    for b in struct.pack("<I", word):
        digest = ((digest ^ b) * 0x100000001B3) & MASK
    return digest


def kept_sets(bits):
    x = torch.tensor(struct.unpack(f"<{len(bits)}f", struct.pack(f"<{len(bits)}I", *bits)),
                     dtype=torch.float32)
    n = x.numel()
    sets = []
    for k in range(1, n + 1):
        sets.append(sorted(torch.topk(x, k).indices.tolist()))
    return sets


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cases = []
    lengths = list(range(1, ALL_N + 1)) + LONG_N
    for kind in KINDS:
        for n in lengths:
            seed = n * 1000 + KINDS.index(kind)
            sets = kept_sets(values(kind, n, seed))
            digest = 0xCBF29CE484222325
            for k, kept in enumerate(sets, start=1):
                digest = fnv1a(digest, k)
                for i in kept:
                    digest = fnv1a(digest, i)
            case = {"kind": kind, "n": n, "seed": seed, "digest": f"{digest:016x}"}
            if n <= LISTED_N:
                case["sets"] = sets
            cases.append(case)
        print(f"{kind}: {len(lengths)} lengths", flush=True)
    table = {
        "torch": torch.__version__,
        "what": "torch.topk(x, k) on CPU, float32, every k in 1..=n; the kept indices ascending",
        "kinds": KINDS,
        "cases": cases,
    }
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=".topk-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(table, f, separators=(",", ":"))
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, args.out)
    print(f"wrote {len(cases)} vectors to {args.out}")


if __name__ == "__main__":
    main()
