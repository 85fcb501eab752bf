#!/usr/bin/env python3
"""Per-channel key statistics of a `kvtier trace` file (integration/kv_trace.h, version 1).

Prints, averaged over layers and kv heads, the anisotropy that `kvtier run --key-spectrum`
models: the largest channels' share of the keys' mean square (E[k_c^2], offsets included), the
share of the channel means (offsets) in it, and, per rotary pair (dims p and p + D/2, which RoPE
mixes), the decay exponent A of the pairs' rms sorted by power (rms_rank ~ (1 + rank)^-A, a
least-squares fit of log rms on log(1 + rank) over the pairs holding >= 0.1% of the power) and
the strongest pair's rms over that fit's (> 1: an outlier pair). Which pairs are strongest is
printed too (0 = the fastest-turning pair).
Pure Python (no numpy): usage `python3 scripts/key_spectrum.py FILE [--post-rope]`.
"""
import math
import struct
import sys
from array import array


def read_trace(path):
    with open(path, "rb") as f:
        data = f.read()
    if data[:8] != b"KVTTRACE":
        raise SystemExit(f"{path}: bad magic")
    off = 8 + 4 + 4 + 8
    layers, q_heads, kv_heads, head_dim = struct.unpack_from("<4I", data, off)
    off += 16
    n_tokens, context, question_begin = struct.unpack_from("<3q", data, off)
    off += 24
    (n_needles,) = struct.unpack_from("<I", data, off)
    off += 4 + 16 * n_needles
    off += 4 * n_tokens
    for _ in range(2):  # source, answer
        (n,) = struct.unpack_from("<I", data, off)
        off += 4 + n
    keys = []
    for _ in range(layers):
        off += 4 * n_tokens * q_heads * head_dim  # q
        k = array("f")
        k.frombytes(data[off:off + 4 * n_tokens * kv_heads * head_dim])
        off += 4 * n_tokens * kv_heads * head_dim
        off += 4 * n_tokens * kv_heads * head_dim  # v
        keys.append(k)
    return layers, kv_heads, head_dim, n_tokens, keys


def main():
    path = sys.argv[1]
    layers, H, D, n, keys = read_trace(path)
    top1 = top2 = top4 = mean_share = decay_sum = excess_sum = low_share = 0.0
    P = D // 2
    strongest = []
    count = 0
    for layer in range(layers):
        k = keys[layer]
        for h in range(H):
            s1 = [0.0] * D
            s2 = [0.0] * D
            for t in range(n):
                base = (t * H + h) * D
                for d in range(D):
                    x = k[base + d]
                    s1[d] += x
                    s2[d] += x * x
            ms = [s2[d] / n for d in range(D)]  # mean square per channel
            mean = [s1[d] / n for d in range(D)]
            total = sum(ms)
            srt = sorted(ms, reverse=True)
            top1 += srt[0] / total
            top2 += sum(srt[:2]) / total
            top4 += sum(srt[:4]) / total
            mean_share += sum(m * m for m in mean) / total
            pair = [(ms[p] + ms[p + P]) / total for p in range(P)]
            low_share += sum(pair[P - P // 4:])
            order = sorted(range(P), key=lambda p: -pair[p])
            strongest.append(order[0])
            pts = [(math.log(1 + r), 0.5 * math.log(pair[p])) for r, p in enumerate(order) if pair[p] >= 1e-3]
            mx = sum(x for x, _ in pts) / len(pts)
            my = sum(y for _, y in pts) / len(pts)
            slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
            decay_sum += -slope
            excess_sum += math.exp(pts[0][1] - (my - slope * mx))  # the fit at rank 0 (x = 0)
            count += 1
    print(f"trace {path}: {layers} layers, {H} kv heads, head_dim {D}, {n} tokens")
    print(f"largest channel's share of E[k^2]: {top1 / count:.3f} (2: {top2 / count:.3f}, 4: {top4 / count:.3f}; "
          f"isotropic: {1 / D:.3f})")
    print(f"the channel means' share of E[k^2]: {mean_share / count:.3f}")
    print(f"rotary pairs' rms decay exponent A (rms ~ (1 + rank)^-A, pairs sorted): {decay_sum / count:.3f}")
    print(f"strongest pair's rms over the fit: {excess_sum / count:.3f}; strongest pair per (layer, head): {strongest}")
    print(f"share of E[k^2] in the lowest-frequency quarter of the rotary pairs: {low_share / count:.3f} "
          f"(isotropic: 0.25)")


if __name__ == "__main__":
    main()
