"""Checkpoint weights: safetensors in, safetensors out, tensor by tensor.

The model is built on the meta device and each tensor is read from its memory-mapped shard,
cast and moved to the target device on its own, so loading never holds a second copy of the
model in RAM. Names on disk are the `transformers` ones:

    model.decoder.{embed_tokens,layers.N.*,norm,self_conditioning.*}   the shared text stack
    model.encoder.language_model.layers.N.layer_scalar                 the encoder's own scalars
    model.encoder.vision_tower.*, model.encoder.embed_vision.*          the vision tower (`net.vision`), if present

There is no lm_head on disk (tied to embed_tokens). layout.py holds these names and the files'
layout, which quant/ shares.
"""

from __future__ import annotations

import json
import logging
from functools import partial
from pathlib import Path

import torch
from safetensors import safe_open

from ..config import ConfigError, ModelConfig
from ..quant.read import read_quantized
from .diffusion_gemma import DiffusionGemma
from .layout import SINGLE_FILE, VISION_PREFIXES, WeightsError, checkpoint_name, save_safetensors, weight_files

log = logging.getLogger("dgemma")

TIED_NAMES = ("lm_head.weight",)


# config.json's dtype names (`dtype` in transformers 5, `torch_dtype` before) and safetensors'
# header codes of the floating dtypes dgemma computes in
CONFIG_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HEADER_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
# quantisation parts (scales, zero points, packed codes): not the dtype of the unquantised parts
QUANT_PART_MARKERS = ("scale", "zero_point", "weight_packed", "weight_shape", "g_idx")


def config_dtype(raw: dict) -> torch.dtype | None:
    """The dtype config.json says the weights are stored in (`dtype`, or `torch_dtype`, at the
    top or in text_config), or None where it names none dgemma knows."""
    for part in (raw, raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}):
        for key in ("dtype", "torch_dtype"):
            value = part.get(key)
            if isinstance(value, str) and value.removeprefix("torch.") in CONFIG_DTYPES:
                return CONFIG_DTYPES[value.removeprefix("torch.")]
    return None


def header_dtype(path: Path) -> torch.dtype | None:
    """The floating dtype most of the checkpoint's tensors are stored in (by count), leaving out
    a quantised checkpoint's codes and scales; None if it holds no such tensor."""
    counts: dict[torch.dtype, int] = {}
    for file in sorted(set(weight_files(path).values())):
        try:
            with safe_open(file, framework="pt") as f:  # the header only: no tensor data is read
                stored = [
                    f.get_slice(name).get_dtype() for name in f.keys() if not any(m in name for m in QUANT_PART_MARKERS)
                ]
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for a bad file
            raise WeightsError(f"{file} is not a safetensors file: {e}") from None
        for code in stored:
            dtype = HEADER_DTYPES.get(code)
            if dtype is not None:
                counts[dtype] = counts.get(dtype, 0) + 1
    return max(counts, key=counts.get) if counts else None


def stored_dtype(path: str | Path) -> torch.dtype | None:
    """The dtype a checkpoint directory's weights are stored in: config.json's `dtype` /
    `torch_dtype`, else the safetensors headers' floating dtype (a quantised checkpoint: that
    of its unquantised parts: embeddings, norms, routers); None if neither says."""
    path = Path(path)
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        raw = None
    found = config_dtype(raw) if isinstance(raw, dict) else None
    if found is not None:
        return found
    try:
        return header_dtype(path)
    except (WeightsError, OSError):
        return None


def _set_tensor(model: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    if attr in module._parameters:
        module._parameters[attr] = torch.nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[attr] = value


def load_weights(
    config: ModelConfig,
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    quantization: str | None = None,
    group_size: int | None = None,
    shard=None,
) -> DiffusionGemma:
    """Build the model and fill it from the checkpoint at `path`. With `quantization` (a scheme of
    quant/formats.py), each text layer is quantised as soon as its tensors are read, so the
    full-precision model is never held in memory (one layer at most).

    `shard` (parallel/shard.py's `ShardedLoad`): load one rank's share of a tensor-parallel split.
    The meta model is cut to the rank's shapes first, then each tensor's slice is read from its
    file (`safe_open(...).get_slice(name)[...]`; a pre-quantised module is read and cut one at a
    time), so no rank ever holds the whole model."""
    path = Path(path)
    files = weight_files(path)
    # A config.json may describe a vision tower the weights leave out (text-only checkpoints,
    # dgemma-tiny among them): those run text only and refuse images.
    vision = config.vision is not None and any(n.startswith(VISION_PREFIXES) for n in files)
    with torch.device("meta"):
        model = DiffusionGemma(config, vision=vision)
    expected = dict(model.named_parameters())
    expected.update(model.named_buffers())

    stored = None  # a quantised checkpoint's weights (compressed-tensors or ModelOpt layouts)
    if isinstance(config.raw.get("quantization_config"), dict):
        if quantization is not None:
            raise WeightsError(f"{path} is already quantised: load it without a quantization scheme")
        info, stored = read_quantized(path)
    if quantization is not None:
        from ..quant.formats import DEFAULT_GROUP_SIZE, check_scheme
        from ..quant.modules import quantize_layer

        group_size = group_size or DEFAULT_GROUP_SIZE
        check_scheme(quantization, group_size)  # (a group size only a scheme that takes one checks)
    if shard is not None:  # (expected keeps the full model's names and shapes: what is on disk)
        model = shard.cut(model, (quantization, group_size) if quantization is not None else None, stored)
    pending_layer = None  # the layer whose tensors are being read, quantised once the next starts

    def finish_layer(index: int | None) -> None:
        if quantization is not None and index is not None:
            if shard is not None:
                shard.quantize_layer(model, index, quantization, group_size)
            else:
                quantize_layer(model.layers[index], quantization, group_size)

    fetch = None if stored is None else stored.__getitem__ if shard is None else partial(shard.read_quantized, stored)
    handles: dict[Path, object] = {}
    try:
        for name, meta in expected.items():
            layer = int(name.split(".")[1]) if name.startswith("layers.") else None
            if layer != pending_layer:
                finish_layer(pending_layer)
                pending_layer = layer
            target, cut = name, None
            if shard is not None:
                held = shard.held(name)
                if held is None:  # another rank holds all of it
                    continue
                target, cut = held
            if stored is not None and name in stored:
                _install_quantized(model, name, fetch, dtype, device, target)
                continue
            disk = checkpoint_name(name)
            if disk not in files:
                raise WeightsError(f"missing tensor {disk} in {path}")
            f = files[disk]
            if f not in handles:
                try:
                    handles[f] = safe_open(f, framework="pt", device="cpu")
                except Exception as e:
                    raise WeightsError(f"cannot read {f}: {e}") from None
            if cut is not None and not cut.whole:
                tensor = _read_cut(handles[f], disk, f, cut, tuple(meta.shape))
            else:
                try:
                    tensor = handles[f].get_tensor(disk)
                except Exception as e:
                    raise WeightsError(f"cannot read tensor {disk} from {f.name}: {e}") from None
                _check_shape(disk, tuple(tensor.shape), tuple(meta.shape))
            # Same dtype on CPU keeps the memory-mapped tensor as is, as transformers does: CPU
            # kernels choose code paths by alignment, so copying would change float32 rounding.
            _set_tensor(model, target, tensor.to(device=device, dtype=dtype))
            del tensor
        finish_layer(pending_layer)
    finally:
        handles.clear()
    if quantization is not None:
        model.quantization = (quantization, group_size)
    if stored is not None:
        model.quantization = (info.scheme, info.group_size)
        files = {n: f for n, f in files.items() if n not in stored.disk_names}
        stored.close()

    known = {checkpoint_name(n) for n in expected}
    extra = [n for n in files if n not in known and n not in TIED_NAMES]
    extra = [n for n in extra if not n.startswith("model.encoder.language_model.")]  # tied copies, if saved
    if extra:
        log.warning("ignored %d unexpected tensors, e.g. %s", len(extra), extra[0])
    model.eval()
    return model


def _check_shape(disk: str, shape: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if shape != expected:
        raise WeightsError(f"tensor {disk} has shape {shape}, expected {expected} from config.json")


def _read_cut(handle, disk: str, file: Path, cut, expected: tuple[int, ...]) -> torch.Tensor:
    """The spans of `cut` (parallel/shard.py's `Cut`) of tensor `disk`, read from its file alone and
    concatenated: the rest of the tensor is never read."""
    try:
        part = handle.get_slice(disk)
        _check_shape(disk, tuple(part.get_shape()), expected)
        pieces = [part[cut.index(span)] for span in cut.spans]
    except WeightsError:
        raise
    except Exception as e:
        raise WeightsError(f"cannot read tensor {disk} from {file.name}: {e}") from None
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, cut.dim)


def _install_quantized(
    model: DiffusionGemma, name: str, fetch, dtype: torch.dtype, device, target: str | None = None
) -> None:
    """Put a stored quantised weight (`fetch(name)`, a QTensor) in place of the full-precision
    parameter `name` (at `target` in a model cut to one rank's share)."""
    from ..quant.formats import dequantize
    from ..quant.modules import QuantExperts, QuantLinear

    module_name, _, attr = (target or name).rpartition(".")
    module = model.get_submodule(module_name)
    if isinstance(module, QuantExperts):
        return  # both expert weights were installed with the first
    if attr in ("gate_up_proj", "down_proj") and module_name.endswith(".experts"):
        parent_name, _, child = module_name.rpartition(".")
        stored_module = name.rpartition(".")[0]
        gate_up, down = fetch(f"{stored_module}.gate_up_proj"), fetch(f"{stored_module}.down_proj")
        model.get_submodule(parent_name)._modules[child] = QuantExperts(
            _on_device(gate_up, device), _on_device(down, device), module.approximate
        )
    elif isinstance(module, torch.nn.Linear) and attr == "weight" and name.startswith("layers."):
        parent_name, _, child = module_name.rpartition(".")
        model.get_submodule(parent_name)._modules[child] = QuantLinear(_on_device(fetch(name), device))
    else:  # e.g. quantised embeddings: dgemma computes with them in the model dtype
        _set_tensor(model, target or name, dequantize(fetch(name), dtype).to(device))


def _on_device(q, device):
    """The QTensor with its parts on `device`."""
    q.parts = {k: v.to(device) for k, v in q.parts.items()}
    return q


def state_dict_for_disk(model: DiffusionGemma) -> dict[str, torch.Tensor]:
    """The model's tensors under their checkpoint names (contiguous, on CPU)."""
    out = {}
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        out[checkpoint_name(name)] = tensor.detach().to("cpu").contiguous()
    return out


def save_weights(model: DiffusionGemma, path: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write model.safetensors in the checkpoint layout."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = state_dict_for_disk(model)
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    return save_safetensors(tensors, path / SINGLE_FILE)


__all__ = [
    "load_weights",
    "save_weights",
    "stored_dtype",
    "save_safetensors",
    "state_dict_for_disk",
    "WeightsError",
    "ConfigError",
    "checkpoint_name",
]
