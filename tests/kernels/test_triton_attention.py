"""The paged canvas-attention kernel (dgemma/kernels/triton_attention.py), run on CPU by Triton's
interpreter, against the torch path it replaces: per row, the pool positions [lo, start)
gathered through the block table, the canvas's keys after them, and `attention.sdpa` (scale 1.0,
GQA, output [B, Q, H, D]). Queries are A rows against the C canvas keys: A = C for a full canvas
pass, A < C for a turbo pass over the active positions (frozen positions give keys, no queries).

Pools are filled with NaN at every slot no row may see (unused blocks, and the slots of a used
block before lo or from start on), and block tables are random permutations with -1 in the
entries not covering [lo, start): a kernel that reads a wrong slot or entry gives NaN or garbage.

Tolerances: float32 within 1e-5 absolute (values are O(1): the same sums in another order);
bf16 / fp16 inputs within 2e-2 absolute of the float32 reference on the same (rounded) inputs:
the probabilities are rounded to the input dtype for P @ V (relative 2^-8 for bf16) and the
output once (2^-9 of an O(1) value), as FlashAttention does.

TRITON_INTERPRET must be set before triton is first imported, so conftest.py sets it for the
whole pytest process (and this file again, run on its own). 16 x 16 tiles and tiny shapes keep
the interpreter fast."""

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
# (lo, start) per row: no prefix / under a block / not a multiple of BS over several blocks;
# and sliding-window rows (lo > 0): inside a block, across many blocks, block-aligned both ends
FULL = [(0, 0), (0, 5), (0, 29)]
SLIDING = [(3, 11), (9, 44), (16, 32)]


def make_case(
    prefixes, heads, kv_heads, canvas, dim, dtype=torch.float32, seed=0, width=8, num_blocks=None, bs=BS, queries=None
):
    """Inputs for rows with the given (lo, start): a pool whose blocks are a random permutation
    (num_blocks, default 3 more than the rows use), NaN wherever no row looks, tables -1 outside the rows' views.
    q [n, H, A, D] with A = `queries` rows (default: the canvas's C), canvas keys [n, Hkv, C, D].
    q and k scaled so that scores are O(1) (softmax neither flat nor one-hot)."""
    g = torch.Generator().manual_seed(seed)
    n = len(prefixes)
    spans = [range(lo // bs, -(-start // bs)) if start > lo else range(0) for lo, start in prefixes]
    num_blocks = num_blocks or sum(len(s) for s in spans) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((n, width), -1, dtype=torch.int32)
    seen = torch.zeros(num_blocks, bs, dtype=torch.bool)
    for i, ((lo, start), span) in enumerate(zip(prefixes, spans)):
        for j in span:
            tables[i, j] = perm.pop()
        for p in range(lo, start):
            seen[tables[i, p // bs], p % bs] = True
    scale = dim**-0.25
    k_pool = torch.randn(num_blocks, bs, kv_heads, dim, generator=g) * scale
    v_pool = torch.randn(num_blocks, bs, kv_heads, dim, generator=g)
    k_pool[~seen] = float("nan")
    v_pool[~seen] = float("nan")
    q = torch.randn(n, heads, canvas if queries is None else queries, dim, generator=g) * scale
    k_canvas = torch.randn(n, kv_heads, canvas, dim, generator=g) * scale
    v_canvas = torch.randn(n, kv_heads, canvas, dim, generator=g)
    lo = torch.tensor([p[0] for p in prefixes], dtype=torch.int32)
    start = torch.tensor([p[1] for p in prefixes], dtype=torch.int32)
    cast = [t.to(dtype) for t in (q, k_canvas, v_canvas, k_pool, v_pool)]
    return (*cast, tables, lo, start)


def reference(q, k_canvas, v_canvas, k_pool, v_pool, tables, lo, start):
    """The torch path, in float32: gather each row's [lo, start) through its table, append the
    canvas keys, sdpa on that row alone (all A queries see all of them). -> [n, A, H, D]"""
    bs = k_pool.shape[1]
    out = []
    for i in range(q.shape[0]):
        pos = torch.arange(int(lo[i]), int(start[i]))
        blocks = tables[i].long()[pos // bs]
        k = torch.cat((k_pool[blocks, pos % bs].transpose(0, 1), k_canvas[i]), 1).float()
        v = torch.cat((v_pool[blocks, pos % bs].transpose(0, 1), v_canvas[i]), 1).float()
        out.append(sdpa(q[i][None].float(), k[None], v[None], None, False)[0])
    return torch.stack(out)


def close(out, ref, atol):
    assert out.shape == ref.shape
    assert torch.isfinite(out).all(), "NaN / inf: a slot outside a row's view was read"
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= atol, err


def test_available_under_the_interpreter():
    assert ta.HAVE_TRITON and ta.INTERPRETED
    assert ta.available("cpu") and ta.available(torch.device("cpu"))


@pytest.mark.slow
@pytest.mark.parametrize("prefixes", [FULL, SLIDING], ids=["full", "sliding"])
@pytest.mark.parametrize("dim", [16, 32])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2), (8, 2)], ids=["mha", "gqa2", "gqa4"])
def test_matches_gathered_sdpa_float32(prefixes, dim, heads, kv_heads):
    """Ragged rows; C = 11: one partial canvas tile, and G * C > 16 packed query rows (two query
    tiles) once heads share a KV head."""
    args = make_case(prefixes, heads, kv_heads, 11, dim, seed=dim + heads)
    out = ta.paged_canvas_attention(*args)
    assert out.dtype == torch.float32 and out.shape == (3, 11, heads, dim)
    close(out, reference(*args), 1e-5)


def test_wide_head_dim():
    args = make_case([(0, 0), (0, 20), (7, 50)], 2, 1, 3, 128, bs=16, seed=5)
    close(ta.paged_canvas_attention(*args), reference(*args), 1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_against_float32(dtype):
    """bf16 / fp16 inputs (q and k_canvas as strided views, as a projection's transpose gives)
    against the float32 reference on the same rounded inputs."""
    q, kc, vc, kp, vp, tables, lo, start = make_case(SLIDING, 4, 2, 11, 32, dtype=dtype, seed=7)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # [n, H, C, D] view of [n, C, H, D]
    kc = kc.transpose(1, 2).contiguous().transpose(1, 2)
    out = ta.paged_canvas_attention(q, kc, vc, kp, vp, tables, lo, start)
    assert out.dtype == dtype
    close(out, reference(q, kc, vc, kp, vp, tables, lo, start), 2e-2)


@pytest.mark.parametrize("splits", [2, 3])
def test_split_prefix_combines_exactly(splits):
    """Flash-decoding splits: rows with no prefix (all splits but the last see nothing) and a
    short one (later splits empty) as well as a long one."""
    args = make_case([(0, 0), (2, 9), (0, 61)], 4, 2, 5, 16, seed=11)
    close(ta.paged_canvas_attention(*args, num_splits=splits), reference(*args), 1e-5)


def test_larger_tiles_and_a_single_row():
    args = make_case([(5, 45)], 2, 1, 20, 16, seed=13)
    close(ta.paged_canvas_attention(*args, blocks=(32, 32)), reference(*args), 1e-5)


def test_same_tensors_new_prefix_values():
    """What a CUDA-graph replay relies on: the same tensors (same shapes, same storage), with
    new lo / start / table values written in place, give each new answer."""
    rounds = [FULL, SLIDING, [(0, 40), (0, 0), (1, 2)]]
    cases = [make_case(p, 4, 2, 6, 16, seed=17 + i, num_blocks=16) for i, p in enumerate(rounds)]
    static = [t.clone() for t in cases[0]]
    for case in cases:
        assert all(s.shape == c.shape for s, c in zip(static, case))
        for s, c in zip(static, case):
            s.copy_(c)
        close(ta.paged_canvas_attention(*static), reference(*case), 1e-5)


# turbo passes: A query rows (active positions) against C canvas keys. (prefixes, heads, kv heads,
# A, C): A = 1 (one packed tile), 5, C; G * A over one query tile and over two; a canvas over two
# key tiles (C = 32); an empty prefix on every row (only canvas keys).
ACTIVE = {
    "full-1": (FULL, 4, 2, 1, 16),
    "full-5": (FULL, 8, 2, 5, 16),
    "full-C": (FULL, 4, 2, 16, 16),
    "sliding-1": (SLIDING, 8, 2, 1, 32),
    "sliding-5": (SLIDING, 4, 2, 5, 32),
    "empty-5": ([(0, 0), (0, 0)], 4, 2, 5, 32),
}


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("case", list(ACTIVE))
def test_active_rows_match_gathered_sdpa(case, splits):
    """A != C: the A queries against the row's prefix and all C canvas keys, as sdpa computes it."""
    prefixes, heads, kv_heads, active, canvas = ACTIVE[case]
    args = make_case(prefixes, heads, kv_heads, canvas, 16, seed=23 + active + canvas, queries=active)
    out = ta.paged_canvas_attention(*args, num_splits=splits)
    assert out.shape == (len(prefixes), active, heads, 16)
    close(out, reference(*args), 1e-5)


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("active", [1, 5])
def test_active_rows_bf16(active, splits):
    args = make_case(SLIDING, 4, 2, 16, 32, dtype=torch.bfloat16, seed=29 + active, queries=active)
    out = ta.paged_canvas_attention(*args, num_splits=splits)
    assert out.dtype == torch.bfloat16 and out.shape == (3, active, 4, 32)
    close(out, reference(*args), 2e-2)


@pytest.mark.parametrize("splits", [1, 2])
def test_active_rows_are_the_full_canvas_rows(splits):
    """What a turbo pass relies on: the active positions' queries alone give those rows of the
    full C-query pass (bidirectional: a query's output does not depend on the other queries),
    picked in any order, across canvas tiles, or as a strided view of the full q."""
    q, *rest = make_case(SLIDING, 4, 2, 32, 16, seed=31)
    full = ta.paged_canvas_attention(q, *rest, num_splits=splits)
    idx = torch.tensor([31, 0, 17, 5, 16])
    close(ta.paged_canvas_attention(q[:, :, idx], *rest, num_splits=splits), full[:, idx], 1e-6)
    view = q[:, :, 3:30:4]  # strided along A: the kernel reads q's own strides
    close(ta.paged_canvas_attention(view, *rest, num_splits=splits), full[:, 3:30:4], 1e-6)


BAD = {
    "kv heads": (lambda a: a.__setitem__(1, a[1][:, :1]), "k_canvas / v_canvas must be"),
    "canvas rows": (lambda a: [a.__setitem__(i, a[i][:2]) for i in (1, 2)], "with q's n = 3 rows"),
    "canvas dim": (lambda a: [a.__setitem__(i, a[i][..., :8]) for i in (1, 2)], "with q's head_dim D = 16"),
    "no queries": (lambda a: a.__setitem__(0, a[0][:, :, :0]), "at least one query row"),
    "heads": (lambda a: a.__setitem__(0, a[0][:, :3]), "do not divide"),
    "pool dim": (lambda a: a.__setitem__(3, a[3][..., :8]), "k_pool / v_pool must"),
    "head dim": (lambda a: [a.__setitem__(i, a[i][..., :8]) for i in range(5)], "head_dim must be a power of two"),
    "dtype": (lambda a: a.__setitem__(4, a[4].to(torch.bfloat16)), "must share a dtype"),
    "table dtype": (lambda a: a.__setitem__(5, a[5].long()), "block_tables must be int32"),
    "start shape": (lambda a: a.__setitem__(7, a[7][:2]), "start must be int32 [n=3]"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_inputs_raise(name):
    args = list(make_case(FULL, 4, 2, 3, 16))
    edit, message = BAD[name]
    edit(args)
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        ta.paged_canvas_attention(*args)


@pytest.mark.parametrize("splits", [2, 3, 8])
@pytest.mark.parametrize(("lo", "start", "canvas"), [(0, 512, 256), (100, 612, 256), (0, 0, 256), (0, 7, 32)])
def test_splits_share_prefix_and_canvas_keys_equally(splits, lo, start, canvas):
    """The kernel's own `_split_keys`, run under the interpreter: the splits cover the prefix
    [lo, start) and the canvas keys [0, C) exactly once, in order, each at most one key tile more
    than an equal share (issue 54: the last split took every canvas key, 6 + 8 tiles against 6 at
    a batch-1 step's 512-key window)."""
    from dgemma.kernels.triton_support import tl, triton

    @triton.jit
    def ranges(out_ptr, lo, start, C, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
        s = tl.program_id(0)
        s_lo, s_hi, c_lo, c_hi = ta._split_keys(s, lo, start, C, NUM_SPLITS, BLOCK_N)
        tl.store(out_ptr + s * 4 + 0, s_lo)
        tl.store(out_ptr + s * 4 + 1, s_hi)
        tl.store(out_ptr + s * 4 + 2, c_lo)
        tl.store(out_ptr + s * 4 + 3, c_hi)

    block_n = 32
    out = torch.zeros(splits, 4, dtype=torch.int32)
    ranges[(splits,)](out, lo, start, canvas, NUM_SPLITS=splits, BLOCK_N=block_n)
    prefix = [p for a, b, _, _ in out.tolist() for p in range(a, b)]
    keys = [k for _, _, a, b in out.tolist() for k in range(a, b)]
    assert prefix == list(range(lo, start)) and keys == list(range(canvas))
    tiles = [-(-(b - a) // block_n) + -(-(d - c) // block_n) for a, b, c, d in out.tolist()]
    even = -(-(start - lo + canvas) // splits)
    assert max(tiles) <= -(-even // block_n) + 1, tiles
