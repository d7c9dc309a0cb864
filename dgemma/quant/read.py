"""Reading a quantised checkpoint: its validated config and its quantised weights by dgemma
parameter name, from dgemma's own files, compressed-tensors' (vLLM-style per-expert or fused
experts) and NVIDIA ModelOpt's NVFP4 / FP8.

Reading fuses an expert's gate and up exactly when their nvfp4 global scales agree (always for
dgemma's and llm-compressor's files); where they differ, pack.py's `common_global_scale` brings
them to one (exact for power-of-two ratios, else within half an fp8 step).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ..model.layout import DECODER, natural_key
from .formats import NVFP4_GROUP, QTensor
from .pack import QuantPartsError, concat_rows, cut_qtensor, stack_experts, unpack_int8
from .quant_config import QUANT_METHOD, QuantGroup, QuantInfo, load_quantization_config, parse_quantization_config
from .tensor_sources import TensorReader

EXPERT = re.compile(r"layers\.(\d+)\.experts\.(\d+)\.(gate|up|down)_proj")
FUSED_EXPERT = re.compile(r"layers\.(\d+)\.experts\.(gate_up_proj|down_proj)")


def _match(name: str, target: str) -> bool:
    """compressed-tensors' match_name: 're:' + a regex matched at the start, else the exact name."""
    return re.match(target[3:], name) is not None if target.startswith("re:") else target == name


def module_class(name: str) -> str:
    return "Embedding" if name.endswith("embed_tokens") else "Linear"


def group_for(module: str, info: QuantInfo) -> QuantGroup:
    """The config group whose targets take `module`: a name or regex target before a class one."""
    by_name = [g for g in info.groups if any(_match(module, t) for t in g.targets)]
    by_class = [g for g in info.groups if module_class(module) in g.targets]
    if not by_name and not by_class:
        raise QuantPartsError(f"{module} is stored quantised but no config group targets it")
    return (by_name or by_class)[0]


def _need(parts: dict, module: str, *names: str) -> None:
    missing = [n for n in names if n not in parts]
    if missing:
        raise QuantPartsError(f"missing tensor {module}.{missing[0]} (a quantised module's part)")


def _expect_dtype(parts: dict, module: str, part: str, dtype: torch.dtype, scheme: str) -> None:
    if parts[part].dtype != dtype:
        raise QuantPartsError(f"{module}.{part} has dtype {parts[part].dtype}, expected {dtype} for {scheme}")


def _channel_scale(scale: torch.Tensor, shape: tuple[int, ...], module: str) -> torch.Tensor:
    """A per-tensor [1] / [] or per-channel [out] / [out, 1] scale as dgemma's [..., out, 1] (dtype as stored)."""
    if scale.numel() == 1:
        return scale.reshape(1).expand(*shape[:-1]).unsqueeze(-1).clone()
    if scale.numel() == shape[-2] * (1 if len(shape) == 2 else shape[0]):
        return scale.reshape(*shape[:-1], 1)
    raise QuantPartsError(
        f"{module}.weight_scale has shape {tuple(scale.shape)}; expected one scale per output channel"
    )


def _need_weight(parts: dict, module: str, name: str, group: QuantGroup) -> torch.Tensor:
    """The part holding the codes, with a clear error when the tensors are of another layout."""
    other = {"weight": "weight_packed", "weight_packed": "weight"}[name]
    if name not in parts and other in parts:
        raise QuantPartsError(
            f"{module} stores {other}, not the {name} its config group ({group.scheme}, format "
            f"{group.format}) reads: the tensors do not fit the quantization_config"
        )
    _need(parts, module, name)
    return parts[name]


def to_qtensor(parts: dict[str, torch.Tensor], group: QuantGroup, module: str) -> QTensor:
    """A module's tensors as stored (compressed-tensors or ModelOpt names) -> dgemma's QTensor."""
    if group.scheme == "nvfp4":
        return _nvfp4_qtensor(parts, group, module)
    if group.format == "pack-quantized":
        return _packed_qtensor(parts, group, module)
    weight = _need_weight(parts, module, "weight", group)
    _need(parts, module, "weight_scale")
    _expect_dtype(parts, module, "weight", torch.float8_e4m3fn if group.scheme == "fp8" else torch.int8, group.scheme)
    shape = tuple(weight.shape)
    return QTensor(
        group.scheme, shape, {"weight": weight, "weight_scale": _channel_scale(parts["weight_scale"], shape, module)}
    )


def _nvfp4_qtensor(parts: dict[str, torch.Tensor], group: QuantGroup, module: str) -> QTensor:
    modelopt = group.format == "modelopt"
    codes = _need_weight(parts, module, "weight" if modelopt else "weight_packed", group)
    _need(parts, module, "weight_scale", "weight_scale_2" if modelopt else "weight_global_scale")
    _expect_dtype(parts, module, "weight" if modelopt else "weight_packed", torch.uint8, "nvfp4")
    _expect_dtype(parts, module, "weight_scale", torch.float8_e4m3fn, "nvfp4")
    lead, scale = codes.shape[:-2], parts["weight_scale"]
    if modelopt:  # ModelOpt stores the global scale's reciprocal: w = e2m1 * weight_scale * weight_scale_2
        global_scale = 1.0 / parts["weight_scale_2"].float().reshape(*lead, 1)
    else:
        global_scale = parts["weight_global_scale"].float().reshape(*lead, 1)
    shape = (*codes.shape[:-1], codes.shape[-1] * 2)
    if tuple(scale.shape) != (*shape[:-1], shape[-1] // NVFP4_GROUP):
        want = (*shape[:-1], shape[-1] // NVFP4_GROUP)
        raise QuantPartsError(f"{module}.weight_scale has shape {tuple(scale.shape)}, expected {want}")
    parts = {"weight_packed": codes, "weight_scale": scale, "weight_global_scale": global_scale}
    return QTensor("nvfp4", shape, parts, NVFP4_GROUP)


def _packed_qtensor(parts: dict[str, torch.Tensor], group: QuantGroup, module: str) -> QTensor:
    """pack-quantized int8 (unpacked to dgemma's int8 `weight`) or int4 (kept packed)."""
    packed = _need_weight(parts, module, "weight_packed", group)
    _need(parts, module, "weight_scale", "weight_shape")
    _expect_dtype(parts, module, "weight_packed", torch.int32, group.scheme)
    scale = parts["weight_scale"]
    shape = (*packed.shape[:-1], int(parts["weight_shape"].reshape(-1)[-1]))
    per_word = 4 if group.scheme == "int8" else 8
    if packed.shape[-1] != -(-shape[-1] // per_word):
        raise QuantPartsError(
            f"{module}.weight_packed has {packed.shape[-1]} words a row; weight_shape says {shape[-1]} inputs"
        )
    if group.scheme == "int8":
        parts = {"weight": unpack_int8(packed, shape[-1]), "weight_scale": _channel_scale(scale, shape, module)}
        return QTensor("int8", shape, parts)
    groups = scale.shape[-1]
    if shape[-1] % groups or shape[-1] % 8:
        raise QuantPartsError(f"{module}: {groups} scales per row do not divide its {shape[-1]} inputs into groups")
    if shape[-1] // groups != (group.group_size or shape[-1]):
        says = group.group_size or "per channel"
        raise QuantPartsError(f"{module} has groups of {shape[-1] // groups} inputs; its config group says {says}")
    parts = {
        "weight_packed": packed,
        "weight_scale": scale,
        "weight_shape": torch.tensor(shape[-2:], dtype=torch.int32),
    }
    return QTensor("int4", shape, parts, shape[-1] // groups)


QUANT_PARTS = (
    "weight_packed",
    "weight_scale",
    "weight_shape",
    "weight_global_scale",
    "weight_scale_2",
    "weight_zero_point",
    "weight_g_idx",
    "input_scale",
    "input_global_scale",
    "input_zero_point",
    "k_scale",
    "v_scale",
)


def quantised_modules(names: list[str]) -> dict[str, dict[str, str]]:
    """Module -> {part: tensor name} for every module stored quantised (it has a weight_scale or a
    weight_packed); its `weight`, if any, is a part too."""
    parts: dict[str, dict[str, str]] = {}
    for name in names:
        module, _, part = name.rpartition(".")
        if part in QUANT_PARTS or part == "weight":
            parts.setdefault(module, {})[part] = name
    return {m: p for m, p in parts.items() if "weight_scale" in p or "weight_packed" in p}


@dataclass(frozen=True)
class Entry:
    """A quantised module on disk: its name, its parts' tensor names, its config group."""

    module: str
    parts: dict[str, str]
    group: QuantGroup


class QuantizedWeights(Mapping):
    """dgemma parameter name ('layers.0.self_attn.q_proj.weight', 'layers.0.experts.gate_up_proj',
    ...) -> its QTensor, read from disk when asked (per-expert projections fused then);
    `disk_names` are the tensors it covers, for the loader's unexpected-tensor check."""

    def __init__(self, path: Path, info: QuantInfo, num_experts: int | None = None):
        self.info, self.reader = info, TensorReader(path)
        self.single: dict[str, Entry] = {}  # dgemma name -> a module read as it is
        self.experts: dict[int, dict[int, dict[str, Entry]]] = {}  # layer -> expert -> gate/up/down
        for module, parts in quantised_modules(sorted(self.reader.files, key=natural_key)).items():
            if module.startswith("model.encoder.language_model."):
                continue  # tied copies of the decoder's weights
            entry = Entry(module, parts, self._group(module, parts))
            rel = module.removeprefix(DECODER)
            expert, fused = EXPERT.fullmatch(rel), FUSED_EXPERT.fullmatch(rel)
            if expert:
                self.experts.setdefault(int(expert.group(1)), {}).setdefault(int(expert.group(2)), {})[
                    expert.group(3)
                ] = entry
            else:
                self.single[rel if fused else rel + ".weight"] = entry
        self._check_experts(num_experts)
        self.names = list(self.single) + [
            f"layers.{n}.experts.{w}" for n in self.experts for w in ("gate_up_proj", "down_proj")
        ]
        if len(set(self.names)) != len(self.names):
            raise QuantPartsError("a layer's experts are stored both fused and per expert")
        entries = [*self.single.values(), *(p for ex in self.experts.values() for e in ex.values() for p in e.values())]
        self.disk_names = frozenset(n for entry in entries for n in entry.parts.values())

    def _group(self, module: str, parts: dict[str, str]) -> QuantGroup:
        if not module.startswith(DECODER):
            raise QuantPartsError(f"{module} is stored quantised; dgemma runs only the text stack quantised")
        if self.info.quant_method == QUANT_METHOD and any(_match(module, ign) for ign in self.info.ignore):
            raise QuantPartsError(f"{module} is stored quantised but quantization_config's ignore list names it")
        if "weight_zero_point" in parts or "weight_g_idx" in parts:
            raise QuantPartsError(f"{module} has zero points or a g_idx permutation, which dgemma does not run")
        return group_for(module, self.info)

    def _check_experts(self, num_experts: int | None) -> None:
        for layer, experts in self.experts.items():
            for e in range(num_experts or max(experts) + 1):
                missing = [p for p in ("gate", "up", "down") if p not in experts.get(e, {})]
                if missing:
                    raise QuantPartsError(
                        f"missing tensors of {DECODER}layers.{layer}.experts.{e}.{missing[0]}_proj "
                        f"(every expert needs quantised gate, up and down projections)"
                    )

    def _read(self, entry: Entry) -> QTensor:
        return to_qtensor(
            {part: self.reader.get(disk) for part, disk in entry.parts.items()}, entry.group, entry.module
        )

    def _fuse(self, layer: int, which: str, dim: int | None = None, spans: tuple[tuple[int, int], ...] = ()) -> QTensor:
        """One layer's per-expert projections as the fused [E, 2I, H] gate_up or [E, H, I] down;
        with `dim`, only the `spans` along it of the fused weight (`read`): the experts in them
        (dim 0), or each expert's rows or columns, cut as it is read."""
        per_expert = []
        for e, projs in sorted(self.experts[layer].items()):
            if dim == 0 and not any(s <= e < end for s, end in spans):
                continue
            if which == "down_proj":
                q = self._read(projs["down"])
            else:
                gate, up = self._read(projs["gate"]), self._read(projs["up"])
                q = concat_rows([gate, up], f"layers.{layer}.experts.{e}")
            per_expert.append(q if dim in (None, 0) else cut_qtensor(q, dim - 1, spans))
        fused = stack_experts(per_expert, f"layers.{layer}.experts")
        # The fused copy is what stays; unmap the files so the per-expert pages just read leave
        # the resident set now, not at the end of the load (the released model's experts would
        # otherwise count twice: 21.6 GB peak for int4, measured)
        del per_expert
        self.reader.close()
        return fused

    def __getitem__(self, name: str) -> QTensor:
        if name in self.single:
            # owned copies, then unmap: a tensor read from a memory-mapped file keeps the whole
            # mapping alive, and with it every page of the file read so far (the experts' too),
            # which held the released model at 20 GB resident instead of ~15 (measured)
            q = self._read(self.single[name])
            q = QTensor(q.scheme, q.shape, {k: v.clone() for k, v in q.parts.items()}, q.group_size)
            self.reader.close()
            return q
        fused = FUSED_EXPERT.fullmatch(name)
        if fused and int(fused.group(1)) in self.experts:
            return self._fuse(int(fused.group(1)), fused.group(2))
        raise KeyError(name)

    def read(self, name: str, dim: int, spans: tuple[tuple[int, int], ...]) -> QTensor:
        """What one rank of a tensor-parallel split holds of `self[name]` (parallel/shard.py): the
        spans [start, end) along `dim` of its full-precision weight ([out, in], or [E, out, in]
        for experts), concatenated. Read module by module (per-expert files: expert by expert) and
        cut at once, so no more than one of them is held whole."""
        fused = FUSED_EXPERT.fullmatch(name)
        if name not in self.single and fused and int(fused.group(1)) in self.experts:
            return self._fuse(int(fused.group(1)), fused.group(2), dim, spans)
        if name not in self.single:
            raise KeyError(name)
        q = cut_qtensor(self._read(self.single[name]), dim, spans)
        self.reader.close()
        return q

    def group(self, name: str) -> QuantGroup:
        """The config group `self[name]` is stored under (per-expert files: expert 0's projection)."""
        if name in self.single:
            return self.single[name].group
        fused = FUSED_EXPERT.fullmatch(name)
        projs = self.experts[int(fused.group(1))][0] if fused and int(fused.group(1)) in self.experts else None
        if projs is None:
            raise KeyError(name)
        return projs["down" if fused.group(2) == "down_proj" else "gate"].group

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def close(self) -> None:
        self.reader.close()


def read_quantized(path: str | Path) -> tuple[QuantInfo, QuantizedWeights]:
    """A quantised checkpoint's config (validated) and its quantised weights by dgemma parameter
    name: dgemma's own files, compressed-tensors' (vLLM-style per-expert or fused) and ModelOpt's."""
    path = Path(path)
    config, qc = load_quantization_config(path)
    info = parse_quantization_config(qc)
    return info, QuantizedWeights(path, info, (config.get("text_config") or {}).get("num_experts"))
