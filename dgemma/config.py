"""Model and generation configuration, read from a checkpoint directory.

Two `config.json` forms exist in the wild and both are accepted:
- the released one, where global layers are described by `global_head_dim` and
  `num_global_key_value_heads`;
- the one `transformers` 5.23 `save_pretrained` writes, with `per_layer_config`
  (layer index -> overrides).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("diffusion_gemma",)
SLIDING, GLOBAL = "sliding_attention", "full_attention"

GELU_APPROXIMATION = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}  # hidden_activation -> F.gelu's `approximate`


class ConfigError(ValueError):
    """A checkpoint's configuration is missing, corrupt or describes a model dgemma cannot run."""


@dataclass(frozen=True)
class LayerSpec:
    """What differs between layers: attention kind, head geometry and RoPE."""

    kind: str  # SLIDING or GLOBAL
    head_dim: int
    num_kv_heads: int
    rope_theta: float
    rope_type: str  # "default" or "proportional"
    partial_rotary_factor: float
    rope_factor: float

    @property
    def is_sliding(self) -> bool:
        return self.kind == SLIDING

    @property
    def has_v_proj(self) -> bool:
        # Global layers have no v_proj: V is the (unrotated, scale-free normed) key projection.
        return self.kind == SLIDING


@dataclass(frozen=True)
class VisionConfig:
    """The Gemma 4 vision tower (`vision_config`) and the prompt tokens that carry its soft tokens."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    patch_size: int
    pooling_kernel_size: int
    position_embedding_size: int
    rope_theta: float
    rms_norm_eps: float
    hidden_activation: str
    use_clipped_linears: bool
    standardize: bool
    output_dims: int  # soft-token width entering embed_vision (`output_proj_dims`, else hidden_size)
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int
    bidirectional: bool  # text_config.use_bidirectional_attention == "vision": image tokens see each other

    @property
    def gelu_approximate(self) -> str:
        return GELU_APPROXIMATION[self.hidden_activation]


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    layers: tuple[LayerSpec, ...]
    sliding_window: int
    num_experts: int
    top_k_experts: int
    moe_intermediate_size: int
    canvas_length: int = 256
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: float = 30.0
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 131072
    pad_token_id: int = 0
    bos_token_id: int = 2
    eos_token_ids: tuple[int, ...] = (1,)
    vision: VisionConfig | None = None
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def embed_scale(self) -> float:
        return self.hidden_size**0.5

    @property
    def gelu_approximate(self) -> str:
        """F.gelu's `approximate` for `hidden_activation`: "tanh" (the released model) or "none" (erf)."""
        return GELU_APPROXIMATION[self.hidden_activation]

    def num_parameters(self, active: bool = False) -> int:
        """Text-stack parameter count (embeddings counted once: they are tied)."""
        h, total = self.hidden_size, self.vocab_size * self.hidden_size
        for spec in self.layers:
            q = self.num_heads * spec.head_dim
            kv = spec.num_kv_heads * spec.head_dim
            attn = h * q + h * kv * (2 if spec.has_v_proj else 1) + q * h + 2 * spec.head_dim
            dense = 3 * h * self.intermediate_size
            experts = 3 * h * self.moe_intermediate_size * (self.top_k_experts if active else self.num_experts)
            router = h * self.num_experts + h + self.num_experts
            total += attn + dense + experts + router + 9 * h + 2
        total += 3 * h * self.intermediate_size + h  # self-conditioning MLP and its norm
        return total + h


@dataclass(frozen=True)
class TurboSettings:
    """The knobs of turbo denoising (engine/turbo.py); defaults chosen by measurement
    (docs/performance.md, "Turbo denoising")."""

    freeze_passes: int = 2  # passes in a row a position's argmax must be accepted unchanged
    freeze_entropy: float = 0.02  # nats at the pass's temperature, at most
    refresh_every: int = 0  # recompute every position's keys/values each this many passes (0: never)
    dormant_entropy: float = 1.5  # a noise position above this entropy is computed every other pass (0: every pass)

    def check(self) -> TurboSettings:
        """The settings, or a ValueError naming the knob."""
        if isinstance(self.freeze_passes, bool) or not isinstance(self.freeze_passes, int) or self.freeze_passes < 1:
            raise ValueError(f"turbo_freeze_passes must be an integer >= 1 (got {self.freeze_passes!r})")
        e = self.freeze_entropy
        if isinstance(e, bool) or not isinstance(e, (int, float)) or not 0 <= e < math.inf:
            raise ValueError(f"turbo_freeze_entropy must be a finite number >= 0 (got {e!r})")
        r = self.refresh_every
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ValueError(f"turbo_refresh_every must be an integer >= 0, 0 for never (got {r!r})")
        d = self.dormant_entropy
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d < math.inf:
            raise ValueError(f"turbo_dormant_entropy must be a finite number >= 0, 0 for never (got {d!r})")
        return self


@dataclass(frozen=True)
class GenerationConfig:
    """Sampler defaults. Absent or null fields take the reference's global defaults."""

    max_new_tokens: int = 256
    max_denoising_steps: int = 48
    entropy_bound: float = 0.1
    t_min: float = 0.4
    t_max: float = 0.8
    stability_threshold: int = 1
    confidence_threshold: float = 0.005
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    # turbo denoising (engine/turbo.py): off by default, and off it changes nothing
    turbo: bool = False
    turbo_freeze_passes: int = 2
    turbo_freeze_entropy: float = 0.02
    turbo_refresh_every: int = 0
    turbo_dormant_entropy: float = 1.5

    @property
    def turbo_settings(self) -> TurboSettings:
        return TurboSettings(
            self.turbo_freeze_passes, self.turbo_freeze_entropy, self.turbo_refresh_every, self.turbo_dormant_entropy
        )

    def with_overrides(self, **overrides: Any) -> GenerationConfig:
        """Apply the non-None overrides and validate the result."""
        changes = {k: v for k, v in overrides.items() if v is not None}
        if "eos_token_ids" in changes:
            changes["eos_token_ids"] = _as_id_tuple(changes["eos_token_ids"], "eos_token_ids")
        cfg = replace(self, **changes)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        def bad(name: str, why: str) -> ConfigError:
            return ConfigError(f"{name} {why} (got {getattr(self, name)!r})")

        for name in ("max_new_tokens", "max_denoising_steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise bad(name, "must be a positive integer")
        for name in ("entropy_bound", "confidence_threshold"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise bad(name, "must be a finite number > 0")
        for name in ("t_min", "t_max"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise bad(name, "must be a finite number >= 0")
        if self.t_max <= self.t_min:
            raise ConfigError(f"t_max must be greater than t_min (got t_min={self.t_min}, t_max={self.t_max})")
        v = self.stability_threshold
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise bad("stability_threshold", "must be an integer >= 0")
        if not isinstance(self.turbo, bool):
            raise bad("turbo", "must be true or false")
        try:
            self.turbo_settings.check()
        except ValueError as e:
            raise ConfigError(str(e)) from None


GENERATION_FIELDS = tuple(f.name for f in fields(GenerationConfig))


def _as_id_tuple(value: Any, name: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be an int or a list of ints (got {value!r})")
    if isinstance(value, int):
        return (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return tuple(value)
    raise ConfigError(f"{name} must be an int or a list of ints (got {value!r})")


def read_json(path: Path) -> dict:
    """Read a JSON object, turning every failure into a ConfigError that names the file."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path} not found") from None
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object, found {type(data).__name__}")
    return data


def _require(d: dict, key: str, where: str, kind: type | tuple = int) -> Any:
    if key not in d or d[key] is None:
        raise ConfigError(f"{where} is missing the required field '{key}'")
    v = d[key]
    if kind is int and (isinstance(v, bool) or not isinstance(v, int)):
        raise ConfigError(f"{where}: '{key}' must be an integer (got {v!r})")
    if kind is int and v <= 0:
        raise ConfigError(f"{where}: '{key}' must be positive (got {v!r})")
    return v


def default_layer_types(num_layers: int) -> list[str]:
    """Five sliding layers then one global, repeated; the last layer is always global."""
    types = [SLIDING if (i + 1) % 6 else GLOBAL for i in range(num_layers)]
    types[-1] = GLOBAL
    return types


def parse_model_config(data: dict, where: str = "config.json") -> ModelConfig:
    """Build a ModelConfig from the parsed top-level config.json."""
    model_type = data.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{where}: unsupported model_type {model_type!r}; dgemma runs {', '.join(SUPPORTED_MODEL_TYPES)} "
            "(DiffusionGemmaForBlockDiffusion) checkpoints"
        )
    text = data.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{where} is missing the required object 'text_config'")
    tw = f"{where} text_config"
    hidden = _require(text, "hidden_size", tw)
    num_layers = _require(text, "num_hidden_layers", tw)
    num_heads = _require(text, "num_attention_heads", tw)
    vocab = _require(text, "vocab_size", tw)
    intermediate = _require(text, "intermediate_size", tw)
    num_experts = _require(text, "num_experts", tw)
    top_k = _require(text, "top_k_experts", tw)
    moe_inter = _require(text, "moe_intermediate_size", tw)
    if top_k > num_experts:
        raise ConfigError(f"{tw}: top_k_experts ({top_k}) exceeds num_experts ({num_experts})")
    head_dim = text.get("head_dim") or hidden // num_heads
    num_kv = text.get("num_key_value_heads") or num_heads
    sliding_window = _require(text, "sliding_window", tw)
    if text.get("use_bidirectional_attention") == "all":
        raise ConfigError(
            f"{tw}: use_bidirectional_attention='all' makes the encoder bidirectional, which block diffusion "
            "with a causal KV cache does not support"
        )

    layer_types = text.get("layer_types") or default_layer_types(num_layers)
    if len(layer_types) != num_layers or any(t not in (SLIDING, GLOBAL) for t in layer_types):
        raise ConfigError(f"{tw}: layer_types must list {num_layers} entries of '{SLIDING}' or '{GLOBAL}'")
    layer_types = list(layer_types)
    layer_types[-1] = GLOBAL  # the reference forces the last layer global

    rope = text.get("rope_parameters") or {}
    rope_defaults = {
        SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
        GLOBAL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
    }

    # Per-layer head geometry: released form (global_head_dim, num_global_key_value_heads) or per_layer_config.
    overrides: dict[int, dict] = {}
    per_layer = text.get("per_layer_config")
    if isinstance(per_layer, dict):
        for key, value in per_layer.items():
            if not isinstance(value, dict):
                raise ConfigError(f"{tw}: per_layer_config[{key!r}] must be an object")
            if str(key) in (SLIDING, GLOBAL):
                for i, t in enumerate(layer_types):
                    if t == key:
                        overrides.setdefault(i, {}).update(value)
                continue
            try:
                idx = int(key)
            except (TypeError, ValueError):
                raise ConfigError(f"{tw}: per_layer_config key {key!r} is not a layer index") from None
            if not 0 <= idx < num_layers:
                raise ConfigError(f"{tw}: per_layer_config names layer {idx}, but there are {num_layers} layers")
            overrides.setdefault(idx, {}).update(value)
    else:
        global_head_dim = text.get("global_head_dim") or 512
        global_kv = text.get("num_global_key_value_heads")
        for i, t in enumerate(layer_types):
            if t == GLOBAL:
                o = {"head_dim": global_head_dim}
                if global_kv is not None:
                    o["num_key_value_heads"] = global_kv
                overrides[i] = o

    specs = []
    for i, t in enumerate(layer_types):
        o = overrides.get(i, {})
        r = {**rope_defaults[t], **(rope.get(t) or {})}
        rope_type = r.get("rope_type", "default")
        if rope_type not in ("default", "proportional"):
            raise ConfigError(f"{tw}: rope_type {rope_type!r} for {t} layers is not supported")
        spec = LayerSpec(
            kind=t,
            head_dim=int(o.get("head_dim") or head_dim),
            num_kv_heads=int(o.get("num_key_value_heads") or num_kv),
            rope_theta=float(r.get("rope_theta", 10_000.0)),
            rope_type=rope_type,
            partial_rotary_factor=float(r.get("partial_rotary_factor", 1.0)),
            rope_factor=float(r.get("factor", 1.0)),
        )
        if num_heads % spec.num_kv_heads:
            raise ConfigError(f"{tw}: layer {i}: {num_heads} heads do not divide into {spec.num_kv_heads} KV heads")
        specs.append(spec)

    act = text.get("hidden_activation") or "gelu_pytorch_tanh"
    if act not in GELU_APPROXIMATION:
        raise ConfigError(f"{tw}: hidden_activation {act!r} is not supported")
    canvas = data.get("canvas_length") or 256
    softcap = text.get("final_logit_softcapping")
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=num_layers,
        num_heads=num_heads,
        layers=tuple(specs),
        sliding_window=sliding_window,
        num_experts=num_experts,
        top_k_experts=top_k,
        moe_intermediate_size=moe_inter,
        canvas_length=int(canvas),
        rms_norm_eps=float(text.get("rms_norm_eps") or 1e-6),
        final_logit_softcapping=30.0 if softcap is None else float(softcap),
        hidden_activation=act,
        max_position_embeddings=int(text.get("max_position_embeddings") or 131072),
        pad_token_id=int(text.get("pad_token_id") if text.get("pad_token_id") is not None else 0),
        bos_token_id=int(text.get("bos_token_id") if text.get("bos_token_id") is not None else 2),
        eos_token_ids=_as_id_tuple(text.get("eos_token_id", 1), "eos_token_id"),
        vision=parse_vision_config(data, text, where),
        raw=data,
    )


def parse_vision_config(data: dict, text: dict, where: str = "config.json") -> VisionConfig | None:
    """The vision tower's geometry, or None when config.json describes none."""
    v = data.get("vision_config")
    if not isinstance(v, dict):
        return None
    vw = f"{where} vision_config"
    hidden = _require(v, "hidden_size", vw)
    heads = _require(v, "num_attention_heads", vw)
    rope = v.get("rope_parameters") or {}
    act = v.get("hidden_activation") or "gelu_pytorch_tanh"
    if act not in GELU_APPROXIMATION:
        raise ConfigError(f"{vw}: hidden_activation {act!r} is not supported")
    if rope.get("rope_type", "axial") != "axial":
        raise ConfigError(f"{vw}: rope_type {rope.get('rope_type')!r} is not supported (Gemma 4 uses 'axial')")
    return VisionConfig(
        hidden_size=hidden,
        intermediate_size=_require(v, "intermediate_size", vw),
        num_layers=_require(v, "num_hidden_layers", vw),
        num_heads=heads,
        num_kv_heads=int(v.get("num_key_value_heads") or heads),
        head_dim=int(v.get("head_dim") or hidden // heads),
        patch_size=int(v.get("patch_size") or 16),
        pooling_kernel_size=int(v.get("pooling_kernel_size") or 3),
        position_embedding_size=int(v.get("position_embedding_size") or 10240),
        rope_theta=float(rope.get("rope_theta", 100.0)),
        rms_norm_eps=float(v.get("rms_norm_eps") or 1e-6),
        hidden_activation=act,
        use_clipped_linears=bool(v.get("use_clipped_linears", False)),
        standardize=bool(v.get("standardize", False)),
        output_dims=int(v.get("output_proj_dims") or hidden),
        image_token_id=int(data.get("image_token_id", 258880)),
        boi_token_id=int(data.get("boi_token_id", 255999)),
        eoi_token_id=int(data.get("eoi_token_id", 258882)),
        bidirectional=text.get("use_bidirectional_attention") == "vision",
    )


def parse_generation_config(data: dict, model: ModelConfig | None = None) -> GenerationConfig:
    """Sampler defaults from generation_config.json; absent or null fields take the reference defaults.

    An absent EOS list falls back to the model config's eos_token_id, so generation stops on EOS
    even for checkpoints whose generation_config.json leaves it out.
    """
    d = dict(data)
    sampler = d.get("sampler_config")
    if isinstance(sampler, dict) and sampler.get("entropy_bound") is not None:
        d.setdefault("entropy_bound", sampler["entropy_bound"])
    base = GenerationConfig()
    values: dict[str, Any] = {}
    for name in GENERATION_FIELDS:
        key = {"eos_token_ids": "eos_token_id"}.get(name, name)
        if d.get(key) is not None:
            values[name] = d[key]
    if "eos_token_ids" in values:
        values["eos_token_ids"] = _as_id_tuple(values["eos_token_ids"], "eos_token_id")
    elif model is not None:
        values["eos_token_ids"] = model.eos_token_ids
    if "pad_token_id" not in values and model is not None:
        values["pad_token_id"] = model.pad_token_id
    for name in ("entropy_bound", "t_min", "t_max", "confidence_threshold"):
        if name in values and isinstance(values[name], int) and not isinstance(values[name], bool):
            values[name] = float(values[name])
    try:
        cfg = replace(base, **values)
        cfg.validate()
    except (TypeError, ConfigError) as e:
        raise ConfigError(f"generation_config.json: {e}") from None
    return cfg


def load_model_config(path: str | Path) -> ModelConfig:
    path = Path(path)
    return parse_model_config(read_json(path / "config.json"), where=str(path / "config.json"))


def load_generation_config(path: str | Path, model: ModelConfig | None = None) -> GenerationConfig:
    """generation_config.json if present, else the reference defaults."""
    p = Path(path) / "generation_config.json"
    data = read_json(p) if p.exists() else {}
    return parse_generation_config(data, model)
