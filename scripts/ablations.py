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

from dgemma.engine import sampler  # noqa: E402
from dgemma.model.diffusion_gemma import grouped_matmul  # noqa: E402


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


def packed_linears(canvas: int, hidden: int, vocab: int):
    """One decoder step's big matmuls: F.linear (repacks weights each call) vs weights packed once."""
    from dgemma.kernels.cpu import PackedLinear, supported

    if not supported(torch.float32):
        return {}
    g = torch.Generator().manual_seed(4)
    shapes = [
        (canvas, 2 * hidden, hidden),
        (32, 1024, hidden),
        (canvas, vocab, hidden),
    ]  # dense MLP, one expert, LM head
    ws = [torch.randn(n, k, generator=g) * 0.02 for _, n, k in shapes]
    xs = [torch.randn(m, k, generator=g) for m, _, k in shapes]
    packed = [PackedLinear(w) for w in ws]

    def plain():
        return [F.linear(x, w) for x, w in zip(xs, ws)]

    def prepacked():
        return [p(x) for x, p in zip(xs, packed)]

    return {"F.linear": plain, "oneDNN weights packed once (dgemma)": prepacked}


def exp_floor(vocab: int, canvas: int):
    """exp over one step's (logits - max) / T, softcapped logits at T = 0.4: as is vs clamped at -87."""
    g = torch.Generator().manual_seed(5)
    logits = torch.tanh(torch.randn(canvas, vocab, generator=g) * 2) * 30.0
    d = (logits - logits.max(-1, keepdim=True).values) / 0.4  # down to -150: exp gives float32 denormals
    out, clamped_d = torch.empty_like(d), torch.empty_like(d)

    def plain():
        return torch.exp(d, out=out)

    def clamped():
        return torch.exp(torch.clamp(d, min=sampler.EXP_FLOOR, out=clamped_d), out=out)

    return {"exp(d) (denormal results)": plain, "exp(max(d, -87)) (dgemma)": clamped}


def reused_buffer(vocab: int, canvas: int):
    """A [canvas, vocab] float32 result into a fresh tensor (glibc: a fresh mmap) vs a reused one."""
    x = torch.randn(canvas, vocab)
    out = torch.empty_like(x)

    def fresh():
        return torch.exp(x)

    def reused():
        return torch.exp(x, out=out)

    return {"fresh 32 MB tensor": fresh, "reused buffer (dgemma)": reused}


def bf16_moe(hidden: int, inter: int, experts: int, top_k: int, tokens: int):
    """bf16 MoE layer: the model's grouped matmuls (reference-exact path) vs the engine's packed experts."""
    from dgemma.kernels.cpu import PackedExperts, supported
    from dgemma.model.diffusion_gemma import Experts

    if not supported(torch.bfloat16):
        return {}

    class Shape:
        num_experts, hidden_size, moe_intermediate_size, gelu_approximate = experts, hidden, inter, "tanh"

    g = torch.Generator().manual_seed(6)
    module = Experts(Shape())
    with torch.no_grad():
        module.gate_up_proj.normal_(std=0.02, generator=g)
        module.down_proj.normal_(std=0.02, generator=g)
    module = module.to(torch.bfloat16)
    packed = PackedExperts(module)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    index = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    return {
        "grouped matmuls (model)": lambda: module(x, index, weights),
        "packed experts (engine)": lambda: packed(x, index, weights),
    }


def bf16_rmsnorm(hidden: int, tokens: int):
    """bf16 RMSNorm over [tokens, hidden]: the reference's op sequence vs the engine's leaner one."""
    from dgemma.kernels.cpu import LeanRMSNorm
    from dgemma.model.layers import RMSNorm

    norm = RMSNorm(hidden).to(torch.bfloat16)
    lean = LeanRMSNorm(norm)
    x = torch.randn(tokens, hidden).to(torch.bfloat16)
    return {"RMSNorm (reference ops)": lambda: norm(x), "LeanRMSNorm (engine; native one-pass kernel)": lambda: lean(x)}


def bf16_dense_mlp(hidden: int, inter: int, tokens: int):
    """bf16 dense MLP: packed GEMMs then gelu and multiply as torch ops vs both fused into the GEMMs."""
    from dgemma.kernels.cpu import LeanDenseMLP, PackedLinear, supported
    from dgemma.model.diffusion_gemma import DenseMLP

    if not supported(torch.bfloat16):
        return {}
    torch.manual_seed(7)
    mlp = DenseMLP(hidden, inter).to(torch.bfloat16)
    gate, up, down = (PackedLinear(m.weight) for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    fused = LeanDenseMLP(mlp)
    x = torch.randn(tokens, hidden).to(torch.bfloat16)
    return {
        "packed GEMMs, gelu and * as ops": lambda: down(F.gelu(gate(x), approximate="tanh").mul_(up(x))),
        "post-op fused (engine)": lambda: fused(x),
    }


def bf16_moe_native(hidden: int, inter: int, experts: int, top_k: int, tokens: int, layers: int = 8):
    """bf16 MoE of `layers` layers in turn (their 768 MB of expert weights come from memory, as in
    a step): oneDNN packed experts vs the AMX kernel."""
    from dgemma.kernels import native
    from dgemma.kernels.cpu import PackedExperts
    from dgemma.model.diffusion_gemma import Experts

    kernel = native.amx()
    if kernel is None:
        return {}

    class Shape:
        num_experts, hidden_size, moe_intermediate_size, gelu_approximate = experts, hidden, inter, "tanh"

    g = torch.Generator().manual_seed(8)
    modules = []
    for _ in range(layers):
        module = Experts(Shape())
        with torch.no_grad():
            module.gate_up_proj.normal_(std=0.02, generator=g)
            module.down_proj.normal_(std=0.02, generator=g)
        modules.append(module.to(torch.bfloat16))
    packed = [PackedExperts(m) for m in modules]
    amx = [native.AMXExperts(m, kernel) for m in modules]
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    index = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    return {
        "oneDNN packed experts": lambda: [m(x, index, weights) for m in packed],
        "AMX kernel (engine)": lambda: [m(x, index, weights) for m in amx],
    }


def bf16_step_statistics(vocab: int, canvas: int):
    """From the bf16 LM head output to the step's statistics and bf16 probabilities: torch passes
    (float copy, softcap, step_statistics, bf16 copy) vs the native one-pass-per-row kernel."""
    from dgemma.kernels import native

    kernel = native.extension()
    if kernel is None:
        return {}
    g = torch.Generator().manual_seed(9)
    raw = (torch.randn(canvas, vocab, generator=g) * 8).to(torch.bfloat16)
    temps = torch.full((canvas,), 0.6)
    logits, weights = torch.empty(canvas, vocab), torch.empty(canvas, vocab)
    probs = torch.empty(canvas, vocab, dtype=torch.bfloat16)

    def torch_passes():
        z = logits.copy_(raw).div_(30.0).tanh_().mul_(30.0)
        stats = sampler.step_statistics(z, temps[:, None], overwrite_logits=True, out=weights)
        return stats.weights.to(torch.bfloat16)

    return {
        "torch passes": torch_passes,
        "native kernel (engine)": lambda: kernel.step_statistics(raw, 30.0, temps, weights, probs),
    }


def bf16_amx_matmuls(hidden: int, inter: int, vocab: int, tokens: int):
    """bf16 dense MLP and the self-conditioning probs @ E (K = vocab): oneDNN (post-op fused MLP,
    packed weights) vs the AMX kernels."""
    from dgemma.kernels import native
    from dgemma.kernels.cpu import LeanDenseMLP, PackedLinear
    from dgemma.model.diffusion_gemma import DenseMLP

    kernel = native.amx()
    if kernel is None:
        return {}, {}
    torch.manual_seed(10)
    mlp = DenseMLP(hidden, inter).to(torch.bfloat16)
    lean, amx_mlp = LeanDenseMLP(mlp), native.AMXGatedMLP(mlp, kernel)
    x = torch.randn(tokens, hidden).to(torch.bfloat16)
    embed_t = (torch.randn(hidden, vocab) * 0.02).to(torch.bfloat16)
    probs = torch.rand(tokens, vocab).to(torch.bfloat16)
    packed, amx_linear = PackedLinear(embed_t), native.AMXLinear(embed_t, kernel)
    return (
        {"oneDNN, post-ops fused": lambda: lean(x), "AMX kernel (engine)": lambda: amx_mlp(x)},
        {"oneDNN packed": lambda: packed(probs), "AMX kernel (engine)": lambda: amx_linear(probs)},
    )


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
        "matmuls: dense MLP up, one expert (32 rows), LM head": packed_linears(args.canvas, args.hidden, args.vocab),
        "exp over a step's [canvas, vocab] scaled logits": exp_floor(args.vocab, args.canvas),
        "a [canvas, vocab] float32 result": reused_buffer(args.vocab, args.canvas),
        "bf16 MoE layer (32 experts, top-4)": bf16_moe(args.hidden, 512, 32, 4, args.canvas),
        "bf16 RMSNorm, 256 x 1024": bf16_rmsnorm(args.hidden, args.canvas),
        "bf16 dense MLP, 256 x 1024 -> 2048": bf16_dense_mlp(args.hidden, 2048, args.canvas),
    }
    amx_mlp, amx_soft = bf16_amx_matmuls(args.hidden, 2048, args.vocab, args.canvas)
    groups.update(
        {
            "bf16 MoE, 8 layers in turn (cold expert weights)": bf16_moe_native(args.hidden, 512, 32, 4, args.canvas),
            "bf16 head output -> statistics + bf16 probabilities": bf16_step_statistics(args.vocab, args.canvas),
            "bf16 dense MLP, 256 x 1024 -> 2048 (AMX)": amx_mlp,
            "bf16 probs [256, vocab] @ E": amx_soft,
        }
    )
    print(f"threads {torch.get_num_threads()}, best of {args.repeats}")
    print("| work | baseline | ms | dgemma | ms | speed-up |\n|---|---|---:|---|---:|---:|")
    for title, fns in groups.items():
        if not fns:
            continue
        (base, fast) = list(fns)
        t = best_of(fns, args.repeats)
        print(f"| {title} | {base} | {t[base]:.1f} | {fast} | {t[fast]:.1f} | {t[base] / t[fast]:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
