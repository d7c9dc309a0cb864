"""A quantised weight's parts as stored on disk <-> dgemma's QTensor, and the row and expert
surgery between them.

- int8 codes go to disk four to an int32 word, as compressed-tensors' pack-quantized format holds
  them (write.py says why); int4 and nvfp4 are stored as formats.py lays them out.
- Fused siblings (q/k/v, the MLP's gate/up, an expert's gate/up) are quantised together and split
  into their rows for disk (`split_rows`); reading joins them back (`concat_rows`) and stacks the
  per-expert projections into dgemma's [E, out, in] (`stack_experts`).
- nvfp4 weights fused on reading must share one global scale: where another writer gave them
  different ones, the fused weight takes the smaller (ModelOpt's larger `weight_scale_2`, as vLLM
  does) and the other projection's fp8 group scales are multiplied by the ratio and rounded to fp8
  once: exact when the ratio is a power of two, else within half an fp8 step (2^-4 relative).
"""

from __future__ import annotations

import torch

from ..model.layout import WeightsError
from . import schemes
from .formats import QTensor, QuantError

ROW_PARTS = ("weight", "weight_packed", "weight_scale")  # the parts with one row per output channel


class QuantPartsError(QuantError, WeightsError):
    """A quantised checkpoint's tensors are missing or do not fit its `quantization_config`."""


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """int8 codes [..., n] -> int32 [..., ceil(n / 4)], code k of a word in bits 8k..8k+7, offset by 128
    (compressed-tensors' pack_to_int32 for 8 bits). Assumes a little-endian host, as torch targets."""
    u = (q.to(torch.int16) + 128).to(torch.uint8)
    pad = -u.shape[-1] % 4
    if pad:
        u = torch.nn.functional.pad(u, (0, pad))
    return u.contiguous().view(torch.int32)


def unpack_int8(packed: torch.Tensor, columns: int) -> torch.Tensor:
    return (packed.contiguous().view(torch.uint8)[..., :columns].to(torch.int16) - 128).to(torch.int8)


def disk_parts(q: QTensor) -> dict[str, torch.Tensor]:
    """A QTensor's parts as written: int8 packed, the rest as formats.py lays them out."""
    if q.scheme != "int8":
        return dict(q.parts)
    shape = torch.tensor(q.shape[-2:], dtype=torch.int32)
    return {
        "weight_packed": pack_int8(q.parts["weight"]),
        "weight_scale": q.parts["weight_scale"],
        "weight_shape": shape,
    }


def split_rows(q: QTensor, sizes: list[int]) -> list[QTensor]:
    """A 2D QTensor cut into consecutive blocks of output rows (fused siblings apart again)."""
    out, start = [], 0
    for rows in sizes:
        parts = {k: (v[start : start + rows] if k in ROW_PARTS else v).clone() for k, v in q.parts.items()}
        if "weight_shape" in parts:
            parts["weight_shape"] = torch.tensor((rows, q.shape[-1]), dtype=torch.int32)
        out.append(QTensor(q.scheme, (rows, q.shape[-1]), parts, q.group_size))
        start += rows
    return out


def common_global_scale(qs: list[QTensor]) -> list[QTensor]:
    """nvfp4 weights brought to one global scale (the smallest), for fusing them (module docstring)."""
    target = torch.stack([q.parts["weight_global_scale"].float() for q in qs]).amin(dim=0)
    out = []
    for q in qs:
        ratio = target / q.parts["weight_global_scale"].float()
        scale = (q.parts["weight_scale"].float() * ratio[..., None]).to(torch.float8_e4m3fn)
        parts = dict(q.parts, weight_scale=scale, weight_global_scale=target.clone())
        out.append(QTensor(q.scheme, q.shape, parts, q.group_size))
    return out


def _check_fusable(qs: list[QTensor], what: str) -> None:
    if len({(q.scheme, q.group_size, q.shape[-1]) for q in qs}) != 1:
        raise QuantPartsError(f"{what}: the projections differ in scheme, group size or input size and cannot be fused")


def concat_rows(qs: list[QTensor], what: str = "weights") -> QTensor:
    """Weights [..., out_i, in] stacked along their output rows into one [..., sum out_i, in]."""
    _check_fusable(qs, what)
    if qs[0].scheme == "nvfp4":
        qs = common_global_scale(qs)
    first = qs[0]
    parts = {k: torch.cat([q.parts[k] for q in qs], dim=-2) for k in first.parts if k in ROW_PARTS}
    shape = (*first.shape[:-2], sum(q.shape[-2] for q in qs), first.shape[-1])
    if "weight_global_scale" in first.parts:
        parts["weight_global_scale"] = first.parts["weight_global_scale"]
    if "weight_shape" in first.parts:
        parts["weight_shape"] = torch.tensor(shape[-2:], dtype=torch.int32)
    return QTensor(first.scheme, shape, parts, first.group_size)


def stack_experts(qs: list[QTensor], what: str = "experts") -> QTensor:
    """One 2D weight per expert -> the fused [E, out, in] QTensor (one global scale per expert)."""
    _check_fusable(qs, what)
    if len({q.shape for q in qs}) != 1:
        raise QuantPartsError(f"{what}: experts have different shapes {sorted({q.shape for q in qs})}")
    first = qs[0]
    parts = {k: torch.stack([q.parts[k] for q in qs]) for k in first.parts if k != "weight_shape"}
    if "weight_shape" in first.parts:
        parts["weight_shape"] = torch.tensor(first.shape, dtype=torch.int32)
    return QTensor(first.scheme, (len(qs), *first.shape), parts, first.group_size)


def cut_qtensor(q: QTensor, dim: int, spans: tuple[tuple[int, int], ...]) -> QTensor:
    """The QTensor of the full-precision weight's spans [start, end) along `dim`, concatenated
    (what one rank of a tensor-parallel split holds: parallel/shard.py): a leading (expert) dim
    or the output rows cut every part with such a dim, the rows' scales with them; the input
    columns cut the codes and, with group-wise scales, whole groups of scales (a span that cuts
    a group is refused). Per-channel and global scales stay whole where they do not have the dim."""
    rank = len(q.shape)
    dim = dim % rank
    scheme = schemes.get(q.scheme)
    if dim == rank - 1 and not scheme.group.per_channel:
        unit = q.group_size
        if any(s % unit or (e % unit and e != q.shape[-1]) for s, e in spans):
            raise QuantError(f"columns {list(spans)} of a {q.scheme} weight cut its groups of {unit} inputs")
    per = scheme.codes_per_element  # codes a stored element holds, along the input dim

    def cut(name: str, t: torch.Tensor) -> torch.Tensor:
        if name == "weight_global_scale" and dim >= rank - 2:
            return t
        if dim == rank - 1:
            if name == "weight_scale":
                if q.group_size is None:
                    return t
                pieces = [t.narrow(dim, s // q.group_size, -(-e // q.group_size) - s // q.group_size) for s, e in spans]
            elif name == "weight_packed":
                pieces = [t.narrow(dim, s // per, (e - s) // per) for s, e in spans]
            else:
                pieces = [t.narrow(dim, s, e - s) for s, e in spans]
        else:
            pieces = [t.narrow(dim, s, e - s) for s, e in spans]
        return (pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)).clone()

    shape = list(q.shape)
    shape[dim] = sum(e - s for s, e in spans)
    parts = {k: cut(k, v) for k, v in q.parts.items() if k != "weight_shape"}
    if "weight_shape" in q.parts:
        parts["weight_shape"] = torch.tensor(shape[-2:], dtype=torch.int32)
    return QTensor(q.scheme, tuple(shape), parts, q.group_size)
