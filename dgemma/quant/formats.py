"""Quantisation formats (pure functions): a weight [..., out, in] to its quantised parts and back.

The parts are named and laid out as compressed-tensors stores them, so a checkpoint is the parts
under `<module>.<part>` and nothing needs converting on the way to or from disk:

    scheme  compressed-tensors format  parts
    fp8     float-quantized            weight (float8_e4m3fn), weight_scale [.., out, 1] (per output channel)
    int8    int-quantized              weight (int8), weight_scale [.., out, 1] (symmetric, per output channel)
    int4    pack-quantized             weight_packed (int32: 8 values + 8 each, value k of a word in bits 4k..4k+3),
                                       weight_scale [.., out, in / group], weight_shape (symmetric, group-wise)
    nvfp4   nvfp4-pack-quantized       weight_packed (uint8: two e2m1 codes, the first in the low nibble),
                                       weight_scale [.., out, in / 16] (float8_e4m3fn), weight_global_scale [.., 1]

Dequantised: fp8 / int8 `q * scale`; int4 `q * scale` with one scale per `group` inputs;
nvfp4 `e2m1(q) * scale / global_scale` with one fp8 scale per 16 inputs. Scales are chosen so
the largest magnitude of a channel (or group) maps to the largest code: rounding to the nearest
code then errs by at most half a step. (compressed-tensors' own calibration divides by half the
code range, 127.5 and 7.5; any scale decompresses the same way.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import schemes
from .schemes import QuantError

SCHEMES = schemes.BUILTIN  # the built-in schemes (schemes.names(): the table as it stands now)
DEFAULT_GROUP_SIZE = schemes.INT4.group.default  # int4: divides every input size of the released model; 128 does not
NVFP4_GROUP = schemes.NVFP4.group.fixed
FP8_MAX = 448.0  # float8_e4m3fn
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # code & 7 -> magnitude; code & 8 -> sign


@dataclass
class QTensor:
    """A quantised weight: its scheme, the full-precision shape [..., out, in] and its parts."""

    scheme: str
    shape: tuple[int, ...]
    parts: dict[str, torch.Tensor] = field(default_factory=dict)
    group_size: int | None = None  # inputs per scale: None = per output channel

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts.values())

    def select(self, index: int) -> QTensor:
        """The weight at `index` of the leading dim (one expert of a fused [E, out, in] weight)."""
        parts = {k: v[index] for k, v in self.parts.items() if k != "weight_shape"}
        if "weight_shape" in self.parts:
            parts["weight_shape"] = torch.tensor(self.shape[-2:], dtype=torch.int32)
        return QTensor(self.scheme, tuple(self.shape[1:]), parts, self.group_size)

    def rows(self, start: int, end: int) -> QTensor:
        """Output channels [start, end) of a 2D weight (a tile of a matmul)."""
        parts = {
            k: (v[start:end] if k not in ("weight_global_scale", "weight_shape") else v) for k, v in self.parts.items()
        }
        if "weight_shape" in parts:
            parts["weight_shape"] = torch.tensor((end - start, self.shape[-1]), dtype=torch.int32)
        return QTensor(self.scheme, (end - start, self.shape[-1]), parts, self.group_size)


def check_scheme(scheme: str, group_size: int | None = None) -> None:
    """QuantError where `scheme` is not in the table, or its group rule refuses `group_size` (a
    scheme whose group size the caller chooses needs one: GroupRule.chosen gives the default)."""
    schemes.get(scheme).group.check(scheme, group_size)


def _grouped_absmax(w: torch.Tensor, group: int) -> torch.Tensor:
    """max |w| over each run of `group` inputs: [..., out, in] -> [..., out, in / group] float32."""
    return w.float().unflatten(-1, (-1, group)).abs().amax(dim=-1)


def scale_amax(w: torch.Tensor, scheme: str) -> torch.Tensor | None:
    """The largest magnitudes `quantize` takes a weight's scales from, where they span more than
    one group: each output channel's [..., out, 1] (fp8, int8), each 2D weight's [...] (nvfp4's
    global scale); None for int4 (its groups' own). A slice of a weight (tensor parallelism)
    quantises as the whole does given the whole's: the max of its slices' (parallel/shard.py)."""
    if scheme in ("fp8", "int8"):
        return w.float().abs().amax(dim=-1, keepdim=True)
    if scheme == "nvfp4":
        return w.float().abs().amax(dim=(-2, -1))
    return None


def quantize(
    w: torch.Tensor,
    scheme: str,
    group_size: int | None = DEFAULT_GROUP_SIZE,
    scale_dtype: torch.dtype = torch.float32,
    amax: torch.Tensor | None = None,
) -> QTensor:
    """Quantise a weight [..., out, in] (any float dtype; computed in float32). int4's group scales
    are stored in `scale_dtype` (the model's dtype, as compressed-tensors stores them: bf16 halves
    their bytes) and the codes are computed against the stored scales. `amax`: `scale_amax` of
    the whole weight `w` is a slice of (None: `w`'s own)."""
    check_scheme(scheme, group_size if scheme == "int4" else None)
    shape, inputs = tuple(w.shape), w.shape[-1]
    wf = w.float()
    if scheme in ("fp8", "int8"):
        top = FP8_MAX if scheme == "fp8" else 127.0
        peak = wf.abs().amax(dim=-1, keepdim=True) if amax is None else amax.float()
        scale = (peak / top).clamp(min=torch.finfo(torch.float32).tiny)
        scaled = wf / scale
        q = scaled.to(torch.float8_e4m3fn) if scheme == "fp8" else scaled.round().clamp(-128, 127).to(torch.int8)
        return QTensor(scheme, shape, {"weight": q, "weight_scale": scale})
    group = group_size if scheme == "int4" else NVFP4_GROUP
    if inputs % group:
        raise QuantError(f"{scheme} needs the input size ({inputs}) to be a multiple of its group size {group}")
    if scheme == "int4":
        scale = (_grouped_absmax(wf, group) / 7.0).clamp(min=torch.finfo(scale_dtype).tiny).to(scale_dtype)
        q = (wf.unflatten(-1, (-1, group)) / scale.float()[..., None]).round().clamp(-8, 7).flatten(-2).to(torch.int8)
        parts = {
            "weight_packed": pack_int4(q),
            "weight_scale": scale,
            "weight_shape": torch.tensor(shape[-2:], dtype=torch.int32),
        }
        return QTensor(scheme, shape, parts, group)
    if scheme != "nvfp4":  # a scheme of the table whose maths is not written here (yet)
        raise QuantError(f"formats.py has no quantisation for the scheme {scheme!r}")
    # nvfp4: a float32 global scale per 2D weight (per expert of a fused one) puts its largest
    # group scale at the top of fp8's range
    amax = (wf.abs().amax(dim=(-2, -1)) if amax is None else amax.float()).clamp(min=torch.finfo(torch.float32).tiny)
    global_scale = (FP8_MAX * E2M1_MAX / amax).reshape(*shape[:-2], 1)
    scale = (_grouped_absmax(wf, group) / E2M1_MAX * global_scale[..., None]).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
    step = (scale.float() / global_scale[..., None]).clamp(min=torch.finfo(torch.float32).tiny)
    codes = e2m1_codes(wf.unflatten(-1, (-1, group)) / step[..., None]).flatten(-2)
    parts = {"weight_packed": pack_e2m1(codes), "weight_scale": scale, "weight_global_scale": global_scale}
    return QTensor(scheme, shape, parts, group)


def dequantize(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The full-precision weight [..., out, in] a QTensor stands for."""
    p = q.parts
    if q.scheme in ("fp8", "int8"):
        return (p["weight"].float() * p["weight_scale"].float()).to(dtype)
    if q.scheme == "int4":
        values = unpack_int4(p["weight_packed"]).float()
        scale = p["weight_scale"].float()
    elif q.scheme == "nvfp4":
        values = e2m1_values(unpack_e2m1(p["weight_packed"]))
        scale = p["weight_scale"].float() / p["weight_global_scale"].float()[..., None]
    else:
        raise QuantError(f"unknown quantization scheme {q.scheme!r}")
    return (values.unflatten(-1, (scale.shape[-1], -1)) * scale[..., None]).flatten(-2).to(dtype)


# ---------------------------------------------------------------------------------------- packing
def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7] [..., n] (n a multiple of 8) -> int32 [..., n / 8], offset by 8."""
    u = (q.to(torch.int64) + 8).unflatten(-1, (-1, 8))
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=q.device)
    words = (u << shifts).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the same 32 bits, as int32


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., n / 8] -> int8 [..., n] in [-8, 7]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed[..., None] >> shifts) & 0xF
    return (nibbles - 8).flatten(-2).to(torch.int8)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """The nearest e2m1 code (sign bit 8, magnitude index 0..7) of each value (float32), uint8; a
    value half-way between two codes takes the smaller magnitude. (A search among the midpoints:
    one pass, where comparing with all 8 values made writing the released model's experts slow.)"""
    grid = torch.tensor(E2M1_VALUES, device=x.device)
    midpoints = (grid[1:] + grid[:-1]) / 2
    index = torch.bucketize(x.abs().clamp(max=E2M1_MAX), midpoints).to(torch.uint8)
    return index | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    grid = torch.tensor(E2M1_VALUES, device=codes.device)
    mag = grid[(codes & 7).long()]
    return torch.where((codes & 8).bool(), -mag, mag)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., n] (n even) -> uint8 [..., n / 2], the first of each pair in the low nibble."""
    pairs = codes.unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)
