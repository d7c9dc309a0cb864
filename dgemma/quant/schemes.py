"""The table of quantisation schemes: one `Scheme` a scheme, and the registry that holds them.

A scheme's facts (its compressed-tensors config and format, how many inputs share a scale, the
bytes it stores, its parts and how a tensor-parallel cut treats them, the kernels each device
has for it, whether `--quantization auto` may pick it) are written here once. The memory plan
(memory_plan.py), the fit check and `auto` (hub/fit.py), the tensor-parallel cut
(parallel/shard.py), the CLI's choices and the kernels (kernels/avx2.py, kernels/triton_quant.py)
read them from the table instead of comparing scheme names; formats.py holds each scheme's maths
(quantise, dequantise). docs/quantization.md's "Adding a scheme" says what to write where.

The registry (`register`, `unregister`) is the only mutable state here: a scheme registered is
seen by every reader at once, since they ask the table when they need it (a parser's choices when
it is built, `auto`'s order at each fit). This module imports nothing of dgemma: every other
module of quant/, kernels/ and the layers above may read it without a cycle.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

WEIGHT_SHAPE = "weight_shape"  # int32 [2]: the 2D weight's [out, in], stored once per tensor
GLOBAL_SCALE = "weight_global_scale"  # float32: one per 2D weight (per expert of a fused one)
GLOBAL_SCALE_BYTES = 4
WEIGHT_SHAPE_BYTES = 8
CHANNEL_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class QuantError(ValueError):
    """A scheme, group size or weight shape that cannot be quantised (the message says why)."""


@dataclass(frozen=True)
class GroupRule:
    """How many inputs of a row share one scale: a `fixed` number (nvfp4's 16), a number the
    caller chooses (`default` when not given; a positive multiple of `multiple`, int4's 8 codes
    of a packed word), or neither: one scale per output channel."""

    fixed: int | None = None
    default: int | None = None
    multiple: int = 1

    @property
    def per_channel(self) -> bool:
        return self.fixed is None and self.default is None

    @property
    def choosable(self) -> bool:
        """The caller picks the group size (`--group-size`)."""
        return self.fixed is None and self.default is not None

    def chosen(self, group_size: int | None) -> int | None:
        """The caller's group size as the scheme takes it: its default when None; None where the
        caller has no say (a fixed group, or per channel)."""
        return (group_size or self.default) if self.choosable else None

    def inputs(self, group_size: int | None) -> int | None:
        """Inputs per scale for a caller's group size; None: one scale per output channel."""
        return self.fixed if self.fixed is not None else self.chosen(group_size)

    def check(self, scheme: str, group_size: int | None) -> None:
        """QuantError where a chosen group size is not a positive multiple of `multiple`."""
        if self.choosable and (group_size is None or group_size < self.multiple or group_size % self.multiple):
            raise QuantError(f"{scheme} group size must be a positive multiple of {self.multiple} (got {group_size})")


@dataclass(frozen=True)
class Kernels:
    """The kernels each device has for a scheme (where none is named, torch dequantises the weight:
    formats.dequantize). `cpu`: the suffix of the native functions (`dequant_<cpu>`, `gemm_<cpu>`
    of csrc/dequant.cpp, gemm_avx2.cpp and dequant_avx512.cpp: kernels/avx2.py), which read scales
    of `cpu_scale_dtypes`; `cuda`: the Triton GEMM's decoder (its `SCHEME` constant:
    kernels/triton_quant.py); `cuda_fp8_activations`: the first compute capability (10 x major +
    minor) whose tensor cores multiply e4m3 operands, from which the fused network's dense linears
    quantise their activations per token and run W8A8 (kernels/choice.py's `fp8_activations`;
    None: weight-only on every GPU)."""

    cpu: str | None = None
    cpu_scale_dtypes: tuple[torch.dtype, ...] = ()
    cuda: int | None = None
    cuda_fp8_activations: int | None = None


@dataclass(frozen=True)
class Scheme:
    """One quantisation scheme, as every reader outside formats.py needs it.

    - `bits`, `kind`, `strategy` (and `extra_args`): its compressed-tensors weights args
      (num_bits, type, strategy; the group size is `group`'s); `disk_format`: the format dgemma writes;
      `activations`: the input_activations it writes (None: weight-only);
      `embedding_format`: the format of the tied embedding table quantised per row with it
      (`dgemma quantize --quantize-embeddings`; None: not offered).
    - `group`: how many inputs share a scale; `scale_bytes`: bytes of one scale in memory (None:
      the model's dtype).
    - `main_part`: the part that holds the codes in memory, `codes_per_element` of them a stored
      element along the inputs (a column cut's unit); `parts`: every part in memory (a
      GLOBAL_SCALE and WEIGHT_SHAPE stay whole under a row or column cut, the others are cut with
      the rows); `amax_dims`: the dims, counted from the end, whose largest magnitude sets a
      scale beyond one group (a cut across them needs the whole weight's: parallel/shard.py).
    - `kernels`: what each device runs it with; `auto`: `--quantization auto` may pick it, in the
      table's order (the first whose plan fits)."""

    name: str
    bits: int
    kind: str
    strategy: str
    disk_format: str
    group: GroupRule
    scale_bytes: int | None
    main_part: str
    parts: tuple[str, ...]
    codes_per_element: int = 1
    amax_dims: tuple[int, ...] = ()
    extra_args: Mapping[str, object] = field(default_factory=lambda: MappingProxyType({}))
    activations: Mapping[str, object] | None = None
    embedding_format: str | None = None
    kernels: Kernels = Kernels()
    auto: bool = True

    @property
    def global_scale(self) -> bool:
        return GLOBAL_SCALE in self.parts

    @property
    def shape_bytes(self) -> int:
        """Bytes stored once per tensor beside its matrices (int4's weight_shape)."""
        return WEIGHT_SHAPE_BYTES if WEIGHT_SHAPE in self.parts else 0

    def matrix_bytes(self, rows: int, cols: int, group_size: int | None, dtype_size: int) -> int:
        """Bytes of one [rows, cols] weight in memory: its codes, a scale per group (per output
        channel), a float32 global scale where it has one."""
        inputs = self.group.inputs(group_size)
        scales = rows * (math.ceil(cols / inputs) if inputs else 1) * (self.scale_bytes or dtype_size)
        return rows * cols * self.bits // 8 + scales + (GLOBAL_SCALE_BYTES if self.global_scale else 0)


_REGISTRY: dict[str, Scheme] = {}  # name -> scheme, in the order they were registered


def register(scheme: Scheme) -> Scheme:
    """Add `scheme` to the table (after those there: `auto` tries it last). The registry is the
    one piece of mutable global state of quant/, on purpose: the schemes are a vocabulary the
    CLI, the planner, the loader and the kernels must agree on within a process, so a scheme
    added here (built in, or by a test or an extension) is seen by all of them at once, and
    everything else derives from it when asked."""
    if scheme.name == "auto":
        raise QuantError("'auto' is --quantization's own choice (the best scheme that fits), not a scheme's name")
    if scheme.name in _REGISTRY:
        raise QuantError(f"a quantization scheme named {scheme.name!r} exists already")
    _REGISTRY[scheme.name] = scheme
    return scheme


def unregister(name: str) -> None:
    """Remove a scheme `register` added (a test's toy); the built-in ones stay."""
    if name in BUILTIN:
        raise QuantError(f"{name!r} is a built-in quantization scheme and stays")
    _REGISTRY.pop(name, None)


def find(name: str | None) -> Scheme | None:
    """The scheme of that name, or None (no scheme, an unknown name, a checkpoint's "mixed")."""
    return _REGISTRY.get(name) if name is not None else None


def get(name: str) -> Scheme:
    """The scheme of that name; QuantError naming the choices where there is none."""
    scheme = _REGISTRY.get(name)
    if scheme is None:
        raise QuantError(f"unknown quantization scheme {name!r}; choose one of {', '.join(names())}")
    return scheme


def names() -> tuple[str, ...]:
    """Every scheme's name, in the table's order (the CLI's choices)."""
    return tuple(_REGISTRY)


def auto_names() -> tuple[str, ...]:
    """The schemes `--quantization auto` tries, in order, after the unquantised weights."""
    return tuple(name for name, scheme in _REGISTRY.items() if scheme.auto)


def embedding_names() -> tuple[str, ...]:
    """The schemes the tied embedding table may be quantised with (`--quantize-embeddings`)."""
    return tuple(name for name, scheme in _REGISTRY.items() if scheme.embedding_format)


# ------------------------------------------------------------------------------------------ the table
FP8_ACTIVATIONS = MappingProxyType(  # FP8_DYNAMIC's dynamic per-token fp8 activations (vLLM computes their scales)
    {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": "token", "dynamic": True}
)

FP8 = register(
    Scheme(
        "fp8",
        bits=8,
        kind="float",
        strategy="channel",
        disk_format="float-quantized",
        group=GroupRule(),
        scale_bytes=4,
        main_part="weight",
        parts=("weight", "weight_scale"),
        amax_dims=(-1,),
        activations=FP8_ACTIVATIONS,
        embedding_format="naive-quantized",
        # W8A8 from sm89 (Ada, Hopper: fp8 MMA); sm80 keeps the weight-only GEMM
        kernels=Kernels("fp8", CHANNEL_SCALE_DTYPES, cuda=2, cuda_fp8_activations=89),
    )
)
INT8 = register(
    Scheme(
        "int8",
        bits=8,
        kind="int",
        strategy="channel",
        disk_format="pack-quantized",  # weight-only integers: the library's choice, and vLLM's WNA16 input
        group=GroupRule(),
        scale_bytes=4,
        main_part="weight",  # unpacked in memory (quant/pack.py packs it for disk)
        parts=("weight", "weight_scale"),
        amax_dims=(-1,),
        embedding_format="pack-quantized",
        kernels=Kernels("int8", CHANNEL_SCALE_DTYPES, cuda=1),
    )
)
INT4 = register(
    Scheme(
        "int4",
        bits=4,
        kind="int",
        strategy="group",
        disk_format="pack-quantized",
        group=GroupRule(default=64, multiple=8),  # 64 divides every input size of the released model; 128 does not
        scale_bytes=None,
        main_part="weight_packed",
        parts=("weight_packed", "weight_scale", WEIGHT_SHAPE),
        codes_per_element=8,
        kernels=Kernels("int4", CHANNEL_SCALE_DTYPES, cuda=0),
    )
)
NVFP4 = register(
    Scheme(
        "nvfp4",
        bits=4,
        kind="float",
        strategy="tensor_group",
        disk_format="nvfp4-pack-quantized",
        group=GroupRule(fixed=16),
        scale_bytes=1,
        main_part="weight_packed",
        parts=("weight_packed", "weight_scale", GLOBAL_SCALE),
        codes_per_element=2,
        amax_dims=(-2, -1),
        extra_args=MappingProxyType({"scale_dtype": "torch.float8_e4m3fn"}),
        kernels=Kernels("nvfp4", (torch.float8_e4m3fn, torch.uint8), cuda=3),
    )
)
BUILTIN = names()
