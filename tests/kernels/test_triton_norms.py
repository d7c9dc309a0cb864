"""The fused layer's row kernels (dgemma/kernels/triton_norms.py), run on CPU by Triton's
interpreter, against the torch modules they replace (model/diffusion_gemma.py's Layer pieces):
float32 within 1e-5, bf16 within 1 bf16 ulp of torch's own bf16 chain in at least 99.9% of
elements (the kernels round where torch rounds; float32 sums in another order may move a value
across a rounding boundary)."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is an optional (Linux) test dependency: the GPU kernels need it")
pytestmark = pytest.mark.triton

from dgemma.kernels import triton_norms as tn  # noqa: E402
from dgemma.model.checkpoint import make_config  # noqa: E402
from dgemma.model.diffusion_gemma import DiffusionGemma  # noqa: E402
from dgemma.model.presets import PRESETS  # noqa: E402

if not tn.INTERPRETED:
    pytest.skip("triton_norms was imported before TRITON_INTERPRET was set", allow_module_level=True)


def bf16_ulps(y: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    _, e = torch.frexp(ref.float())
    return (y.float() - ref.float()).abs() / torch.exp2(e.float() - 8)


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32: 1e-5 relative to the largest value; bf16: <= 1 ulp in 99.9% of elements, 2 at most."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        assert (got - want).abs().max() <= 1e-5 * want.abs().max().clamp_min(1e-30)
        return
    ulps = bf16_ulps(got, want)
    assert float((ulps <= 1).float().mean()) >= 0.999 and float(ulps.max()) <= 2, float(ulps.max())


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def net(request):
    torch.manual_seed(0)
    net = DiffusionGemma(make_config(**PRESETS["test"]))
    for p in net.parameters():  # norms away from 1, so a wrong weight shows
        p.data = torch.randn(p.shape) * (0.3 if p.dim() == 1 else 0.05) + (1.0 if p.dim() == 1 else 0.0)
    for layer in net.layers:
        layer.layer_scalar.fill_(0.75)
    return net.to(request.param).eval()


def rand(net, *shape, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(net.dtype)


@torch.no_grad()
def test_embed_norm_is_embed_self_conditioning_and_the_first_input_norm(net):
    cfg, layer = net.config, net.layers[0]
    ids = torch.randint(0, cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
    scale = float(torch.tensor(cfg.embed_scale).to(net.dtype))
    sc = net.self_conditioning
    soft = rand(net, 2, 5, cfg.hidden_size, seed=2)
    mlp = sc.mlp(sc.pre_norm(soft))
    for decoder, extra in ((False, None), (True, None), (True, mlp)):
        h, x = tn.embed_norm(
            net.embed_tokens.weight,
            scale,
            layer.input_layernorm.weight,
            cfg.rms_norm_eps,
            ids=ids,
            decoder=decoder,
            self_conditioning=extra,
        )
        want = net.embed(ids)
        if decoder:
            want = sc.post_norm(want + extra) if extra is not None else sc.post_norm(want)
        close(h.view(want.shape), want)
        close(x.view(want.shape), layer.input_layernorm(want))
    embeds = rand(net, 3, cfg.hidden_size, seed=3)
    h, x = tn.embed_norm(net.embed_tokens.weight, scale, layer.input_layernorm.weight, cfg.rms_norm_eps, embeds=embeds)
    assert torch.equal(h, embeds)
    close(x, layer.input_layernorm(embeds))
    with pytest.raises(ValueError, match="one of them"):
        tn.embed_norm(net.embed_tokens.weight, scale, layer.input_layernorm.weight, 1e-6)


@torch.no_grad()
def test_post_attention_gives_the_residual_and_the_three_feed_forward_inputs(net):
    cfg, layer = net.config, net.layers[1]
    h, attn = rand(net, 7, cfg.hidden_size, seed=4), rand(net, 7, cfg.hidden_size, seed=5, scale=3.0)
    got = tn.post_attention(
        h,
        attn,
        layer.post_attention_layernorm.weight,
        layer.pre_feedforward_layernorm.weight,
        layer.pre_feedforward_layernorm_2.weight,
        layer.router.scale,
        layer.router.root_size,
        cfg.rms_norm_eps,
    )
    h2 = h + layer.post_attention_layernorm(attn)
    router = layer.router
    want = (
        h2,
        layer.pre_feedforward_layernorm(h2),
        layer.pre_feedforward_layernorm_2(h2),
        router.norm(h2) * router.scale * router.root_size,
    )
    for g, w in zip(got, want):
        close(g, w)


@torch.no_grad()
def test_combine_ends_the_layer_and_norms_the_next_input(net):
    cfg, layer = net.config, net.layers[2]
    k, t = cfg.top_k_experts, 6
    h, dense = rand(net, t, cfg.hidden_size, seed=6), rand(net, t, cfg.hidden_size, seed=7)
    y = rand(net, t * k, cfg.hidden_size, seed=8)
    top_w = torch.rand(t, k, generator=torch.Generator().manual_seed(9))
    h_out, x = tn.combine(
        h,
        dense,
        y,
        top_w,
        layer.post_feedforward_layernorm_1.weight,
        layer.post_feedforward_layernorm_2.weight,
        layer.post_feedforward_layernorm.weight,
        layer.layer_scalar,
        net.norm.weight,
        cfg.rms_norm_eps,
    )
    moe = (
        (y.view(t, k, -1) * top_w[..., None]).sum(1).to(net.dtype)
    )  # Experts.forward's end: bf16 rows x float32 weights
    f = layer.post_feedforward_layernorm(
        layer.post_feedforward_layernorm_1(dense) + layer.post_feedforward_layernorm_2(moe)
    )
    want = (h + f) * layer.layer_scalar
    close(h_out, want)
    close(x, net.norm(want))


@torch.no_grad()
def test_rms_norm_with_and_without_weight(net):
    x = rand(net, 4, 3, net.config.hidden_size, seed=10, scale=5.0)
    close(tn.rms_norm(x, net.norm.weight, 1e-6), net.norm(x))
    close(tn.rms_norm(x, None, 1e-6), net.self_conditioning.post_norm(x))
    with pytest.raises(ValueError, match="hidden size"):
        tn.post_attention(x[0], x[0][:, :5], *[net.norm.weight] * 4, 1.0, 1e-6)
    with pytest.raises(ValueError, match="top_weights"):
        tn.combine(x[0], x[0], x[0], torch.ones(3, 2), *[net.norm.weight] * 3, torch.ones(1), net.norm.weight, 1e-6)


@pytest.mark.parametrize("layer_index", [0, 2], ids=["sliding", "global"])
@torch.no_grad()
def test_qkv_norm_rope_is_attention_project_and_writes_the_pool(net, layer_index):
    """q, k and v of one fused projection in one launch equal Attention.project's (norms, RoPE,
    V = K's projection on global layers), and an encoder pass's k and v land at their slots."""
    from dgemma.kernels import triton_layer
    from dgemma.model import rope

    cfg, attn = net.config, net.layers[layer_index].self_attn
    spec, t = attn.spec, 5
    x = rand(net, 1, t, cfg.hidden_size, seed=11)
    positions = torch.tensor([[3, 4, 9, 100, 2000]])
    freqs = {kind: rope.inv_freq(s) for kind, s in net.rope_specs.items()}
    cos_t, sin_t = rope.cos_sin(positions, freqs[spec.kind], net.dtype)
    q, k, v = attn.project(x, cos_t, sin_t)  # [1, H, T, D]
    weights = [attn.q_proj.weight, attn.k_proj.weight] + ([attn.v_proj.weight] if attn.v_proj is not None else [])
    qkv = x[0] @ torch.cat(weights).T
    kinds = list(freqs)
    cos, sin = triton_layer.rope_tables(positions, torch.cat([freqs[k] for k in kinds]), net.dtype)
    col = sum(freqs[k].numel() for k in kinds[: kinds.index(spec.kind)])
    slots = torch.tensor([4, -1, 0, 7, 2])
    pool_k = torch.zeros(2, 4, spec.num_kv_heads, spec.head_dim, dtype=net.dtype)
    pool_v = torch.zeros_like(pool_k)
    gq, gk, gv = triton_layer.qkv_norm_rope(
        qkv,
        (cfg.num_heads, spec.num_kv_heads),
        spec.head_dim,
        attn.v_proj is not None,
        attn.q_norm.weight,
        attn.k_norm.weight,
        cfg.rms_norm_eps,
        cos,
        sin,
        col,
        pools=(pool_k, pool_v, slots),
    )
    for got, want in ((gq, q), (gk, k), (gv, v)):
        close(got.contiguous(), want[0].transpose(0, 1).contiguous())
    flat_k, flat_v = pool_k.view(-1, *pool_k.shape[2:]), pool_v.view(-1, *pool_v.shape[2:])
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], gk[i]) and torch.equal(flat_v[slot], gv[i])
    assert int((flat_k.abs().sum((1, 2)) > 0).sum()) == 4  # nothing else written
