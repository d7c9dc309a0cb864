"""Measure each fast-path optimisation against the way the reference does the same work.

    python scripts/ablations.py [--vocab 32768] [--canvas 256] [--repeats 7]

Each pair runs interleaved, several times, on the same inputs; the table shows the best time of
each (least disturbed by other load on the machine) and the speed-up. Shapes default to the
mid-size benchmark model (hidden 1024, 32 experts top-4, expert intermediate 512, vocab 32768,
canvas 256, prefix 768).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from dgemma import sampler  # noqa: E402
from dgemma.model import grouped_matmul  # noqa: E402


def best_of(fns: dict, repeats: int) -> dict:
    times = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {k: min(v) * 1000 for k, v in times.items()}


def sampler_step(vocab: int, canvas: int, hidden: int):
    """Per-step work on the [canvas, vocab] logits: the reference's ops vs one set of passes."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, canvas, vocab, generator=g) * 4
    embed = torch.randn(vocab, hidden, generator=g) * 0.02
    temp = sampler.temperature(10, 16, 0.4, 0.8)

    def reference():
        processed = logits / temp
        probs = torch.softmax(processed, dim=-1, dtype=torch.float32)
        denoised = torch.multinomial(probs.view(-1, vocab), 1).view(1, canvas)
        argmax = processed.argmax(-1)
        accepted = sampler.entropy_bound_accept(sampler.reference_entropy(processed), 0.1)
        torch.where(accepted, denoised, argmax)
        sampler.reference_entropy(processed).mean(-1)  # the stopping criterion recomputes it
        torch.matmul(processed.softmax(-1, dtype=torch.float32), embed)  # next step's SC input

    def fast():
        stats = sampler.step_statistics(logits.view(-1, vocab), temp)
        accepted = sampler.entropy_bound_accept(stats.entropy.view(1, canvas), 0.1)
        picked = accepted.view(-1).nonzero().squeeze(-1)
        sampler.sample_from_weights(stats.weights[picked], torch.rand(picked.numel()))
        torch.matmul(stats.weights, embed) / stats.total[:, None]

    return {"reference ops": reference, "dgemma step_statistics": fast}


def moe(hidden: int, inter: int, experts: int, top_k: int, tokens: int):
    """Experts: transformers' eager per-expert loop (one-hot mask, where, index_add) vs grouped matmuls."""
    g = torch.Generator().manual_seed(1)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.02
    down = torch.randn(experts, hidden, inter, generator=g) * 0.02
    x = torch.randn(tokens, hidden, generator=g)
    index = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)

    def eager_loop():
        out = torch.zeros_like(x)
        mask = F.one_hot(index, experts + 1).permute(2, 1, 0)
        for e in (mask.sum(dim=(-1, -2)) > 0).nonzero():
            e = int(e[0])
            if e == experts:
                continue
            pos, tok = torch.where(mask[e])
            gate, up = F.linear(x[tok], gate_up[e]).chunk(2, -1)
            y = F.linear(F.gelu(gate, approximate="tanh") * up, down[e]) * weights[tok, pos, None]
            out.index_add_(0, tok, y)
        return out

    def grouped():
        ids, perm = torch.sort(index.reshape(-1))
        routed = x[perm // top_k]
        offsets = torch.cumsum(torch.bincount(ids, minlength=experts), 0).to(torch.int32)
        gate, up = grouped_matmul(routed, gate_up.transpose(-2, -1), offsets).chunk(2, -1)
        y = grouped_matmul(F.gelu(gate, approximate="tanh") * up, down.transpose(-2, -1), offsets)
        y = y * weights.reshape(-1)[perm, None]
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.numel())
        return y[inverse].view(tokens, top_k, -1).sum(1)

    return {"per-expert loop (transformers eager)": eager_loop, "grouped matmuls (dgemma)": grouped}


def attention(canvas: int, prefix: int, heads: int, kv_heads: int, head_dim: int):
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, heads, canvas, head_dim, generator=g)
    k = torch.randn(1, kv_heads, prefix + canvas, head_dim, generator=g)
    v = torch.randn(1, kv_heads, prefix + canvas, head_dim, generator=g)
    rep = heads // kv_heads

    def eager():
        kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        w = torch.softmax(q @ kk.transpose(-1, -2), dim=-1, dtype=torch.float32)
        return w @ vv

    def fused():
        return F.scaled_dot_product_attention(q, k, v, scale=1.0, enable_gqa=True)

    return {"eager matmul-softmax": eager, "scaled_dot_product_attention": fused}


def kv_cache(canvas: int, prefix: int, kv_heads: int, head_dim: int, layers: int):
    """Per decoder step: concatenate prefix and canvas keys (reference) vs write into a preallocated buffer."""
    g = torch.Generator().manual_seed(3)
    prefix_k = [torch.randn(1, kv_heads, prefix, head_dim, generator=g) for _ in range(layers)]
    buffers = [torch.zeros(1, kv_heads, prefix + canvas, head_dim) for _ in range(layers)]
    new = torch.randn(1, kv_heads, canvas, head_dim, generator=g)

    def concat():
        return [torch.cat([k, new], dim=2) for k in prefix_k for _ in range(2)]

    def prealloc():
        out = []
        for b in buffers:
            for _ in range(2):
                b[:, :, prefix:] = new
                out.append(b[:, :, : prefix + canvas])
        return out

    return {"torch.cat per step (reference)": concat, "preallocated buffer (dgemma)": prealloc}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--canvas", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    groups = {
        "sampler step over [canvas, vocab] logits": sampler_step(args.vocab, args.canvas, args.hidden),
        "MoE layer (32 experts, top-4)": moe(args.hidden, 512, 32, 4, args.canvas),
        "attention (8 heads / 4 KV, d=128, 768 prefix)": attention(args.canvas, 768, 8, 4, 128),
        "KV for 8 layers (K and V)": kv_cache(args.canvas, 768, 4, 128, 8),
    }
    print(f"threads {torch.get_num_threads()}, best of {args.repeats}")
    print(f"| work | baseline | ms | dgemma | ms | speed-up |\n|---|---|---:|---|---:|---:|")
    for title, fns in groups.items():
        (base, fast) = list(fns)
        t = best_of(fns, args.repeats)
        print(f"| {title} | {base} | {t[base]:.1f} | {fast} | {t[fast]:.1f} | {t[base] / t[fast]:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
