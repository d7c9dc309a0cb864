"""The encoder pass's paged causal attention (`triton_attention.paged_prefix_attention`), run on CPU
by Triton's interpreter, against torch's SDPA over the gathered prefix: per row, the pool positions
the row's queries may see gathered through its block table, a boolean mask (causal; a sliding
window; each image's tokens seeing each other) and `attention.sdpa` (scale 1.0, GQA, [B, Q, H, D]).

The pass's own keys are already in the pool (the q|k|v kernel writes them before the attention),
so a row is (start, count): queries at positions start .. start + count - 1, keys from the pool up
to each. Pools are NaN at every slot no row may see (unused blocks; a sliding row's positions before
its window, whose blocks the manager may have released: -1 in the table), tables are random
permutations: a wrong slot or table entry gives NaN or garbage.

Tolerances: float32 within 1e-5 absolute (O(1) values, the same sums in another order); bf16 /
fp16 within 2e-2 absolute of the float32 reference on the same rounded inputs (the probabilities
rounded to the input dtype for P @ V, then the output once, as FlashAttention does). 16 x 16 tiles
and tiny shapes keep the interpreter fast."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton / triton_attention are imported

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is an optional (Linux) test dependency: the GPU kernels need it")
pytestmark = pytest.mark.triton

from dgemma.kernels import triton_attention as ta  # noqa: E402
from dgemma.model.attention import sdpa  # noqa: E402

if not ta.INTERPRETED:
    pytest.skip(
        "triton_attention was imported before TRITON_INTERPRET was set: its kernel needs a GPU", allow_module_level=True
    )

BS = 8  # pool block size


def first_key(start: int, window: int | None) -> int:
    """The lowest position a row starting at `start` may read (its blocks below are released)."""
    return max(0, start - window + 1) if window else 0


def make_case(rows, heads, kv_heads, dim, window=None, tokens=None, dtype=torch.float32, seed=0, same_kv=False):
    """Inputs for rows (start, count): q [n, H, T, D] (T = `tokens`, default the largest count:
    shorter rows are padded), pools holding each row's positions [first_key, start + count), NaN
    elsewhere, tables -1 outside them. `same_kv`: v_pool is k_pool (a global layer's V = K)."""
    g = torch.Generator().manual_seed(seed)
    n = len(rows)
    t = tokens or max(c for _, c in rows)
    spans = [range(first_key(s, window) // BS, -(-(s + c) // BS)) for s, c in rows]
    width = max(-(-(s + c) // BS) for s, c in rows) + 1
    num_blocks = sum(len(sp) for sp in spans) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((n, width), -1, dtype=torch.int32)
    seen = torch.zeros(num_blocks, BS, dtype=torch.bool)
    for i, ((s, c), span) in enumerate(zip(rows, spans)):
        for j in span:
            tables[i, j] = perm.pop()
        for p in range(first_key(s, window), s + c):
            seen[tables[i, p // BS], p % BS] = True
    scale = dim**-0.25
    k_pool = torch.randn(num_blocks, BS, kv_heads, dim, generator=g) * scale
    v_pool = k_pool if same_kv else torch.randn(num_blocks, BS, kv_heads, dim, generator=g)
    k_pool[~seen] = float("nan")
    v_pool[~seen] = float("nan")
    q = torch.randn(n, heads, t, dim, generator=g) * scale
    start = torch.tensor([s for s, _ in rows], dtype=torch.int32)
    count = torch.tensor([c for _, c in rows], dtype=torch.int32)
    q, k_pool = q.to(dtype), k_pool.to(dtype)
    v_pool = k_pool if same_kv else v_pool.to(dtype)
    return q, k_pool, v_pool, tables, start, count


def reference(q, k_pool, v_pool, tables, start, count, window=None, groups=None):
    """torch's path, float32: each row's visible positions gathered through its table, a boolean
    mask, `sdpa` -> [n, T, H, D] (rows past a row's count: not compared, left zero)."""
    n, h, t, d = q.shape
    out = torch.zeros(n, t, h, d)
    for i in range(n):
        s, c = int(start[i]), int(count[i])
        lo = first_key(s, window)
        pos = torch.arange(lo, s + c)
        blocks = tables[i].long()[pos // BS]
        k = k_pool[blocks, pos % BS].transpose(0, 1)[None].float()
        v = v_pool[blocks, pos % BS].transpose(0, 1)[None].float()
        qpos = torch.arange(s, s + c)[:, None]
        mask = pos[None, :] <= qpos
        if window:
            mask &= pos[None, :] > qpos - window
        if groups is not None:
            gq = groups[i, :c].long()
            gk = torch.full((len(pos),), -1, dtype=torch.long)
            gk[pos >= s] = gq[pos[pos >= s] - s]
            mask |= (gq[:, None] == gk[None, :]) & (gk[None, :] >= 0)
        out[i, :c] = sdpa(q[i : i + 1, :, :c].float(), k, v, mask[None, None], False)[0]
    return out


def check(out, ref, count, atol):
    assert out.shape == ref.shape
    assert torch.isfinite(out).all(), "NaN / inf: a slot outside a row's view was read"
    for i, c in enumerate(count.tolist()):
        err = (out[i, :c].float() - ref[i, :c]).abs().max().item()
        assert err <= atol, (i, err)


# rows (start, count): no prefix; a prefix under a block; one not a multiple of the block (the pass
# starting mid-block) over several; a pass ending mid-block. Padded to the longest count.
RAGGED = [(0, 13), (5, 3), (21, 19), (40, 1)]


@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2), (8, 1)], ids=["mha", "gqa2", "gqa8"])
@pytest.mark.parametrize("window", [None, 6, 17], ids=["global", "window6", "window17"])
def test_matches_gathered_sdpa_float32(heads, kv_heads, window):
    """Ragged rows padded to one pass, GQA packed along the query tile (G * T rows: several
    tiles), global and sliding layers (a window shorter than a block and one across blocks)."""
    args = make_case(RAGGED, heads, kv_heads, 16, window, seed=heads + (window or 0))
    out = ta.paged_prefix_attention(*args, window=window)
    assert out.dtype == torch.float32 and out.shape == (4, 19, heads, 16)
    check(out, reference(*args, window=window), args[5], 1e-5)


def test_a_global_layers_v_is_its_k():
    """Global layers have no v_proj (V = K's projection): one pool tensor passed as both (a wide
    head, 8 query heads on one KV head)."""
    q, k_pool, v_pool, tables, start, count = make_case([(3, 9), (0, 30)], 8, 1, 32, same_kv=True, seed=3)
    assert v_pool is k_pool
    out = ta.paged_prefix_attention(q, k_pool, v_pool, tables, start, count)
    check(out, reference(q, k_pool, v_pool, tables, start, count), count, 1e-5)


def test_chunks_give_the_one_pass_answer():
    """A prompt encoded in chunks (the scheduler's prefill chunks; the second starting mid-block,
    the third on a block boundary) gives each query what one pass over the whole prompt gives: the
    same pool, the same keys."""
    window = 12
    q, k_pool, v_pool, tables, start, count = make_case([(0, 40)], 4, 2, 16, window, seed=7)
    whole = ta.paged_prefix_attention(q, k_pool, v_pool, tables, start, count, window=window)
    for lo, hi in ((0, 13), (13, 24), (24, 40)):
        s, c = torch.tensor([lo], dtype=torch.int32), torch.tensor([hi - lo], dtype=torch.int32)
        part = ta.paged_prefix_attention(q[:, :, lo:hi], k_pool, v_pool, tables, s, c, window=window)
        check(part, whole[:, lo:hi], c, 1e-6)


@pytest.mark.parametrize("window", [None, 5])
def test_images_see_each_other(window):
    """Bidirectional vision: each image's tokens see the image's later tokens too, and on a sliding
    layer its earlier ones past the window; text stays causal; padding queries see no image."""
    rows = [(4, 14), (10, 9)]
    args = make_case(rows, 4, 2, 16, window, seed=11)
    groups = torch.full((2, 14), -1, dtype=torch.int32)
    groups[0, 2:9] = 0  # an image of 7 tokens (longer than the window)
    groups[0, 10:13] = 1
    groups[1, 0:4] = 0  # an image at the start of the pass
    out = ta.paged_prefix_attention(*args, window=window, groups=groups)
    check(out, reference(*args, window=window, groups=groups), args[5], 1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_against_float32(dtype):
    """bf16 / fp16 inputs, q a strided view (as the q|k|v kernel's output transposed to heads)."""
    q, k_pool, v_pool, tables, start, count = make_case(RAGGED, 4, 2, 32, 17, dtype=dtype, seed=13)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # [n, H, T, D] view of [n, T, H, D]
    out = ta.paged_prefix_attention(q, k_pool, v_pool, tables, start, count, window=17)
    assert out.dtype == dtype
    check(out, reference(q, k_pool, v_pool, tables, start, count, window=17), count, 2e-2)


def test_larger_tiles_and_padding_rows_stay_finite():
    """32 x 32 tiles; padding queries (past a row's count) attend as its last token: finite."""
    args = make_case([(0, 2), (9, 37)], 4, 2, 16, 20, seed=17)
    out = ta.paged_prefix_attention(*args, window=20, blocks=(32, 32))
    check(out, reference(*args, window=20), args[5], 1e-5)
    assert torch.isfinite(out[0, 2:]).all()


BAD = {
    "q dims": (lambda a: a.__setitem__(0, a[0][0]), "q must be [n, H, T, D]"),
    "kv heads": (lambda a: a.__setitem__(0, a[0][:, :3]), "do not divide"),
    "pool dim": (lambda a: a.__setitem__(1, a[1][..., :8]), "k_pool / v_pool must"),
    "dtype": (lambda a: a.__setitem__(2, a[2].to(torch.bfloat16)), "must share a dtype"),
    "table dtype": (lambda a: a.__setitem__(3, a[3].long()), "block_tables must be int32"),
    "count shape": (lambda a: a.__setitem__(5, a[5][:1]), "count must be int32 [n=4]"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_inputs_raise(name):
    args = list(make_case(RAGGED, 4, 2, 16))
    edit, message = BAD[name]
    edit(args)
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        ta.paged_prefix_attention(*args)


def test_bad_window_and_groups_raise():
    args = make_case(RAGGED, 4, 2, 16)
    with pytest.raises(ValueError, match="window must be >= 1"):
        ta.paged_prefix_attention(*args, window=0)
    with pytest.raises(ValueError, match="groups must be int32"):
        ta.paged_prefix_attention(*args, groups=torch.zeros(4, 3, dtype=torch.int32))
