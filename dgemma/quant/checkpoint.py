"""Quantised checkpoints in the compressed-tensors format: `dgemma quantize` writes them, dgemma,
vLLM and the `compressed_tensors` library read them; NVIDIA ModelOpt's NVFP4 is read as well.

A module's quantised weight is stored as its parts under `<module>.<part>` (formats.py names and
lays them out as compressed-tensors does) and config.json gains a `quantization_config` block,
the one `compressed_tensors.ModelCompressor.update_config` writes. What differs from dgemma's
in-memory layout, and why:

- Experts go to disk unfused, one 2D projection per expert
  (`layers.N.experts.{e}.{gate,up,down}_proj.<part>`), the names vLLM's Gemma 4 loader reads; they
  are fused back to [E, 2I, H] / [E, H, I] QTensors when read.
- int8 is stored pack-quantized (four int8 codes per int32 word), not int-quantized: the library
  picks pack-quantized for weight-only integers (`infer_module_format`) and vLLM runs int8
  weight-only only from that format. The codes and scales are dgemma's.
- nvfp4 shares one global scale between the projections vLLM fuses (q/k/v, the MLP's gate/up,
  each expert's gate/up): vLLM keeps one global scale for a fused matmul, as llm-compressor's
  writer assumes. Per-group scales are each projection's own.

Reading fuses an expert's gate and up exactly when their nvfp4 global scales agree (always for
dgemma's and llm-compressor's files). Where they differ (another writer), the fused weight takes
the smaller global scale (ModelOpt's larger `weight_scale_2`, as vLLM does) and the other
projection's fp8 group scales are multiplied by the ratio and rounded to fp8 once: exact when the
ratio is a power of two, else within half an fp8 step (2^-4 relative) of each group's scale.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from ..config import ConfigError
from ..model.weights import WeightsError, _weight_files, save_safetensors
from .formats import DEFAULT_GROUP_SIZE, NVFP4_GROUP, QTensor, QuantError, check_scheme, quantize
from .modules import LINEAR_TARGETS

log = logging.getLogger("dgemma")

COMPRESSION_VERSION = "0.20.1"  # the compressed-tensors release whose config.json block is written
QUANT_METHOD = "compressed-tensors"
DISK_FORMATS = {"fp8": "float-quantized", "int8": "pack-quantized", "int4": "pack-quantized", "nvfp4": "nvfp4-pack-quantized"}
EMBEDDING_FORMATS = {"fp8": "naive-quantized", "int8": "pack-quantized"}  # weight-only, as the library infers
CT_FORMATS = ("dense", "sparse-bitmask", "sparse-24-bitmask", "int-quantized", "float-quantized", "naive-quantized",
              "pack-quantized", "marlin-24", "mixed-precision", "nvfp4-pack-quantized", "mxfp4-pack-quantized",
              "mxfp6-pack-quantized", "mxfp8-quantized")  # fmt: skip
MODELOPT_ALGOS = {"NVFP4": "nvfp4", "W4A16_NVFP4": "nvfp4", "FP8": "fp8", "FP8_PER_CHANNEL_PER_TOKEN": "fp8"}
SHARD_BYTES = 5 * 10**9
DECODER = "model.decoder."
EMBEDDING = DECODER + "embed_tokens.weight"
FUSED_SIBLINGS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
SKIPPED_FILES = ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json", "hf_quant_config.json")
ROW_PARTS = ("weight", "weight_packed", "weight_scale")  # the parts with one row per output channel
LAYER_LINEAR = re.compile(r"model\.decoder\.layers\.(\d+)\.(.+)\.weight")
EXPERT = re.compile(r"layers\.(\d+)\.experts\.(\d+)\.(gate|up|down)_proj")
FUSED_EXPERT = re.compile(r"layers\.(\d+)\.experts\.(gate_up_proj|down_proj)")
PRESETS = {  # config_groups given as {"PRESET": [targets]}: the presets dgemma can run
    "FP8": {"num_bits": 8, "type": "float", "strategy": "tensor"},
    "FP8_DYNAMIC": {"num_bits": 8, "type": "float", "strategy": "channel"},
    "W8A8": {"num_bits": 8, "type": "int", "strategy": "channel"},
    "INT8": {"num_bits": 8, "type": "int", "strategy": "channel"},
    "W4A16": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128},
    "W4AFP8": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128},
    "NVFP4A16": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16},
    "NVFP4": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16},
}


class QuantConfigError(QuantError, ConfigError):
    """A `quantization_config` dgemma cannot read or run (the message names the field)."""


class QuantPartsError(QuantError, WeightsError):
    """A quantised checkpoint's tensors are missing or do not fit its `quantization_config`."""


# ------------------------------------------------------------------------------ quantization_config
def weight_args(scheme: str, group_size: int | None = None) -> dict:
    """The `weights` QuantizationArgs of a scheme, as the library serialises them."""
    args = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "strategy": "channel", "dynamic": False}
    if scheme == "fp8":
        return dict(args, type="float")
    if scheme == "int4":
        return dict(args, num_bits=4, group_size=group_size or DEFAULT_GROUP_SIZE, strategy="group")
    if scheme == "nvfp4":
        return dict(args, num_bits=4, type="float", group_size=NVFP4_GROUP, strategy="tensor_group",
                    scale_dtype="torch.float8_e4m3fn")  # fmt: skip
    return args


def config_group(scheme: str, group_size: int | None, targets: list[str], fmt: str, activations: bool) -> dict:
    """One QuantizationScheme: FP8_DYNAMIC keeps its dynamic per-token fp8 activations; the others
    are weight-only (W8A16, W4A16, NVFP4A16): nothing here is calibrated, and NVFP4's W4A4 needs
    calibrated `input_global_scale`s."""
    inputs = None
    if activations and scheme == "fp8":
        inputs = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": "token", "dynamic": True}
    return {"targets": targets, "weights": weight_args(scheme, group_size), "input_activations": inputs,
            "output_activations": None, "format": fmt}  # fmt: skip


def quantization_config(
    scheme: str, group_size: int | None = None, ignore: Sequence[str] = (), embeddings: str | None = None
) -> dict:
    """config.json's `quantization_config` for a checkpoint `write_quantized` writes, key for key
    what `ModelCompressor.update_config` (compressed-tensors 0.20.1) writes."""
    group_size = check_group_size(scheme, group_size)
    groups = {"group_0": config_group(scheme, group_size, ["Linear"], DISK_FORMATS[scheme], activations=True)}
    if embeddings is not None:
        groups["group_1"] = config_group(embeddings, None, ["Embedding"], EMBEDDING_FORMATS[embeddings], activations=False)
    formats = {g["format"] for g in groups.values()}
    block = {
        "config_groups": groups,
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "global_compression_ratio": None,
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "moe_sparsity_config": None,
        "quant_method": QUANT_METHOD,
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": COMPRESSION_VERSION,
    }
    return json.loads(json.dumps(block, sort_keys=True))  # keys in the order the library's sort_keys leaves


# ------------------------------------------------------------------------------ disk parts <-> QTensor
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
    return {"weight_packed": pack_int8(q.parts["weight"]), "weight_scale": q.parts["weight_scale"], "weight_shape": shape}


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


# ------------------------------------------------------------------------------ writing
def natural_key(name: str) -> list:
    """Sort key putting layers.10 after layers.9."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


class ShardWriter:
    """safetensors shards of at most `max_bytes` each, written as they fill; `finish` names them
    model-0000k-of-0000n.safetensors with an index (or model.safetensors when one is enough)."""

    def __init__(self, out: Path, max_bytes: int = SHARD_BYTES):
        self.out, self.max_bytes = out, max_bytes
        self.tensors: dict[str, torch.Tensor] = {}
        self.size = self.total = 0
        self.shards: list[list[str]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.tensors and self.size + nbytes > self.max_bytes:
            self.flush()
        self.tensors[name] = tensor.contiguous()
        self.size += nbytes
        self.total += nbytes

    def flush(self) -> None:
        if self.tensors:
            save_safetensors(self.tensors, self.out / f"shard-{len(self.shards):05d}.tmp")
            self.shards.append(list(self.tensors))
            self.tensors, self.size = {}, 0

    def finish(self) -> list[Path]:
        self.flush()
        n = len(self.shards)
        if n == 1:
            (self.out / "shard-00000.tmp").rename(self.out / "model.safetensors")
            return [self.out / "model.safetensors"]
        weight_map, paths = {}, []
        for i, names in enumerate(self.shards):
            path = self.out / f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.out / f"shard-{i:05d}.tmp").rename(path)
            weight_map.update({name: path.name for name in names})
            paths.append(path)
        weight_map = dict(sorted(weight_map.items(), key=lambda kv: natural_key(kv[0])))
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return paths


class TensorReader:
    """Tensors of a checkpoint directory, read one at a time from their memory-mapped files."""

    def __init__(self, path: Path):
        self.files = _weight_files(path)
        self.handles: dict[Path, object] = {}

    def _handle(self, name: str):
        f = self.files[name]
        if f not in self.handles:
            try:
                self.handles[f] = safe_open(f, framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own error types
                raise WeightsError(f"cannot read {f}: {e}") from None
        return self.handles[f]

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def get_index(self, name: str, index: int) -> torch.Tensor:
        """tensor[index] of a tensor's leading dim, without reading the rest (one expert)."""
        return self._handle(name).get_slice(name)[index]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def close(self) -> None:
        self.handles.clear()


def _quantize_named(w: torch.Tensor, scheme: str, group_size: int | None, name: str, dtype: torch.dtype | None) -> QTensor:
    """quantize(), its error naming the tensor; int4's scales in the model dtype, as the library stores them."""
    try:
        return quantize(w, scheme, group_size, dtype or w.dtype)
    except QuantError as e:
        raise QuantError(f"{name}: {e}") from None


def is_linear_weight(name: str, shape: tuple[int, ...]) -> bool:
    """A kept tensor that is an nn.Linear's weight: 2D `*.weight`, not the embedding table."""
    return name.endswith(".weight") and len(shape) == 2 and not name.endswith("embed_tokens.weight")


def _plan_linears(names: list[str]) -> dict[str, list[str]]:
    """Each quantised linear weight -> the sibling weights quantised with it (itself first in its group)."""
    present, plan = set(names), {}
    for name in names:
        m = LAYER_LINEAR.fullmatch(name)
        if m is None or m.group(2) not in LINEAR_TARGETS or name in plan:
            continue
        prefix = f"{DECODER}layers.{m.group(1)}."
        group = next((g for g in FUSED_SIBLINGS if m.group(2) in g), (m.group(2),))
        members = [f"{prefix}{s}.weight" for s in group if f"{prefix}{s}.weight" in present]
        for member in members:
            plan[member] = members
    return plan


def check_group_size(scheme: str, group_size: int | None) -> int | None:
    """The group size a scheme quantises with: int4's (default DEFAULT_GROUP_SIZE), nvfp4's fixed 16, else None."""
    if scheme == "int4":
        group_size = group_size or DEFAULT_GROUP_SIZE
        check_scheme(scheme, group_size)
        return group_size
    check_scheme(scheme)
    if group_size is not None and not (scheme == "nvfp4" and group_size == NVFP4_GROUP):
        raise QuantError(f"a group size applies to int4 only (nvfp4's groups are {NVFP4_GROUP}); got {group_size} for {scheme}")
    return NVFP4_GROUP if scheme == "nvfp4" else None


def check_output_dir(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise QuantError(f"output directory {out} exists and is not empty")


def write_quantized(model_dir_in: str | Path, out_dir: str | Path, scheme: str, group_size: int | None = None, **options) -> Path:
    """Stream a full-precision checkpoint to `out_dir`, quantising attention, the dense MLP and the
    experts (one expert projection at a time); embeddings, routers, norms, scalars, the
    self-conditioning MLP and the vision tower stay as they are (cast to `dtype` if given).
    `quantize_embeddings` ("int8" or "fp8") quantises the tied embedding table per row too;
    `shard_bytes` bounds each output file (the options of `write_quantized_from`)."""
    src = Path(model_dir_in)
    if not (src / "config.json").is_file():
        raise QuantError(f"no config.json in {src}: not a checkpoint directory")
    config = json.loads((src / "config.json").read_text())
    if "quantization_config" in config:
        raise QuantError(f"{src} is already quantised (its config.json has a quantization_config)")
    return write_quantized_from(TensorReader(src), config, out_dir, scheme, group_size,
                                side_files=lambda out: copy_side_files(src, out), **options)  # fmt: skip


def write_quantized_from(
    reader: "TensorReader | RandomTensors",
    config: dict,
    out_dir: str | Path,
    scheme: str,
    group_size: int | None = None,
    *,
    dtype: torch.dtype | None = None,
    quantize_embeddings: str | None = None,
    shard_bytes: int = SHARD_BYTES,
    side_files=None,
) -> Path:
    """`write_quantized` from any source of full-precision tensors (a checkpoint's files, or random
    ones drawn on demand): config.json (`config`, gaining its quantization_config) and the shards;
    `side_files(out)` writes the rest (tokenizer, generation config)."""
    out = Path(out_dir)
    group_size = check_group_size(scheme, group_size)
    if quantize_embeddings not in (None, "int8", "fp8"):
        raise QuantError(f"embeddings can be quantised to int8 or fp8, not {quantize_embeddings!r}")
    check_output_dir(out)
    names = sorted(reader.files, key=natural_key)
    plan = _plan_linears(names)
    _check_input_sizes(reader, [n for n in names if n in plan or _is_experts(n)], scheme, group_size)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    shards = ShardWriter(out, shard_bytes)
    try:
        ignore = _write_tensors(reader, names, plan, shards, scheme, group_size, dtype, quantize_embeddings)
        config = dict(config, quantization_config=quantization_config(scheme, group_size, ignore + ["lm_head"], quantize_embeddings))
        if dtype is not None:
            config["dtype"] = str(dtype).removeprefix("torch.")
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if side_files is not None:
            side_files(out)
    except BaseException:  # leave no half-written checkpoint behind (the directory was new or empty)
        _remove_output(out, created)
        raise
    finally:
        reader.close()
    log.info("wrote %d shard(s), %.1f MB, to %s", len(shards.shards), shards.total / 1e6, out)
    return out


class RandomTensors:
    """A full-precision checkpoint that is not on disk: each tensor (each expert) is drawn when it
    is read, normal(0, std) for matrices and ones for vectors, the same for the same name and
    seed. `dgemma quantize --size real` streams the released model's size through the quantiser
    with it, without its ~52 GB of weights. The interface is TensorReader's."""

    def __init__(self, config, dtype: torch.dtype = torch.bfloat16, seed: int = 0, std: float = 0.02):
        from ..model.diffusion_gemma import DiffusionGemma
        from ..model.weights import checkpoint_name

        with torch.device("meta"):
            net = DiffusionGemma(config)
        tensors = list(net.named_parameters()) + list(net.named_buffers())
        self.shapes = {checkpoint_name(name): tuple(t.shape) for name, t in tensors}
        self.files = dict.fromkeys(self.shapes)  # the names, as TensorReader.files has them
        self.dtype, self.seed, self.std = dtype, seed, std

    def _draw(self, name: str, shape: tuple[int, ...], index: int | None = None) -> torch.Tensor:
        if len(self.shapes[name]) < 2:
            return torch.ones(shape, dtype=self.dtype)
        key = f"{self.seed}:{name}:{index}".encode()
        gen = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(key).digest()[:8], "little"))
        return (torch.randn(shape, generator=gen) * self.std).to(self.dtype)

    def get(self, name: str) -> torch.Tensor:
        return self._draw(name, self.shapes[name])

    def get_index(self, name: str, index: int) -> torch.Tensor:
        return self._draw(name, self.shapes[name][1:], index)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def close(self) -> None:
        pass


def _is_experts(name: str) -> bool:
    return name.startswith(DECODER + "layers.") and name.endswith(("experts.gate_up_proj", "experts.down_proj"))


def _check_input_sizes(reader: TensorReader, targets: list[str], scheme: str, group_size: int | None) -> None:
    """Fail before writing anything when a group does not divide some target's input size."""
    group = group_size if scheme == "int4" else NVFP4_GROUP if scheme == "nvfp4" else 1
    for name in targets:
        inputs = reader.shape(name)[-1]
        if inputs % group:
            raise QuantError(f"{name}: {scheme} needs the input size ({inputs}) to be a multiple of its group size {group}")


def _remove_output(out: Path, created: bool) -> None:
    if created:
        shutil.rmtree(out, ignore_errors=True)
        return
    for f in out.iterdir():
        shutil.rmtree(f) if f.is_dir() else f.unlink()


def _write_tensors(
    reader: TensorReader,
    names: list[str],
    plan: dict[str, list[str]],
    shards: ShardWriter,
    scheme: str,
    group_size: int | None,
    dtype: torch.dtype | None,
    quantize_embeddings: str | None,
) -> list[str]:
    """Every tensor of the checkpoint, quantised or kept, into the shards; returns the linears kept
    in full precision (quantization_config's ignore list)."""
    done: set[str] = set()
    ignore: list[str] = []
    for name in names:
        if name in done:
            continue
        if name in plan:
            members = plan[name]
            weights = [reader.get(m) for m in members]
            fused = _quantize_named(torch.cat(weights), scheme, group_size, name, dtype)
            for member, q in zip(members, split_rows(fused, [w.shape[0] for w in weights])):
                emit(shards, member.removesuffix(".weight"), q)
            done.update(members)
        elif _is_experts(name):
            _write_experts(reader, name, scheme, group_size, dtype, shards)
        elif name == EMBEDDING and quantize_embeddings:
            table = _quantize_named(reader.get(name), quantize_embeddings, None, name, dtype)
            emit(shards, name.removesuffix(".weight"), table)
        else:
            tensor = reader.get(name)
            if is_linear_weight(name, tuple(tensor.shape)):
                ignore.append(name.removesuffix(".weight"))
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(dtype)
            shards.add(name, tensor)
    shards.finish()
    return ignore


def emit(shards: ShardWriter, module: str, q: QTensor) -> None:
    for part, tensor in disk_parts(q).items():
        shards.add(f"{module}.{part}", tensor.clone())


def _write_experts(
    reader: TensorReader, name: str, scheme: str, group_size: int | None, dtype: torch.dtype | None, shards: ShardWriter
) -> None:
    """experts.gate_up_proj [E, 2I, H] -> experts.{e}.gate_proj / up_proj; down_proj -> experts.{e}.down_proj."""
    prefix = name.rsplit(".", 1)[0]
    shape = reader.shape(name)
    log.info("quantising %s (%d experts)", name, shape[0])
    for e in range(shape[0]):
        q = _quantize_named(reader.get_index(name, e), scheme, group_size, f"{name}[{e}]", dtype)
        if name.endswith("gate_up_proj"):
            gate, up = split_rows(q, [shape[1] // 2, shape[1] // 2])
            emit(shards, f"{prefix}.{e}.gate_proj", gate)
            emit(shards, f"{prefix}.{e}.up_proj", up)
        else:
            emit(shards, f"{prefix}.{e}.down_proj", split_rows(q, [shape[1]])[0])


def copy_side_files(src: Path, out: Path) -> None:
    """generation_config.json, tokenizer and processor files: every top-level file but weights and config."""
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name not in SKIPPED_FILES and not f.name.endswith(WEIGHT_FILES):
            shutil.copy2(f, out / f.name)


# ------------------------------------------------------------------------------ reading: the config
@dataclass(frozen=True)
class QuantGroup:
    """One config group: the dgemma scheme it runs as, and what it targets."""

    name: str
    scheme: str
    group_size: int | None
    targets: tuple[str, ...]
    format: str


@dataclass(frozen=True)
class QuantInfo:
    """What a quantised checkpoint's config says."""

    quant_method: str  # "compressed-tensors" or "modelopt"
    format: str  # a compressed-tensors format, or "modelopt"
    groups: tuple[QuantGroup, ...]
    ignore: tuple[str, ...] = ()
    version: str | None = None

    @property
    def scheme(self) -> str:
        schemes = {g.scheme for g in self.groups}
        return schemes.pop() if len(schemes) == 1 else "mixed"

    @property
    def group_size(self) -> int | None:
        sizes = {g.group_size for g in self.groups if g.scheme == self.scheme}
        return sizes.pop() if len(sizes) == 1 else None


def _bad(message: str) -> QuantConfigError:
    return QuantConfigError(f"quantization_config: {message}")


def scheme_of(weights: dict, fmt: str, group: str = "group") -> tuple[str, int | None]:
    """dgemma's scheme (and group size) for a config group's `weights` args in format `fmt`."""
    if not isinstance(weights, dict):
        raise _bad(f"{group} has no weights quantization (dgemma runs weight-quantised checkpoints)")
    bits, kind, group_size = weights.get("num_bits", 8), str(weights.get("type", "int")).lower(), weights.get("group_size")
    strategy = weights.get("strategy") or ("tensor" if group_size is None else "channel" if group_size == -1 else "group")
    what = f"{group}: {kind}{bits} weights, strategy {strategy}, format {fmt}"
    if not weights.get("symmetric", True):
        raise _bad(f"{what} are asymmetric (zero points); dgemma runs symmetric weights only")
    if weights.get("dynamic"):
        raise _bad(f"{what} are dynamic; dgemma needs static weight scales")
    if weights.get("actorder") in ("group", "dynamic"):
        raise _bad(f"{what} use actorder {weights['actorder']!r} (a g_idx permutation), which dgemma does not run")
    if kind == "float" and bits == 8 and strategy in ("channel", "tensor") and fmt in ("float-quantized", "naive-quantized"):
        return "fp8", None
    if kind == "int" and bits == 8 and strategy in ("channel", "tensor") and fmt in ("int-quantized", "naive-quantized",
                                                                                   "pack-quantized"):  # fmt: skip
        return "int8", None
    if kind == "int" and bits == 4 and fmt == "pack-quantized" and strategy in ("group", "channel"):
        if strategy == "group" and (not isinstance(group_size, int) or group_size < 8 or group_size % 8):
            raise _bad(f"{what}: int4 group size must be a positive multiple of 8 (got {group_size})")
        return "int4", group_size if strategy == "group" else None
    nvfp4 = strategy == "tensor_group" and group_size == NVFP4_GROUP and fmt == "nvfp4-pack-quantized"
    if kind == "float" and bits == 4 and nvfp4:
        return "nvfp4", NVFP4_GROUP
    raise _bad(f"{what} cannot be run by dgemma (it runs fp8 and int8 per channel or tensor, int4 per group or "
               "channel, nvfp4 in groups of 16)")  # fmt: skip


def check_format(fmt: str, where: str = "") -> str:
    if fmt not in CT_FORMATS:
        raise _bad(f"unknown compressed-tensors format {fmt!r}{where}")
    if fmt in ("dense", "sparse-bitmask", "sparse-24-bitmask", "marlin-24") or fmt.startswith("mxfp"):
        raise _bad(f"format {fmt!r}{where} is not one dgemma reads (float-, int-, naive-, pack-, nvfp4-pack-quantized)")
    return fmt


def parse_compressed_tensors(qc: dict) -> QuantInfo:
    """Validate a compressed-tensors `quantization_config` and map its groups to dgemma schemes."""
    fmt = check_format(qc.get("format", "dense"))
    status = qc.get("quantization_status")
    if status != "compressed":
        raise _bad(f"quantization_status is {status!r}; dgemma reads compressed checkpoints ('compressed') only")
    for key in ("sparsity_config", "transform_config"):
        if qc.get(key):
            raise _bad(f"{key} is set; dgemma runs neither sparse nor transformed (rotated) weights")
    if qc.get("kv_cache_scheme"):
        log.warning("quantization_config: kv_cache_scheme ignored (dgemma keeps its KV cache in the model dtype)")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _bad("config_groups is missing or empty")
    out = []
    for name, g in groups.items():
        if isinstance(g, list):  # {"PRESET": [targets]}
            if name.upper() not in PRESETS:
                raise _bad(f"config group {name!r} is a preset dgemma does not know (it knows {', '.join(PRESETS)})")
            g = {"targets": g, "weights": PRESETS[name.upper()]}
        if not isinstance(g, dict) or not g.get("targets"):
            raise _bad(f"config group {name!r} has no targets")
        group_fmt = check_format(g.get("format") or fmt, f" in config group {name!r}")
        if group_fmt == "mixed-precision":
            raise _bad(f"config group {name!r} has no format of its own under a mixed-precision config")
        scheme, group_size = scheme_of(g.get("weights"), group_fmt, f"config group {name!r}")
        out.append(QuantGroup(name, scheme, group_size, tuple(g["targets"]), group_fmt))
    return QuantInfo(QUANT_METHOD, fmt, tuple(out), tuple(qc.get("ignore") or ()), qc.get("version"))


def parse_modelopt(qc: dict) -> QuantInfo:
    """ModelOpt's config: config.json's {"quant_method": "modelopt", "quant_algo": ...} or
    hf_quant_config.json's {"quantization": {"quant_algo": ..., "exclude_modules": [...]}}."""
    inner = qc.get("quantization") if isinstance(qc.get("quantization"), dict) else qc
    algo = str(inner.get("quant_algo") or "").upper()
    if not algo:
        raise _bad("ModelOpt config has no quant_algo")
    if algo not in MODELOPT_ALGOS:
        raise _bad(f"ModelOpt quant_algo {algo!r} is not one dgemma reads ({', '.join(MODELOPT_ALGOS)})")
    scheme = MODELOPT_ALGOS[algo]
    group_size = inner.get("group_size")
    if group_size is None:
        weights = [g.get("weights") or {} for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict)]
        group_size = next((w.get("group_size") for w in weights if w.get("group_size")), None)
    if scheme == "nvfp4" and group_size not in (None, NVFP4_GROUP):
        raise _bad(f"ModelOpt NVFP4 with group_size {group_size}; NVFP4 groups are {NVFP4_GROUP}")
    ignore = inner.get("exclude_modules", inner.get("ignore")) or ()
    group = QuantGroup("modelopt", scheme, NVFP4_GROUP if scheme == "nvfp4" else None, ("Linear",), "modelopt")
    return QuantInfo("modelopt", "modelopt", (group,), tuple(ignore), (qc.get("producer") or {}).get("version"))


def parse_quantization_config(qc: dict) -> QuantInfo:
    if not isinstance(qc, dict):
        raise _bad("is not a JSON object")
    method = str(qc.get("quant_method") or "").lower()
    if method == QUANT_METHOD:
        return parse_compressed_tensors(qc)
    if method.startswith("modelopt") or (not method and "quantization" in qc):
        return parse_modelopt(qc)
    raise _bad(f"unknown quant_method {qc.get('quant_method')!r} (dgemma reads compressed-tensors and modelopt)")


def load_quantization_config(path: Path) -> tuple[dict, dict]:
    """config.json, and its `quantization_config` (else ModelOpt's hf_quant_config.json)."""
    config_file, modelopt_file = path / "config.json", path / "hf_quant_config.json"
    if not config_file.is_file():
        raise QuantConfigError(f"no config.json in {path}")
    try:
        config = json.loads(config_file.read_text())
        qc = config.get("quantization_config")
        if qc is None and modelopt_file.is_file():
            qc = dict(json.loads(modelopt_file.read_text()), quant_method="modelopt")
    except json.JSONDecodeError as e:
        raise QuantConfigError(f"cannot parse the quantization config in {path}: {e}") from None
    if qc is None:
        raise QuantConfigError(f"{path} is not quantised: config.json has no quantization_config")
    return config, qc


# ------------------------------------------------------------------------------ reading: the tensors
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
    raise QuantPartsError(f"{module}.weight_scale has shape {tuple(scale.shape)}; expected one scale per output channel")


def _need_weight(parts: dict, module: str, name: str, group: QuantGroup) -> torch.Tensor:
    """The part holding the codes, with a clear error when the tensors are of another layout."""
    other = {"weight": "weight_packed", "weight_packed": "weight"}[name]
    if name not in parts and other in parts:
        raise QuantPartsError(f"{module} stores {other}, not the {name} its config group ({group.scheme}, format "
                              f"{group.format}) reads: the tensors do not fit the quantization_config")  # fmt: skip
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
    return QTensor(group.scheme, shape, {"weight": weight, "weight_scale": _channel_scale(parts["weight_scale"], shape, module)})


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
        raise QuantPartsError(f"{module}.weight_packed has {packed.shape[-1]} words a row; weight_shape says {shape[-1]} inputs")
    if group.scheme == "int8":
        parts = {"weight": unpack_int8(packed, shape[-1]), "weight_scale": _channel_scale(scale, shape, module)}
        return QTensor("int8", shape, parts)
    groups = scale.shape[-1]
    if shape[-1] % groups or shape[-1] % 8:
        raise QuantPartsError(f"{module}: {groups} scales per row do not divide its {shape[-1]} inputs into groups")
    if shape[-1] // groups != (group.group_size or shape[-1]):
        says = group.group_size or "per channel"
        raise QuantPartsError(f"{module} has groups of {shape[-1] // groups} inputs; its config group says {says}")
    parts = {"weight_packed": packed, "weight_scale": scale, "weight_shape": torch.tensor(shape[-2:], dtype=torch.int32)}
    return QTensor("int4", shape, parts, shape[-1] // groups)


QUANT_PARTS = ("weight_packed", "weight_scale", "weight_shape", "weight_global_scale", "weight_scale_2", "weight_zero_point",
               "weight_g_idx", "input_scale", "input_global_scale", "input_zero_point", "k_scale", "v_scale")  # fmt: skip


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
                self.experts.setdefault(int(expert.group(1)), {}).setdefault(int(expert.group(2)), {})[expert.group(3)] = entry
            else:
                self.single[rel if fused else rel + ".weight"] = entry
        self._check_experts(num_experts)
        self.names = list(self.single) + [f"layers.{n}.experts.{w}" for n in self.experts for w in ("gate_up_proj", "down_proj")]
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
                    raise QuantPartsError(f"missing tensors of {DECODER}layers.{layer}.experts.{e}.{missing[0]}_proj "
                                          f"(every expert needs quantised gate, up and down projections)")  # fmt: skip

    def _read(self, entry: Entry) -> QTensor:
        return to_qtensor({part: self.reader.get(disk) for part, disk in entry.parts.items()}, entry.group, entry.module)

    def _fuse(self, layer: int, which: str) -> QTensor:
        """One layer's per-expert projections as the fused [E, 2I, H] gate_up or [E, H, I] down."""
        per_expert = []
        for e, projs in sorted(self.experts[layer].items()):
            if which == "down_proj":
                per_expert.append(self._read(projs["down"]))
            else:
                gate, up = self._read(projs["gate"]), self._read(projs["up"])
                per_expert.append(concat_rows([gate, up], f"layers.{layer}.experts.{e}"))
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
