"""Quantised weights split across the worker's ranks, and checkpoints read shard by shard
(dgemma/parallel/shard.py, model/weights.py, quant/read.py).

- Every scheme quantised after the cut (`shard_model(..., quantization=)`) holds exactly its cut
  of the whole quantised model (codes and scales equal bit for bit, fp8 / int8 column splits and
  nvfp4 taking the whole weight's maxima through an all-reduce), and its gathered logits match the
  one-process quantised model's (rtol = atol = 1e-4) with the same experts picked.
- The released model's divisibility (704 / 2112, int4 groups of 64): the dense MLP is held whole by
  one rank per layer (the others' zeros), the experts' split is a one-line refusal that names
  expert parallelism, which then runs; an o_proj whose heads cut a group is refused.
- `load_weights` with a `ShardedLoad` reads only each tensor's slice (get_slice; bytes counted)
  into a meta model cut first: every tensor equals `shard_model` of the full model, and the bytes
  read are exactly the bytes the rank holds, which are the plan's count for the rank (memory_plan's
  `rank_weight_bytes`), well under the file's.
- `dgemma.load(..., quantization=X, tensor_parallel_size=2)` and pre-quantised checkpoints
  (dgemma's compressed-tensors files, ModelOpt's NVFP4) hold the cut of what one process loads.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import tempfile
from contextlib import contextmanager
from itertools import chain
from pathlib import Path

import torch
from checks_model import TOL, _passes
from safetensors.torch import save_file

import dgemma
from dgemma.config import GLOBAL, SLIDING
from dgemma.memory_plan import rank_weight_bytes
from dgemma.model import weights as weights_module
from dgemma.model.checkpoint import make_config, random_model, save_checkpoint
from dgemma.model.weights import load_weights
from dgemma.parallel.group import ShardGroup
from dgemma.parallel.plan import ShardError
from dgemma.parallel.shard import Cut, Elsewhere, ShardedLoad, shard_model
from dgemma.quant.formats import QuantError, dequantize, quantize
from dgemma.quant.modules import QuantExperts, QuantLinear, quantize_model
from dgemma.quant.pack import cut_qtensor
from dgemma.quant.tensor_sources import TensorReader
from dgemma.quant.write import write_quantized

# 4 query heads of 16 (2 per rank: 32 inputs of o_proj), sliding 2 KV heads split, K=V global
# layers' 1 KV head replicated; 32 of 64 intermediate and of 64 expert intermediate per rank:
# whole int4 groups of 32 and nvfp4 groups of 16; vocabulary 1003 (shards 512 + 491)
SHAPE = dict(
    vocab_size=1003,
    hidden_size=64,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    global_head_dim=32,
    num_global_kv_heads=1,
    intermediate_size=64,
    num_experts=4,
    top_k_experts=2,
    moe_intermediate_size=64,
    sliding_window=4,
    canvas_length=8,
    layer_types=[SLIDING, GLOBAL, SLIDING],
    max_position_embeddings=128,
)
# the released model's divisibility: 2112 -> 1056 and 704 -> 352 per rank (not whole int4 groups of
# 64; whole nvfp4 groups of 16), 4 heads of 16 per rank (64 inputs of o_proj)
RELEASED = dict(
    vocab_size=1000,
    hidden_size=64,
    num_layers=2,
    num_heads=8,
    num_kv_heads=4,
    head_dim=16,
    global_head_dim=32,
    num_global_kv_heads=2,
    intermediate_size=2112,
    num_experts=4,
    top_k_experts=2,
    moe_intermediate_size=704,
    sliding_window=4,
    canvas_length=8,
    layer_types=[SLIDING, GLOBAL],
    max_position_embeddings=128,
)
GROUP = {"fp8": None, "int8": None, "int4": 32, "nvfp4": None}


def _whole_and_share(shape: dict, seed: int):
    config = make_config(**shape)
    return config, random_model(config, seed=seed, std=0.15)


def _assert_share(net, whole) -> int:
    """Every tensor `net` (one rank's share) holds is exactly its cut of `whole`'s (the one-process
    model): quantised weights part by part (`cut_qtensor`), the rest by `Cut.of`. Returns how many."""
    layout = net.shard_layout
    held = dict(chain(net.named_parameters(), net.named_buffers()))
    seen, quantised = set(), set()
    for path, module in whole.named_modules():
        if isinstance(module, QuantLinear):
            weights = {f"{path}.weight": (module, f"{path}")}
        elif isinstance(module, QuantExperts):
            weights = {f"{path}.{w}": (getattr(module, w), f"{path}.{w}") for w in ("gate_up_proj", "down_proj")}
        else:
            continue
        quantised.add(path)
        for name, (qweight, _) in weights.items():
            cut = layout.cut(name)
            if cut is None:
                continue
            want = qweight.qtensor if cut.whole else cut_qtensor(qweight.qtensor, cut.dim, cut.spans)
            target = layout.target(name)
            prefix = target if isinstance(module, QuantExperts) else target.rpartition(".")[0]
            for part, t in want.parts.items():
                got = held[f"{prefix}.{part}"]
                assert got.dtype == t.dtype and torch.equal(got, t), f"{prefix}.{part} is not the cut of the whole's"
                seen.add(f"{prefix}.{part}")
    for name, t in chain(whole.named_parameters(), whole.named_buffers()):
        if name.rpartition(".")[0] in quantised or name.rsplit(".", 2)[0] in quantised:
            continue
        cut = layout.cut(name)
        if cut is None:
            continue
        target = layout.target(name)
        assert torch.equal(held[target], cut.of(t.detach())), f"{target} is not the cut of the whole's"
        seen.add(target)
    assert seen == set(held), f"held but not checked: {sorted(set(held) - seen)[:3]}"
    return len(seen)


def _compare_logits(net, whole, group: ShardGroup) -> None:
    want = _passes(whole, whole.config, None)
    got = _passes(net, net.kv_config, group)
    for key in ("prompt", "canvas", "soft", "conditioned", "commit", "next"):
        err = (got[key] - want[key]).abs().max().item()
        assert torch.allclose(got[key], want[key], **TOL), f"{key}: max |difference| {err:.3g}"
    assert torch.equal(got["experts"], want["experts"]), "the sharded router picked other experts"


def _quantised_split(shape: dict, group: ShardGroup, scheme: str, group_size: int | None, ep: bool, seed: int):
    _, whole = _whole_and_share(shape, seed)
    net = shard_model(copy.deepcopy(whole), group, ep, quantization=(scheme, group_size))
    quantize_model(whole, scheme, group_size)
    _assert_share(net, whole)
    _compare_logits(net, whole, group)
    return net


def _refused(message: str, call) -> None:
    try:
        call()
    except ShardError as e:
        assert "\n" not in str(e) and re.search(message, str(e)), str(e)
    else:
        raise AssertionError(f"no ShardError for {message}")


def check_cut_qtensor_is_the_cut_of_the_weight(group: ShardGroup) -> None:
    """`cut_qtensor` of a quantised weight dequantises to the same cut of its dequantised weight
    (experts' rows in two spans, whole experts, columns of whole groups); a cut group is refused."""
    gen = torch.Generator().manual_seed(0)
    for scheme in ("fp8", "int8", "int4", "nvfp4"):
        for shape, dim, spans in (
            ((4, 64, 32), 1, ((8, 24), (40, 56))),
            ((4, 64, 32), 0, ((1, 3),)),
            ((4, 32, 64), 2, ((32, 64),)),
            ((48, 64), 0, ((16, 32),)),
            ((48, 64), 1, ((0, 32),)),
        ):
            q = quantize(torch.randn(shape, generator=gen), scheme, 16)
            assert torch.equal(dequantize(cut_qtensor(q, dim, spans)), Cut(dim, spans).of(dequantize(q))), (scheme, dim)
        if scheme in ("int4", "nvfp4"):
            try:
                cut_qtensor(quantize(torch.randn(8, 64, generator=gen), scheme, 16), 1, ((8, 40),))
            except QuantError as e:
                assert str(e) == f"columns [(8, 40)] of a {scheme} weight cut its groups of 16 inputs", str(e)
            else:
                raise AssertionError(f"{scheme}: a cut group was not refused")


def check_every_scheme_quantised_after_the_cut(group: ShardGroup) -> None:
    for i, scheme in enumerate(("fp8", "int8", "int4", "nvfp4")):
        net = _quantised_split(SHAPE, group, scheme, GROUP[scheme], ep=False, seed=i)
        assert net.quantization[0] == scheme and not net.shard_layout.owners
    _quantised_split(SHAPE, group, "nvfp4", None, ep=True, seed=5)
    _quantised_split(SHAPE, group, "int8", None, ep=True, seed=6)


def check_released_divisibility_int4(group: ShardGroup) -> None:
    """int4 groups of 64: each layer's dense MLP whole on one rank (layer i on rank i % 2), the
    experts' 352 refused without expert parallelism and split whole with it; nvfp4's 16 divide both."""
    config = make_config(**RELEASED)
    _refused(
        r"layers\.0\.experts: the 352 of each expert's intermediate each of 2 ranks holds are not whole int4 "
        r"groups of 64: use expert parallelism, or a group size that divides 352",
        lambda: shard_model(random_model(config, seed=0), group, False, quantization=("int4", 64)),
    )
    net = _quantised_split(RELEASED, group, "int4", 64, ep=True, seed=7)
    assert net.shard_layout.owners == {0: 0, 1: 1}
    for i, layer in enumerate(net.layers):
        mine = i % group.size == group.rank
        assert isinstance(layer.mlp, Elsewhere) != mine and (not mine or isinstance(layer.mlp.down_proj, QuantLinear))
    net = _quantised_split(RELEASED, group, "nvfp4", None, ep=False, seed=8)
    assert not net.shard_layout.owners
    _refused(
        r"layers\.0\.self_attn\.o_proj: the 32 inputs each of 2 ranks holds are not whole int4 groups of 64",
        lambda: shard_model(random_model(make_config(**SHAPE), seed=0), group, quantization=("int4", 64)),
    )


@contextmanager
def _shared_dir(group: ShardGroup):
    """A temporary directory with the same path on every rank (rank 0 makes and removes it)."""
    path = group.broadcast_object(tempfile.mkdtemp(prefix="dgemma-tp-") if group.rank == 0 else None)
    try:
        yield Path(path)
    finally:
        group.barrier()
        if group.rank == 0:
            shutil.rmtree(path, ignore_errors=True)


def _written(group: ShardGroup, write) -> None:
    """`write()` on rank 0, the others waiting for it."""
    if group.rank == 0:
        write()
    group.barrier()


@contextmanager
def _counted_reads():
    """Bytes read through load_weights' safe_open handles: whole tensors (get_tensor) and slices."""
    counts = {"whole": 0, "sliced": 0}
    real = weights_module.safe_open

    class Slice:
        def __init__(self, part):
            self.part = part

        def get_shape(self):
            return self.part.get_shape()

        def __getitem__(self, index):
            t = self.part[index]
            counts["sliced"] += t.numel() * t.element_size()
            return t

    class Handle:
        def __init__(self, *args, **kwargs):
            self.handle = real(*args, **kwargs)

        def get_tensor(self, name):
            t = self.handle.get_tensor(name)
            counts["whole"] += t.numel() * t.element_size()
            return t

        def get_slice(self, name):
            return Slice(self.handle.get_slice(name))

    weights_module.safe_open = Handle
    try:
        yield counts
    finally:
        weights_module.safe_open = real


def check_load_reads_only_the_share(group: ShardGroup) -> None:
    """The meta model cut first, each tensor's slice read: the tensors are shard_model's of the
    full model, and the bytes read are the bytes held (the file's share, not the file)."""
    config, whole = _whole_and_share(SHAPE, seed=9)
    with _shared_dir(group) as root:
        _written(group, lambda: save_checkpoint(whole, root / "f32"))
        on_disk = (root / "f32" / "model.safetensors").stat().st_size
        for ep in (False, True):
            with _counted_reads() as counts:
                net = load_weights(config, root / "f32", shard=ShardedLoad(group, ep))
            want = shard_model(load_weights(config, root / "f32"), group, ep)
            assert not any(t.is_meta for t in chain(net.parameters(), net.buffers()))
            _assert_share(net, load_weights(config, root / "f32"))
            got, ref = dict(net.state_dict()), dict(want.state_dict())
            assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in got)
            held = sum(t.numel() * t.element_size() for t in chain(net.parameters(), net.buffers()))
            read = counts["whole"] + counts["sliced"]
            assert read == held, f"read {read} bytes, hold {held}"
            planned = sum(rank_weight_bytes(net.shard_plan, group.rank, None, None, torch.float32).values())
            assert held == planned, f"hold {held} bytes, the plan counts {planned}"
            assert counts["sliced"] > 0 and read < 0.7 * on_disk, (counts, on_disk)
            _compare_logits(net, whole, group)


def check_load_quantizing_while_reading(group: ShardGroup) -> None:
    """dgemma.load(quantization=X, tensor_parallel_size=2): the cut of what one process loads."""
    _, whole = _whole_and_share(SHAPE, seed=10)
    with _shared_dir(group) as root:
        _written(group, lambda: save_checkpoint(whole, root / "f32"))
        for scheme, ep in (("fp8", False), ("int8", True), ("int4", False), ("nvfp4", False)):
            one = dgemma.load(root / "f32", dtype="float32", quantization=scheme, group_size=GROUP[scheme])
            split = dgemma.load(
                root / "f32",
                dtype="float32",
                quantization=scheme,
                group_size=GROUP[scheme],
                tensor_parallel_size=group.size,
                expert_parallel=ep,
            )
            assert split.net.quantization == one.net.quantization
            _assert_share(split.net, one.net)
            _compare_logits(split.net, one.net, group)
        _refused(
            r"o_proj: the 32 inputs each of 2 ranks holds are not whole int4 groups of 64",
            lambda: dgemma.load(root / "f32", quantization="int4", tensor_parallel_size=group.size),
        )


def _modelopt(src: Path, out: Path) -> None:
    """dgemma's nvfp4 checkpoint as ModelOpt writes NVFP4 (`weight` uint8, `weight_scale_2` the
    reciprocal global scale; tests/quant/test_quant_checkpoint.py's `modelopt_from`)."""
    reader, tensors = TensorReader(src), {}
    for name in reader.files:
        t, (module, _, part) = reader.get(name), name.rpartition(".")
        if part == "weight_packed":
            tensors[f"{module}.weight"] = t
        elif part == "weight_global_scale":
            tensors[f"{module}.weight_scale_2"] = (1.0 / t).reshape(())
            tensors[f"{module}.input_scale"] = torch.tensor(0.02)
        else:
            tensors[name] = t
    out.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    config["quantization_config"] = {
        "config_groups": {"group_0": {"input_activations": fp4, "weights": fp4, "targets": ["Linear"]}},
        "ignore": ["lm_head", "*router*", "*self_conditioning*"],
        "quant_algo": "NVFP4",
        "kv_cache_scheme": None,
        "producer": {"name": "modelopt", "version": "0.37.0"},
        "quant_method": "modelopt",
    }
    (out / "config.json").write_text(json.dumps(config))
    shutil.copy(src / "generation_config.json", out / "generation_config.json")


def check_prequantized_checkpoints(group: ShardGroup) -> None:
    """dgemma quantize's files (experts per expert on disk) and ModelOpt's NVFP4, cut as read; the
    released divisibility's int4 file places the dense MLP and refuses the experts' split."""
    _, whole = _whole_and_share(SHAPE, seed=11)
    _, released = _whole_and_share(RELEASED, seed=12)

    def write(root: Path) -> None:
        save_checkpoint(whole, root / "f32")
        for scheme in ("fp8", "int8", "int4", "nvfp4"):
            write_quantized(root / "f32", root / scheme, scheme, GROUP[scheme])
        _modelopt(root / "nvfp4", root / "modelopt")
        save_checkpoint(released, root / "released")
        write_quantized(root / "released", root / "released-int4", "int4", 64)

    with _shared_dir(group) as root:
        _written(group, lambda: write(root))
        for name, ep in (("fp8", False), ("int8", False), ("int4", True), ("nvfp4", False), ("modelopt", False)):
            one = dgemma.load(root / name, dtype="float32")
            split = dgemma.load(root / name, dtype="float32", tensor_parallel_size=group.size, expert_parallel=ep)
            assert split.net.quantization == one.net.quantization
            _assert_share(split.net, one.net)
            _compare_logits(split.net, one.net, group)
        _refused(
            r"layers\.0\.experts: .* not whole int4 groups of 64: use expert parallelism",
            lambda: dgemma.load(root / "released-int4", tensor_parallel_size=group.size),
        )
        one = dgemma.load(root / "released-int4", dtype="float32")
        split = dgemma.load(
            root / "released-int4", dtype="float32", tensor_parallel_size=group.size, expert_parallel=True
        )
        assert split.net.shard_layout.owners == {0: 0, 1: 1}
        _assert_share(split.net, one.net)
        _compare_logits(split.net, one.net, group)
