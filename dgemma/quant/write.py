"""`dgemma quantize`'s writer: a full-precision checkpoint streamed to a quantised one in the
compressed-tensors format, which dgemma, vLLM and the `compressed_tensors` library read.

A module's quantised weight is stored as its parts under `<module>.<part>` (formats.py names and
lays them out as compressed-tensors does; pack.py packs them) and config.json gains a
`quantization_config` block (quant_config.py). What differs from dgemma's in-memory layout, and why:

- Experts go to disk unfused, one 2D projection per expert
  (`layers.N.experts.{e}.{gate,up,down}_proj.<part>`), the names vLLM's Gemma 4 loader reads; they
  are fused back to [E, 2I, H] / [E, H, I] QTensors when read (read.py).
- int8 is stored pack-quantized (four int8 codes per int32 word), not int-quantized: the library
  picks pack-quantized for weight-only integers (`infer_module_format`) and vLLM runs int8
  weight-only only from that format. The codes and scales are dgemma's.
- nvfp4 shares one global scale between the projections vLLM fuses (q/k/v, the MLP's gate/up,
  each expert's gate/up): vLLM keeps one global scale for a fused matmul, as llm-compressor's
  writer assumes. Per-group scales are each projection's own.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from ..model.layout import DECODER, INDEX_FILE, SINGLE_FILE, natural_key, save_safetensors
from . import schemes
from .formats import QTensor, QuantError, quantize
from .modules import LINEAR_TARGETS
from .pack import disk_parts, split_rows
from .quant_config import check_group_size, quantization_config
from .tensor_sources import RandomTensors, TensorReader

log = logging.getLogger("dgemma")

SHARD_BYTES = 5 * 10**9
EMBEDDING = DECODER + "embed_tokens.weight"
FUSED_SIBLINGS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
SKIPPED_FILES = ("config.json", INDEX_FILE, "pytorch_model.bin.index.json", "hf_quant_config.json")
LAYER_LINEAR = re.compile(r"model\.decoder\.layers\.(\d+)\.(.+)\.weight")


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
            (self.out / "shard-00000.tmp").rename(self.out / SINGLE_FILE)
            return [self.out / SINGLE_FILE]
        weight_map, paths = {}, []
        for i, names in enumerate(self.shards):
            path = self.out / f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.out / f"shard-{i:05d}.tmp").rename(path)
            weight_map.update({name: path.name for name in names})
            paths.append(path)
        weight_map = dict(sorted(weight_map.items(), key=lambda kv: natural_key(kv[0])))
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        (self.out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return paths


def _quantize_named(
    w: torch.Tensor, scheme: str, group_size: int | None, name: str, dtype: torch.dtype | None
) -> QTensor:
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


def check_output_dir(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise QuantError(f"output directory {out} exists and is not empty")


def write_quantized(
    model_dir_in: str | Path, out_dir: str | Path, scheme: str, group_size: int | None = None, **options
) -> Path:
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
    return write_quantized_from(
        TensorReader(src),
        config,
        out_dir,
        scheme,
        group_size,
        side_files=lambda out: copy_side_files(src, out),
        **options,
    )


def write_quantized_from(
    reader: TensorReader | RandomTensors,
    config: dict,
    out_dir: str | Path,
    scheme: str,
    group_size: int | None = None,
    *,
    dtype: torch.dtype | None = None,
    quantize_embeddings: str | None = None,
    shard_bytes: int = SHARD_BYTES,
    side_files=None,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """`write_quantized` from any source of full-precision tensors (a checkpoint's files, or random
    ones drawn on demand): config.json (`config`, gaining its quantization_config) and the shards;
    `side_files(out)` writes the rest (tokenizer, generation config); `progress(done, total)` is
    called as the tensors are written (the CLI's progress line)."""
    out = Path(out_dir)
    group_size = check_group_size(scheme, group_size)
    if quantize_embeddings is not None and quantize_embeddings not in schemes.embedding_names():
        choices = " or ".join(schemes.embedding_names())
        raise QuantError(f"embeddings can be quantised to {choices}, not {quantize_embeddings!r}")
    check_output_dir(out)
    names = sorted(reader.files, key=natural_key)
    plan = _plan_linears(names)
    _check_input_sizes(reader, [n for n in names if n in plan or _is_experts(n)], scheme, group_size)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    shards = ShardWriter(out, shard_bytes)
    try:
        ignore = _write_tensors(reader, names, plan, shards, scheme, group_size, dtype, quantize_embeddings, progress)
        config = dict(
            config,
            quantization_config=quantization_config(scheme, group_size, ignore + ["lm_head"], quantize_embeddings),
        )
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


def _is_experts(name: str) -> bool:
    return name.startswith(DECODER + "layers.") and name.endswith(("experts.gate_up_proj", "experts.down_proj"))


def _check_input_sizes(reader: TensorReader, targets: list[str], scheme: str, group_size: int | None) -> None:
    """Fail before writing anything when a group (`check_group_size`'s: None per channel) does
    not divide some target's input size."""
    group = group_size or 1
    for name in targets:
        inputs = reader.shape(name)[-1]
        if inputs % group:
            raise QuantError(
                f"{name}: {scheme} needs the input size ({inputs}) to be a multiple of its group size {group}"
            )


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
    progress: Callable[[int, int], None] | None = None,
) -> list[str]:
    """Every tensor of the checkpoint, quantised or kept, into the shards; returns the linears kept
    in full precision (quantization_config's ignore list)."""
    done: set[str] = set()
    ignore: list[str] = []
    for count, name in enumerate(names):
        if progress is not None:
            progress(count, len(names))
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
    if progress is not None:
        progress(len(names), len(names))
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
