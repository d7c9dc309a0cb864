"""config.json's `quantization_config` block: the one dgemma writes (key for key what
compressed-tensors' `ModelCompressor.update_config` writes) and the ones it reads (compressed-tensors
and NVIDIA ModelOpt configs, validated and mapped to dgemma's schemes, each refusal naming the field).

Its own module because both writing (quant/write.py) and reading (quant/read.py) need it, and it is
the one part of a quantised checkpoint that is not tensors.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..config import ConfigError
from . import schemes
from .formats import NVFP4_GROUP, QuantError, check_scheme

log = logging.getLogger("dgemma")

COMPRESSION_VERSION = "0.20.1"  # the compressed-tensors release whose config.json block is written
QUANT_METHOD = "compressed-tensors"
# the built-in schemes' formats, from the table (embeddings: weight-only, as the library infers)
DISK_FORMATS = {name: schemes.get(name).disk_format for name in schemes.BUILTIN}
EMBEDDING_FORMATS = {name: schemes.get(name).embedding_format for name in schemes.embedding_names()}
CT_FORMATS = (
    "dense",
    "sparse-bitmask",
    "sparse-24-bitmask",
    "int-quantized",
    "float-quantized",
    "naive-quantized",
    "pack-quantized",
    "marlin-24",
    "mixed-precision",
    "nvfp4-pack-quantized",
    "mxfp4-pack-quantized",
    "mxfp6-pack-quantized",
    "mxfp8-quantized",
)
MODELOPT_ALGOS = {"NVFP4": "nvfp4", "W4A16_NVFP4": "nvfp4", "FP8": "fp8", "FP8_PER_CHANNEL_PER_TOKEN": "fp8"}
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


# ------------------------------------------------------------------------------ quantization_config
def weight_args(scheme: str, group_size: int | None = None) -> dict:
    """The `weights` QuantizationArgs of a scheme, as the library serialises them (the table's)."""
    s = schemes.get(scheme)
    return {
        "num_bits": s.bits,
        "type": s.kind,
        "symmetric": True,
        "group_size": s.group.inputs(group_size),
        "strategy": s.strategy,
        "dynamic": False,
        **s.extra_args,
    }


def config_group(scheme: str, group_size: int | None, targets: list[str], fmt: str, activations: bool) -> dict:
    """One QuantizationScheme: FP8_DYNAMIC keeps its dynamic per-token fp8 activations; the others
    are weight-only (W8A16, W4A16, NVFP4A16): nothing here is calibrated, and NVFP4's W4A4 needs
    calibrated `input_global_scale`s."""
    inputs = schemes.get(scheme).activations if activations else None
    return {
        "targets": targets,
        "weights": weight_args(scheme, group_size),
        "input_activations": None if inputs is None else dict(inputs),
        "output_activations": None,
        "format": fmt,
    }


def quantization_config(
    scheme: str, group_size: int | None = None, ignore: Sequence[str] = (), embeddings: str | None = None
) -> dict:
    """config.json's `quantization_config` for a checkpoint `write_quantized` writes, key for key
    what `ModelCompressor.update_config` (compressed-tensors 0.20.1) writes."""
    group_size = check_group_size(scheme, group_size)
    fmt = schemes.get(scheme).disk_format
    groups = {"group_0": config_group(scheme, group_size, ["Linear"], fmt, activations=True)}
    if embeddings is not None:
        groups["group_1"] = config_group(
            embeddings, None, ["Embedding"], schemes.get(embeddings).embedding_format, activations=False
        )
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


def check_group_size(scheme: str, group_size: int | None) -> int | None:
    """The group size a scheme quantises with (its group rule): one the caller chooses (int4's,
    default 64), a fixed one (nvfp4's 16), else None (per channel)."""
    rule = schemes.get(scheme).group
    if rule.choosable:
        group_size = rule.chosen(group_size)
        check_scheme(scheme, group_size)
        return group_size
    if group_size is not None and group_size != rule.fixed:
        table = [schemes.get(name) for name in schemes.names()]
        choosable = " and ".join(s.name for s in table if s.group.choosable)
        fixed = ", ".join(f"{s.name}'s groups are {s.group.fixed}" for s in table if s.group.fixed is not None)
        raise QuantError(f"a group size applies to {choosable} only ({fixed}); got {group_size} for {scheme}")
    return rule.fixed


# ------------------------------------------------------------------------------ reading
def _bad(message: str) -> QuantConfigError:
    return QuantConfigError(f"quantization_config: {message}")


def scheme_of(weights: dict, fmt: str, group: str = "group") -> tuple[str, int | None]:
    """dgemma's scheme (and group size) for a config group's `weights` args in format `fmt`."""
    if not isinstance(weights, dict):
        raise _bad(f"{group} has no weights quantization (dgemma runs weight-quantised checkpoints)")
    bits, kind, group_size = (
        weights.get("num_bits", 8),
        str(weights.get("type", "int")).lower(),
        weights.get("group_size"),
    )
    strategy = weights.get("strategy") or (
        "tensor" if group_size is None else "channel" if group_size == -1 else "group"
    )
    what = f"{group}: {kind}{bits} weights, strategy {strategy}, format {fmt}"
    if not weights.get("symmetric", True):
        raise _bad(f"{what} are asymmetric (zero points); dgemma runs symmetric weights only")
    if weights.get("dynamic"):
        raise _bad(f"{what} are dynamic; dgemma needs static weight scales")
    if weights.get("actorder") in ("group", "dynamic"):
        raise _bad(f"{what} use actorder {weights['actorder']!r} (a g_idx permutation), which dgemma does not run")
    if (
        kind == "float"
        and bits == 8
        and strategy in ("channel", "tensor")
        and fmt in ("float-quantized", "naive-quantized")
    ):
        return "fp8", None
    if (
        kind == "int"
        and bits == 8
        and strategy in ("channel", "tensor")
        and fmt in ("int-quantized", "naive-quantized", "pack-quantized")
    ):
        return "int8", None
    if kind == "int" and bits == 4 and fmt == "pack-quantized" and strategy in ("group", "channel"):
        if strategy == "group" and (not isinstance(group_size, int) or group_size < 8 or group_size % 8):
            raise _bad(f"{what}: int4 group size must be a positive multiple of 8 (got {group_size})")
        return "int4", group_size if strategy == "group" else None
    nvfp4 = strategy == "tensor_group" and group_size == NVFP4_GROUP and fmt == "nvfp4-pack-quantized"
    if kind == "float" and bits == 4 and nvfp4:
        return "nvfp4", NVFP4_GROUP
    raise _bad(
        f"{what} cannot be run by dgemma (it runs fp8 and int8 per channel or tensor, int4 per group or "
        "channel, nvfp4 in groups of 16)"
    )


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
