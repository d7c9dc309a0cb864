"""The LoRA adapters one loaded model serves: read, checked, hashed, and kept in resident slots.

An adapter directory is read by train/lora.py's reader (PEFT's format: adapter_config.json and
adapter_model.safetensors; safetensors only, never a pickle), from a local directory or a hub id
(fetched into the Hugging Face cache; HF_HUB_OFFLINE=1 as huggingface_hub reads it). Before it takes
a slot it is checked against the base: the linears it targets (attention and dense MLP, in layers the
model has), their shapes, its rank (at most the bank's `max_rank`) and finite values; each refusal is
one line (`AdapterError`). Its content hash (the weights and their scale) starts its requests'
prefix-cache hash chains (engine/kv/block_manager.py), so blocks are shared only between requests
that run the same weights.

`read_adapter` does the slow part (files, checks, hash) and changes nothing, so a server runs it off
the engine's thread; `AdapterBank.install` then copies the weights into a free slot of the bank's
`LoraSlots` (kernels/lora.py), between two engine steps. The bank belongs to its `Model` (api.py).
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import ModelConfig
from ..engine.request import AdapterRef
from ..kernels.lora import SITES, LoraSlots, site_shapes
from ..train import lora as lora_files
from ..train.lora import AdapterError

DEFAULT_MAX_LORAS = 4
DEFAULT_MAX_RANK = 16
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}")


@dataclass(frozen=True)
class AdapterWeights:
    """An adapter read and checked against a base (`read_adapter`), not yet in a slot."""

    name: str
    source: str  # what it was loaded from: a directory, or a hub id
    rank: int
    scale: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(repr=False)  # linear -> (A [r, K], B [N, r])
    key: bytes = b""  # the content hash

    @property
    def targets(self) -> list[str]:
        return sorted(self.weights)


@dataclass(frozen=True)
class Adapter:
    """An adapter in a slot: what lists it (`/v1/models`) and what requests name it by."""

    name: str
    source: str
    rank: int
    slot: int
    key: bytes
    targets: tuple[str, ...]

    @property
    def ref(self) -> AdapterRef:
        return AdapterRef(self.name, self.slot, self.key)


def adapter_dtype(device: torch.device, compute: torch.dtype) -> torch.dtype:
    """The dtype adapter slots hold: the engine's activations' (`compute`) on every device. On a CPU the
    delta is then two GEMMs in that dtype, the second adding into the base's output in place (one
    rounding; float32 slots for bf16 activations measured ~3x the delta's time, in conversions); the
    Triton kernels multiply in float32 whatever they read."""
    return compute


def check_name(name: object) -> str:
    """An adapter's name: what requests send as their `model` (letters, digits and . _ : / @ + -)."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        shown = repr(name) if len(repr(name)) <= 60 else repr(name)[:57] + "..."
        raise AdapterError(
            f"adapter name {shown}: 1 to 128 letters, digits and . _ : / @ + - (starting with a letter or digit)"
        )
    return name


def adapter_directory(source: str | Path, lora_dir: str | Path | None = None) -> Path:
    """The local directory of an adapter: `source` itself (relative paths under `lora_dir` when
    given), or a hub id fetched into the cache. With `lora_dir`, only a directory inside it (after
    symlinks) is read, and no hub id."""
    text = str(source)
    if lora_dir is not None:
        root = Path(lora_dir).resolve()
        path = (root / text).resolve()  # an absolute `source` stays itself
        if path != root and root not in path.parents:
            raise AdapterError(f"adapter path {text} is outside the adapter directory --lora-dir ({root})")
        if not path.is_dir():
            raise AdapterError(f"no adapter directory {text} in {root}")
        return path
    path = Path(text).expanduser()
    if path.exists():
        if not path.is_dir():
            raise AdapterError(f"{path} is a file: an adapter is the directory holding {lora_files.ADAPTER_CONFIG}")
        return path
    from ..hub.resolve import is_hub_id

    if not is_hub_id(text):
        raise AdapterError(f"adapter directory {text} does not exist (nor is it a hub id owner/name)")
    return _fetch(text)


def _fetch(repo_id: str) -> Path:
    """An adapter repo's two files, fetched into (or found in) the Hugging Face cache."""
    from huggingface_hub import hf_hub_download

    from ..hub.errors import HubError, hub_errors

    try:
        for name in (lora_files.ADAPTER_CONFIG, lora_files.ADAPTER_WEIGHTS):
            with hub_errors(repo_id, what=name):
                found = hf_hub_download(repo_id, name)
    except HubError as e:
        raise AdapterError(f"adapter {repo_id}: {e}") from None
    return Path(found).parent


def _largest_file(config: ModelConfig, max_rank: int) -> int:
    """Bytes of the largest safetensors file a rank-`max_rank` adapter of this base can be (both
    stacks' copies, float32, every linear), with room for its header."""
    elements = sum(k + n for k, n in site_shapes(config).values()) * max_rank
    return 2 * 4 * elements + (1 << 20)


def read_adapter(
    name: str,
    source: str | Path,
    config: ModelConfig,
    max_rank: int | None = None,
    lora_dir: str | Path | None = None,
) -> AdapterWeights:
    """Read the adapter at `source` (a directory, or a hub id unless `lora_dir`) and check it
    against the base `config` and `max_rank`; AdapterError (one line) for anything that does not fit."""
    check_name(name)
    path = adapter_directory(source, lora_dir)
    weights_file = path / lora_files.ADAPTER_WEIGHTS
    for needed in (lora_files.ADAPTER_CONFIG, lora_files.ADAPTER_WEIGHTS):
        if not (path / needed).is_file():
            pickled = (
                " (dgemma reads safetensors only, never a pickled adapter_model.bin)" if needed.endswith("s") else ""
            )
            raise AdapterError(f"no LoRA adapter in {path}: {needed} is missing{pickled}")
    if (
        max_rank is not None
        and weights_file.is_file()
        and weights_file.stat().st_size > _largest_file(config, max_rank)
    ):
        raise AdapterError(
            f"{weights_file} is {weights_file.stat().st_size} bytes, more than any rank-{max_rank} adapter of this model"
        )
    try:
        found = lora_files.read_adapters(path)
    except AdapterError:
        raise
    except Exception as e:  # noqa: BLE001 - safetensors' own error derives from Exception alone; OSError too
        first = " ".join(str(e).split())[:200] or type(e).__name__
        raise AdapterError(f"{weights_file} is not a readable safetensors file: {first}") from None
    if max_rank is not None and found.rank > max_rank:
        raise AdapterError(
            f"{path}: rank {found.rank} is above the largest rank served here ({max_rank}, --max-lora-rank)"
        )
    shapes = site_shapes(config)
    weights = {}
    for target in found.names:
        if target not in shapes:
            layer, _, module = target.partition(".")[2].partition(".")
            why = (
                f"layer {layer}, which the model does not have ({config.num_layers} layers)"
                if module in SITES and int(layer) >= config.num_layers
                else "which is not an attention projection or dense-MLP linear the model has (served adapters "
                "target q/k/v/o_proj and mlp.gate/up/down_proj; global layers have no v_proj)"
            )
            raise AdapterError(f"{path}: the adapter targets {target}, {why}")
        a = found.tensors[f"{target}.lora_A.weight"]
        b = found.tensors[f"{target}.lora_B.weight"]
        k, n = shapes[target]
        if tuple(a.shape) != (found.rank, k) or tuple(b.shape) != (n, found.rank):
            raise AdapterError(
                f"{path}: {target} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; this base needs "
                f"({found.rank}, {k}) and ({n}, {found.rank}) for rank {found.rank}"
            )
        if not a.is_floating_point() or not b.is_floating_point():
            raise AdapterError(f"{path}: {target}'s matrices are {a.dtype} / {b.dtype}, not floating point")
        a, b = a.float(), b.float()
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterError(f"{path}: {target} holds values that are not finite (NaN or infinity)")
        weights[target] = (a, b)
    if not math.isfinite(found.scale):
        raise AdapterError(f"{path}: lora_alpha / r is not a finite number")
    return AdapterWeights(name, str(source), found.rank, found.scale, weights, content_key(found.scale, weights))


def content_key(scale: float, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> bytes:
    """The hash of what an adapter computes: its linears' names, A, B (float32) and scale."""
    h = hashlib.blake2b(b"dgemma-lora", digest_size=16)
    h.update(repr(float(scale)).encode())
    for name in sorted(weights):
        a, b = weights[name]
        h.update(name.encode() + b"\0")
        h.update(a.float().contiguous().numpy().tobytes())
        h.update(b.float().contiguous().numpy().tobytes())
    return h.digest()


class AdapterBank:
    """The adapters resident for one base: `max_loras` slots of rank up to `max_rank` (kernels/lora.py's
    `LoraSlots`, in the engine network's `dtype` on `device`), by name. Thread-safe: a server lists
    and resolves names on its HTTP side while its engine thread installs and removes."""

    def __init__(
        self,
        config: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
        max_loras: int = DEFAULT_MAX_LORAS,
        max_rank: int = DEFAULT_MAX_RANK,
    ):
        if not isinstance(max_loras, int) or not isinstance(max_rank, int) or max_loras < 1 or max_rank < 1:
            raise ValueError(f"--max-loras and --max-lora-rank must be >= 1 (got {max_loras}, {max_rank})")
        self.config, self.max_loras, self.max_rank = config, max_loras, max_rank
        self.slots = LoraSlots(site_shapes(config), max_loras, max_rank, device, dtype)
        self._adapters: dict[str, Adapter] = {}
        self._lock = threading.Lock()

    def read(self, name: str, source: str | Path, lora_dir: str | Path | None = None) -> AdapterWeights:
        """`read_adapter` against this bank's base and rank (changes nothing: any thread)."""
        return read_adapter(name, source, self.config, self.max_rank, lora_dir)

    def install(self, adapter: AdapterWeights) -> Adapter:
        """Put a read adapter into a free slot (run between engine steps: the slot's memory is the
        engine's). AdapterError when its name is taken or every slot is."""
        with self._lock:
            if adapter.name in self._adapters:
                raise AdapterError(f"an adapter named {adapter.name!r} is loaded already (unload it first)")
            if adapter.rank > self.max_rank:
                raise AdapterError(f"adapter {adapter.name!r} has rank {adapter.rank}, above {self.max_rank}")
            slot = self.slots.free_slot()
            if slot is None:
                raise AdapterError(
                    f"all {self.max_loras} adapter slots are taken (--max-loras {self.max_loras}): unload one first"
                )
            self.slots.write(slot, adapter.weights, adapter.rank, adapter.scale)
            entry = Adapter(adapter.name, adapter.source, adapter.rank, slot, adapter.key, tuple(adapter.targets))
            self._adapters[adapter.name] = entry
            return entry

    def load(self, name: str, source: str | Path, lora_dir: str | Path | None = None) -> Adapter:
        """Read and install (one thread: the caller's)."""
        return self.install(self.read(name, source, lora_dir))

    def remove(self, name: str) -> Adapter:
        """Empty the adapter's slot (its requests must have ended: the caller waits for them)."""
        with self._lock:
            entry = self._adapters.pop(name, None)
            if entry is None:
                raise AdapterError(f"no adapter named {name!r} is loaded")
            self.slots.clear(entry.slot)
            return entry

    def get(self, name: str) -> Adapter | None:
        with self._lock:
            return self._adapters.get(name)

    def shares_key(self, key: bytes) -> bool:
        """Whether a loaded adapter computes with these weights (its prefix blocks stay useful)."""
        with self._lock:
            return any(a.key == key for a in self._adapters.values())

    @property
    def adapters(self) -> list[Adapter]:
        """The loaded adapters, in slot order."""
        with self._lock:
            return sorted(self._adapters.values(), key=lambda a: a.slot)

    @property
    def names(self) -> list[str]:
        return [a.name for a in self.adapters]


def parse_lora_flag(text: str) -> tuple[str, str]:
    """`NAME=PATH_OR_HUB_ID` (`dgemma serve --lora`); a bare path is named by its directory."""
    name, sep, source = text.partition("=")
    if not sep:
        source = text
        name = Path(os.path.abspath(os.path.expanduser(text))).name
    if not source:
        raise AdapterError(f"--lora {text!r}: give NAME=PATH (a directory or a hub id owner/name)")
    return check_name(name), source
