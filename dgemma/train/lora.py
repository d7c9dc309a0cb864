"""LoRA adapters, our own (peft depends on transformers, which dgemma never imports at run time).

An adapter is a child module `lora` of an `nn.Linear` (or of a quantised `QuantLinear`: QLoRA,
the base frozen in the packed format inference uses) plus a forward hook adding
`B(A(x)) * alpha / r`, so the base weight keeps its name and checkpoint mapping, and merging is
`W += alpha / r * B @ A`. B starts at zero: an adapted model starts as the base model. The
adapter's A and B are float32 whatever the base holds (its master weights), and it computes in
float32, its output cast to the base's.

Default targets are the attention projections and the dense MLP of every layer; everything
else, the router and the experts included, stays frozen (the published LoRA recipe).

On disk adapters are in PEFT's format, so PEFT, transformers and servers that read PEFT files load
them: `adapter_config.json` (peft_type LORA, r, lora_alpha, target_modules as one full-path regex)
and `adapter_model.safetensors` keyed `base_model.model.<transformers module path>.lora_A.weight`.
transformers' DiffusionGemmaForBlockDiffusion holds the text stack twice (`model.decoder` and
`model.encoder.language_model`, weights tied) and PEFT adapts each copy on its own, while dgemma
runs one stack for both passes: a file holds both key sets, equal, and one whose sets differ is
refused. Files in dgemma's older format (keys `layers.N.<module>.lora_A.weight`) still load.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from ..model.layout import natural_key, save_safetensors
from ..quant.modules import QuantLinear

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
TARGET_GROUPS = {
    "attention": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"),
    "mlp": ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
}
DEFAULT_TARGETS = ("attention", "mlp")
# The modules an adapter can wrap: full-precision linears and quantised ones (a frozen QLoRA base).
ADAPTABLE = (nn.Linear, QuantLinear)

# PEFT's names: its wrapper's prefix, then transformers' two copies of the text stack (decoder first).
PEFT_PREFIX = "base_model.model."
STACKS = ("model.decoder.", "model.encoder.language_model.")
_PEFT_KEY = re.compile(
    r"base_model\.model\.(model\.decoder\.|model\.encoder\.language_model\.)(layers\.\d+\..+)\.lora_([AB])\.weight"
)
_OWN_KEY = re.compile(r"(layers\.\d+\..+)\.lora_([AB])\.weight")
# What PEFT writes for a DiffusionGemma (AutoPeftModel reads it to pick the base class).
AUTO_MAPPING = {
    "base_model_class": "DiffusionGemmaForBlockDiffusion",
    "parent_library": "transformers.models.diffusion_gemma.modeling_diffusion_gemma",
}
# PEFT options that change what the tensors mean (or add tensors): plain LoRA only, so a file that
# sets one is refused rather than misread.
_UNSUPPORTED = (
    "use_dora",
    "use_qalora",
    "use_bdlora",
    "fan_in_fan_out",
    "lora_bias",
    "alora_invocation_tokens",
    "rank_pattern",
    "alpha_pattern",
    "modules_to_save",
    "target_parameters",
    "trainable_token_indices",
    "layer_replication",
    "arrow_config",
)
# Initialisations that rewrite the base weights: such an adapter is only right on the rewritten base.
_BASE_CHANGING_INIT = ("pissa", "olora", "corda", "loftq")


class AdapterError(ValueError):
    """An adapter file dgemma cannot read, or that does not fit the model (one line)."""


class LoRA(nn.Module):
    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float, generator: torch.Generator):
        super().__init__()
        self.scale = alpha / rank
        a = torch.empty(rank, in_features)
        bound = 1.0 / math.sqrt(in_features)  # the scale nn.Linear's default init gives
        a.uniform_(-bound, bound, generator=generator)
        self.A = nn.Parameter(a)
        self.B = nn.Parameter(torch.zeros(out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x.to(self.A.dtype), self.A), self.B) * self.scale

    def delta(self) -> torch.Tensor:
        """The weight update this adapter stands for: alpha / r * B @ A (float32)."""
        return (self.B.float() @ self.A.float()) * self.scale


def _add_lora(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
    return output + module.lora(inputs[0]).to(output.dtype)


def resolve_targets(targets: str | tuple[str, ...] | list[str] = DEFAULT_TARGETS) -> tuple[str, ...]:
    """Group names ("attention", "mlp") or module-name suffixes -> module-name suffixes."""
    if isinstance(targets, str):
        targets = tuple(t.strip() for t in targets.split(",") if t.strip())
    out: list[str] = []
    for t in targets:
        out += TARGET_GROUPS.get(t, (t,))
    return tuple(out)


def target_modules(net: nn.Module, targets: tuple[str, ...]) -> dict[str, nn.Module]:
    """The linears (full-precision or quantised) inside `net.layers` whose names end with one of
    `targets`. A target that matches none of them is refused in one line: a typo would otherwise
    train fewer adapters than asked for without a word."""
    linears = {name: m for name, m in net.named_modules() if isinstance(m, ADAPTABLE) and name.startswith("layers.")}
    found = {name: m for name, m in linears.items() if name.endswith(targets)}
    for target in targets:
        if target and not any(name.endswith(target) for name in found):
            if target == "experts" or target.endswith(".experts") or "experts." in target:
                raise ValueError(
                    f"LoRA target {target!r}: adapters on the routed experts are not supported yet; "
                    f"adapt {', '.join(DEFAULT_TARGETS)} (attention and the dense MLP)"
                )
            leaves = sorted({name.split(".", 2)[2] for name in linears}, key=natural_key)
            raise ValueError(
                f"LoRA target {target!r}: the model has no such linear layer "
                f"(groups: {', '.join(TARGET_GROUPS)}; modules: {', '.join(leaves)})"
            )
    if not found:
        raise ValueError(f"no Linear layer matches the LoRA targets {', '.join(targets)}")
    return found


def features(linear: nn.Module) -> tuple[int, int, torch.device]:
    """(in_features, out_features, device) of a full-precision or quantised linear."""
    if isinstance(linear, QuantLinear):
        return linear.in_features, linear.out_features, next(linear.buffers()).device
    return linear.in_features, linear.out_features, linear.weight.device


def apply_lora(
    net: nn.Module, rank: int, alpha: float | None = None, targets=DEFAULT_TARGETS, seed: int = 0
) -> list[str]:
    """Freeze `net` and attach rank-`rank` adapters to the target layers; returns their names."""
    if rank <= 0:
        raise ValueError(f"LoRA rank must be positive, got {rank}")
    alpha = float(alpha if alpha is not None else 2 * rank)
    chosen = target_modules(net, resolve_targets(targets))
    for p in net.parameters():
        p.requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    names = []
    for name, linear in chosen.items():
        if hasattr(linear, "lora"):
            raise ValueError(f"{name} already has a LoRA adapter")
        in_features, out_features, device = features(linear)
        linear.lora = LoRA(in_features, out_features, rank, alpha, gen).to(device)
        linear._lora_hook = linear.register_forward_hook(_add_lora)
        names.append(name)
    net.lora_config = {"r": rank, "lora_alpha": alpha, "target_modules": names}
    return names


def adapters(net: nn.Module) -> dict[str, LoRA]:
    return {name[: -len(".lora")]: m for name, m in net.named_modules() if isinstance(m, LoRA)}


def adapter_tensors(state_dict: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """Adapter tensors of a (full) state dict, renamed `<linear>.lora_A.weight` / `.lora_B.weight`
    (dgemma's module names; `write_adapters` turns them into PEFT's)."""
    out = {}
    for key, t in state_dict.items():
        if key.startswith(prefix) and (key.endswith(".lora.A") or key.endswith(".lora.B")):
            name, which = key[len(prefix) : -len(".lora.A")], key[-1]
            out[f"{name}.lora_{which}.weight"] = t.detach().float().cpu().contiguous()
    return out


def adapter_state_dict(net: nn.Module) -> dict[str, torch.Tensor]:
    return adapter_tensors(net.state_dict())


def layer_linears(net: nn.Module) -> list[str]:
    """Names of every linear (full-precision or quantised) inside `net.layers`: what
    `target_pattern` compares an adapter's layers with."""
    return [name for name, m in net.named_modules() if isinstance(m, ADAPTABLE) and name.startswith("layers.")]


# ------------------------------------------------------------------ PEFT's format


def target_pattern(names: list[str], linears: list[str] | None = None) -> str:
    """PEFT's `target_modules` for dgemma modules `names` (`layers.N.<module>`): one regex, which PEFT
    full-matches against transformers' module paths, over both stacks and nothing else (a list of
    suffixes would also match the vision tower's q_proj, mlp...). A module adapted in every layer of
    `linears` that has it reads `\\d+`; others name their layers."""
    chosen: dict[str, set[int]] = {}
    for name in names:
        _, layer, module = name.split(".", 2)
        chosen.setdefault(module, set()).add(int(layer))
    having: dict[str, set[int]] = {}
    for name in linears or ():
        _, layer, module = name.split(".", 2)
        having.setdefault(module, set()).add(int(layer))
    groups: dict[str, list[str]] = {}  # the layers' pattern -> the modules adapted there
    for module, layers in chosen.items():
        if layers == having.get(module):
            which = r"\d+"
        elif len(layers) == 1:
            which = str(next(iter(layers)))
        else:
            which = "(?:" + "|".join(str(n) for n in sorted(layers)) + ")"
        groups.setdefault(which, []).append(module)
    alternatives = [f"{which}\\.{_alternation(modules)}" for which, modules in groups.items()]
    body = alternatives[0] if len(alternatives) == 1 else "(?:" + "|".join(alternatives) + ")"
    return r"model\.(?:decoder|encoder\.language_model)\.layers\." + body


def _alternation(modules: list[str]) -> str:
    """`self_attn.q_proj`, `self_attn.k_proj`, `mlp.up_proj` -> `(?:self_attn\\.(?:q_proj|k_proj)|mlp\\.up_proj)`."""
    parents: dict[str, list[str]] = {}
    for module in modules:
        parent, _, leaf = module.rpartition(".")
        parents.setdefault(parent, []).append(re.escape(leaf))
    parts = []
    for parent, leaves in parents.items():
        leaf = leaves[0] if len(leaves) == 1 else "(?:" + "|".join(leaves) + ")"
        parts.append(f"{re.escape(parent)}\\.{leaf}" if parent else leaf)
    return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


def peft_config(
    names: list[str],
    rank: int,
    alpha: float,
    base_model: str | None = None,
    linears: list[str] | None = None,
    use_rslora: bool = False,
) -> dict:
    """adapter_config.json as PEFT 0.21 writes it for a plain LoRA (the fields its loader reads)."""
    return {
        "peft_type": "LORA",
        "task_type": None,
        "auto_mapping": AUTO_MAPPING,
        "base_model_name_or_path": base_model,
        "revision": None,
        "r": rank,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else float(alpha),
        "target_modules": target_pattern(names, linears),
        "exclude_modules": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": use_rslora,
        "use_dora": False,
        "lora_bias": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "rank_pattern": {},
        "alpha_pattern": {},
        "inference_mode": True,
    }


def peft_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """dgemma-named adapter tensors -> PEFT's keys, once for the decoder and once (equal copies:
    safetensors stores no shared tensors) for the encoder."""
    out = {}
    for stack in STACKS:
        for key, t in tensors.items():
            out[PEFT_PREFIX + stack + key] = t if stack == STACKS[0] else t.clone()
    return out


def base_model_name(path: str | Path) -> str:
    """What `base_model_name_or_path` says for a base at `path`: the hub id of a checkpoint in the
    hub's cache (`.../models--owner--name/snapshots/REV`, where `dgemma finetune` fetches a hub
    id to), else the absolute directory."""
    p = Path(path).resolve()
    if p.parent.name == "snapshots" and p.parent.parent.name.startswith("models--"):
        return p.parent.parent.name[len("models--") :].replace("--", "/", 1)
    return str(p)


def write_adapters(
    path: str | Path,
    tensors: dict[str, torch.Tensor],
    rank: int,
    alpha: float,
    base_model: str | None = None,
    linears: list[str] | None = None,
    use_rslora: bool = False,
) -> Path:
    """Write the adapters alone (a few MB) in PEFT's format: `tensors` in dgemma's names
    (`adapter_tensors`), `linears` the model's layer Linears (`layer_linears`, for a compact pattern)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    names = list(dict.fromkeys(key.rsplit(".lora_", 1)[0] for key in tensors))
    config = peft_config(names, rank, alpha, base_model, linears, use_rslora)
    (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    save_safetensors(peft_tensors(tensors), path / ADAPTER_WEIGHTS)
    return path


def save_adapters(net: nn.Module, path: str | Path, base_model: str | None = None) -> Path:
    """Write `net`'s adapters to `path` in PEFT's format."""
    cfg = net.lora_config
    return write_adapters(
        path,
        adapter_state_dict(net),
        cfg["r"],
        cfg["lora_alpha"],
        base_model,
        layer_linears(net),
        cfg.get("use_rslora", False),
    )


@dataclass
class AdapterFile:
    """An adapter read from disk, in dgemma's module names whichever format it came in."""

    rank: int
    alpha: float
    scale: float  # alpha / r, or alpha / sqrt(r) for PEFT's rsLoRA
    tensors: dict[str, torch.Tensor]  # `layers.N.<module>.lora_A.weight` / `.lora_B.weight`
    base_model: str | None
    use_rslora: bool = False

    @property
    def names(self) -> list[str]:
        """The adapted modules, in dgemma's names."""
        return sorted({key.rsplit(".lora_", 1)[0] for key in self.tensors}, key=natural_key)


def _check_peft_config(path: Path, cfg: dict) -> None:
    if cfg.get("peft_type") != "LORA":
        raise AdapterError(f"{path}: peft_type is {cfg.get('peft_type')!r}; dgemma reads LORA adapters only")
    for key in _UNSUPPORTED:
        if cfg.get(key):
            raise AdapterError(f"{path}: {ADAPTER_CONFIG} sets {key}={cfg[key]!r}; dgemma reads plain LoRA only")
    if cfg.get("bias", "none") != "none":
        raise AdapterError(f"{path}: {ADAPTER_CONFIG} sets bias={cfg['bias']!r}; dgemma reads plain LoRA only")
    init = cfg.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INIT):
        raise AdapterError(
            f"{path}: init_lora_weights={init!r} rewrote the base weights, so the adapter fits only that rewritten "
            "base; convert it to plain LoRA (PEFT's path_initial_model_for_weight_conversion) first"
        )


def _from_peft(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PEFT's keys -> dgemma's names; the decoder's and the encoder's sets must be equal."""
    stacks: dict[str, dict[str, torch.Tensor]] = {stack: {} for stack in STACKS}
    for key, t in tensors.items():
        m = _PEFT_KEY.fullmatch(key)
        if m is None:
            raise AdapterError(
                f"{path}: {key} is not a LoRA A or B matrix of a text layer; dgemma reads only "
                "base_model.model.model.{decoder,encoder.language_model}.layers.N.<module>.lora_{A,B}.weight"
            )
        stacks[m.group(1)][f"{m.group(2)}.lora_{m.group(3)}.weight"] = t
    decoder, encoder = stacks[STACKS[0]], stacks[STACKS[1]]
    for key in sorted(decoder.keys() | encoder.keys(), key=natural_key):
        if key not in encoder or key not in decoder:
            missing = STACKS[1] if key not in encoder else STACKS[0]
            present = STACKS[0] if key not in encoder else STACKS[1]
            why = f"{missing}{key} is missing"
            key_named = PEFT_PREFIX + present + key
        elif decoder[key].shape != encoder[key].shape or not torch.equal(decoder[key], encoder[key]):
            why, key_named = "the two copies differ", PEFT_PREFIX + STACKS[1] + key
        else:
            continue
        raise AdapterError(
            f"{path}: the encoder's and decoder's adapters are not equal at {key_named} ({why}); dgemma runs one "
            "text stack for both passes, so it needs PEFT's two copies equal (tie them while training)"
        )
    return decoder


def read_adapters(path: str | Path) -> AdapterFile:
    """Read an adapter directory in PEFT's format or dgemma's older one (its own key names)."""
    path = Path(path)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):  # (safetensors' own error names no file)
        if not (path / name).is_file():
            raise AdapterError(f"no LoRA adapter in {path}: {path / name} is missing")
    try:
        cfg = json.loads((path / ADAPTER_CONFIG).read_text())
        tensors = load_file(str(path / ADAPTER_WEIGHTS))
    except FileNotFoundError as e:
        raise AdapterError(f"no LoRA adapter in {path}: {e.filename} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterError(f"{path / ADAPTER_CONFIG} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict) or "r" not in cfg or "lora_alpha" not in cfg:
        raise AdapterError(f"{path / ADAPTER_CONFIG} has no r and lora_alpha")
    if not tensors:
        raise AdapterError(f"{path / ADAPTER_WEIGHTS} holds no tensors")
    rank, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    if rank <= 0:
        raise AdapterError(f"{path / ADAPTER_CONFIG}: r must be positive, got {rank}")
    use_rslora = False
    if "peft_type" in cfg:
        _check_peft_config(path, cfg)
        named = _from_peft(path, tensors)
        use_rslora = bool(cfg.get("use_rslora"))
        base_model = cfg.get("base_model_name_or_path")
    else:  # dgemma's format before it wrote PEFT's
        for key in tensors:
            if _OWN_KEY.fullmatch(key) is None:
                raise AdapterError(f"{path}: {key} is not a LoRA A or B matrix of a text layer")
        named, base_model = tensors, cfg.get("base_model")
    for name in {key.rsplit(".lora_", 1)[0] for key in named}:
        if f"{name}.lora_A.weight" not in named or f"{name}.lora_B.weight" not in named:
            raise AdapterError(f"{path}: {name} has only one of its lora_A and lora_B matrices")
    scale = alpha / math.sqrt(rank) if use_rslora else alpha / rank
    return AdapterFile(rank, alpha, scale, named, base_model, use_rslora)


def load_adapters(net: nn.Module, path: str | Path) -> list[str]:
    """Attach the adapters saved at `path` (PEFT's format or dgemma's older one) to `net`, or copy
    them into the adapters `net` already has; returns the adapted modules' names."""
    path = Path(path)
    adapter = read_adapters(path)
    names = adapter.names
    if not adapters(net):
        linears = set(layer_linears(net))
        for name in names:
            if name not in linears:
                raise AdapterError(f"{path}: the adapter targets {name}, which the model does not have as a Linear")
        apply_lora(net, adapter.rank, adapter.alpha, tuple(names))
    found = adapters(net)
    if sorted(found) != sorted(names):
        extra = sorted(set(names) ^ set(found), key=natural_key)[0]
        raise AdapterError(f"{path}: adapters do not match the model's LoRA layers (first difference: {extra})")
    with torch.no_grad():
        for name, m in found.items():
            a, b = adapter.tensors[f"{name}.lora_A.weight"], adapter.tensors[f"{name}.lora_B.weight"]
            if a.shape != m.A.shape or b.shape != m.B.shape:
                raise AdapterError(
                    f"{path}: adapter {name} has shapes {tuple(a.shape)} and {tuple(b.shape)}, "
                    f"the model needs {tuple(m.A.shape)} and {tuple(m.B.shape)}"
                )
            m.A.copy_(a)
            m.B.copy_(b)
            m.scale = adapter.scale
    net.lora_config = {
        "r": adapter.rank,
        "lora_alpha": adapter.alpha,
        "target_modules": names,
        "use_rslora": adapter.use_rslora,
    }
    return names


def check_adapter(adapter: AdapterFile, net: nn.Module, path: str | Path) -> None:
    """AdapterError (one line) unless every adapter of `adapter` wraps a linear `net` has, with
    A [r, in] and B [out, r] of its shapes: checked on the meta model before the base is read."""
    linears = {name: m for name, m in net.named_modules() if isinstance(m, ADAPTABLE) and name.startswith("layers.")}
    for name in adapter.names:
        linear = linears.get(name)
        if linear is None:
            raise AdapterError(f"{path}: the adapter targets {name}, which this base does not have as a linear layer")
        in_features, out_features, _ = features(linear)
        a, b = adapter.tensors[f"{name}.lora_A.weight"], adapter.tensors[f"{name}.lora_B.weight"]
        if tuple(a.shape) != (adapter.rank, in_features) or tuple(b.shape) != (out_features, adapter.rank):
            raise AdapterError(
                f"{path}: adapter {name} has shapes {tuple(a.shape)} and {tuple(b.shape)}, this base needs "
                f"{(adapter.rank, in_features)} and {(out_features, adapter.rank)} (an adapter of another model?)"
            )


def merged_state_dict(state_dict: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """A state dict with every `<linear>.lora.{A,B}` pair folded into `<linear>.weight` (new tensors)."""
    out = {k: v for k, v in state_dict.items() if not (k.endswith(".lora.A") or k.endswith(".lora.B"))}
    for key in [k for k in state_dict if k.endswith(".lora.A")]:
        name = key[: -len(".lora.A")]
        w = out[name + ".weight"]
        delta = state_dict[name + ".lora.B"].float() @ state_dict[key].float() * scale
        out[name + ".weight"] = (w.float() + delta).to(w.dtype)
    return out


@torch.no_grad()
def merge_lora(net: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight and remove it: a plain model again, savable as a checkpoint.
    A quantised base is refused: merging would have to dequantise, add and re-quantise each weight."""
    for name, linear in target_modules(net, ("",)).items():
        if not hasattr(linear, "lora"):
            continue
        if isinstance(linear, QuantLinear):
            raise AdapterError(
                f"{name} is quantised ({linear.scheme}): merging adapters onto a quantised base is not supported; "
                "merge with `dgemma merge-lora --quantization SCHEME`, which reads the full-precision base"
            )
        linear.weight.copy_((linear.weight.float() + linear.lora.delta()).to(linear.weight.dtype))
        linear._lora_hook.remove()
        del linear._lora_hook
        del linear.lora
    if hasattr(net, "lora_config"):
        del net.lora_config
    return net
