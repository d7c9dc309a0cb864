"""Writing checkpoints in the Hugging Face layout, and building models from scratch.

A directory written here holds config.json (the form `transformers` 5.23 writes, with
`per_layer_config`), model.safetensors, generation_config.json, tokenizer.json and
tokenizer_config.json with a chat template: `dgemma.load` and transformers'
`DiffusionGemmaForBlockDiffusion.from_pretrained` both read it. The vision tower is described by a
minimal config (text-only models) so that transformers instantiates it cheaply.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from ..config import GLOBAL, SLIDING, GenerationConfig, LayerSpec, ModelConfig, parse_model_config
from ..inputs.tokenizer import DEFAULT_CHAT_TEMPLATE, Tokenizer
from .diffusion_gemma import DiffusionGemma
from .presets import PRESETS
from .weights import save_weights

# Gemma-style special tokens at fixed ids; <eos> and <turn|> end generation.
SPECIAL_TOKENS = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<mask>",
    "<|turn>",
    "<turn|>",
    "<|think|>",
    "<|channel>",
    "<channel|>",
]
EOS_TOKENS = ("<eos>", "<turn|>")

MINIMAL_VISION_CONFIG = {
    "model_type": "gemma4_vision",
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "head_dim": 8,
}


def make_config(
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    global_head_dim: int,
    num_global_kv_heads: int,
    intermediate_size: int,
    num_experts: int,
    top_k_experts: int,
    moe_intermediate_size: int,
    sliding_window: int,
    canvas_length: int,
    layer_types: list[str] | None = None,
    max_position_embeddings: int = 8192,
) -> ModelConfig:
    """A ModelConfig of this architecture from its sizes (via the config.json it would write)."""
    text = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "global_head_dim": global_head_dim,
        "num_global_key_value_heads": num_global_kv_heads,
        "sliding_window": sliding_window,
        "num_experts": num_experts,
        "top_k_experts": top_k_experts,
        "moe_intermediate_size": moe_intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "layer_types": layer_types,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 2,
    }
    # the vision_config config_json writes: text-only models describe a minimal tower they do not hold
    data = {"model_type": "diffusion_gemma", "text_config": text, "canvas_length": canvas_length}
    return parse_model_config(dict(data, vision_config=MINIMAL_VISION_CONFIG))


def config_json(config: ModelConfig) -> dict:
    """config.json in the form transformers 5.23 writes (per_layer_config)."""
    first = {SLIDING: None, GLOBAL: None}
    for spec in config.layers:
        first[spec.kind] = first[spec.kind] or spec
    base: LayerSpec = first[SLIDING] or first[GLOBAL]
    per_layer = {
        str(i): {"head_dim": s.head_dim, "num_key_value_heads": s.num_kv_heads}
        for i, s in enumerate(config.layers)
        if s.kind == GLOBAL
    }
    rope = {}
    for kind, spec in first.items():
        if spec is None:
            continue
        params = {"rope_type": spec.rope_type, "rope_theta": spec.rope_theta}
        if spec.rope_type == "proportional":
            params["partial_rotary_factor"] = spec.partial_rotary_factor
        if spec.rope_factor != 1.0:
            params["factor"] = spec.rope_factor
        rope[kind] = params
    text = {
        "model_type": "diffusion_gemma_text",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": base.num_kv_heads,
        "head_dim": base.head_dim,
        "per_layer_config": per_layer,
        "layer_types": [s.kind for s in config.layers],
        "sliding_window": config.sliding_window,
        "rope_parameters": rope,
        "num_experts": config.num_experts,
        "top_k_experts": config.top_k_experts,
        "moe_intermediate_size": config.moe_intermediate_size,
        "hidden_activation": config.hidden_activation,
        "rms_norm_eps": config.rms_norm_eps,
        "final_logit_softcapping": config.final_logit_softcapping,
        "max_position_embeddings": config.max_position_embeddings,
        "pad_token_id": config.pad_token_id,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_ids) if len(config.eos_token_ids) > 1 else config.eos_token_ids[0],
        "tie_word_embeddings": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_bidirectional_attention": None,
    }
    return {
        "architectures": ["DiffusionGemmaForBlockDiffusion"],
        "model_type": "diffusion_gemma",
        "canvas_length": config.canvas_length,
        "text_config": text,
        "vision_config": MINIMAL_VISION_CONFIG,
        "tie_word_embeddings": True,
        "dtype": "float32",
    }


def generation_config_json(gen: GenerationConfig) -> dict:
    return {
        "max_new_tokens": gen.max_new_tokens,
        "max_denoising_steps": gen.max_denoising_steps,
        "sampler_config": {"entropy_bound": gen.entropy_bound, "_cls_name": "EntropyBoundSamplerConfig"},
        "t_min": gen.t_min,
        "t_max": gen.t_max,
        "stability_threshold": gen.stability_threshold,
        "confidence_threshold": gen.confidence_threshold,
        "eos_token_id": list(gen.eos_token_ids),
        "pad_token_id": gen.pad_token_id,
        "bos_token_id": 2,
        "return_dict_in_generate": True,
    }


def tokenizer_config_json(chat_template: str = DEFAULT_CHAT_TEMPLATE, max_length: int = 8192) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "model_max_length": max_length,
        "add_bos_token": True,
        "chat_template": chat_template,
    }


def byte_tokenizer() -> HFTokenizer:
    """A byte-level tokenizer (specials, then the 256 byte symbols, no merges) for random models."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


@torch.no_grad()
def init_weights(net: DiffusionGemma, std: float = 0.02, seed: int | None = None) -> DiffusionGemma:
    """The reference's initialisation: normal(0, std) matrices and embeddings, unit norms and scales."""
    gen = torch.Generator(device="cpu")
    if seed is not None:
        gen.manual_seed(seed)
    for p in net.parameters():
        if p.dim() >= 2:
            p.copy_(torch.randn(p.shape, generator=gen) * std)
        else:
            p.fill_(1.0)
    for name, b in net.named_buffers():
        if name.endswith("layer_scalar"):
            b.fill_(1.0)
    return net


def random_model(
    config: ModelConfig, seed: int = 0, std: float = 0.02, dtype=torch.float32, device="cpu"
) -> DiffusionGemma:
    with torch.device(device):
        net = DiffusionGemma(config)
    return init_weights(net, std=std, seed=seed).to(dtype).eval()


def save_checkpoint(
    net: DiffusionGemma,
    path: str | Path,
    generation: GenerationConfig | None = None,
    tokenizer: HFTokenizer | Tokenizer | None = None,
    chat_template: str = DEFAULT_CHAT_TEMPLATE,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write a complete checkpoint directory."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = config_json(net.config)
    if dtype is not None:
        cfg["dtype"] = {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "float32")
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_side_files(path, net.config, generation, tokenizer, chat_template)
    save_weights(net, path, dtype=dtype)
    return path


def save_side_files(
    path: Path,
    config: ModelConfig,
    generation: GenerationConfig | None = None,
    tokenizer: HFTokenizer | Tokenizer | None = None,
    chat_template: str = DEFAULT_CHAT_TEMPLATE,
) -> None:
    """generation_config.json and the tokenizer files of a checkpoint directory (all but weights and config.json)."""
    generation = generation or GenerationConfig(eos_token_ids=(1, 6), pad_token_id=0)
    (path / "generation_config.json").write_text(json.dumps(generation_config_json(generation), indent=2) + "\n")
    if tokenizer is not None:
        raw = tokenizer._tok if isinstance(tokenizer, Tokenizer) else tokenizer
        raw.save(str(path / "tokenizer.json"))
        (path / "tokenizer_config.json").write_text(
            json.dumps(tokenizer_config_json(chat_template, config.max_position_embeddings), indent=2) + "\n"
        )


def make_tiny_random(path: str | Path, seed: int = 0) -> Path:
    """A tiny random checkpoint with a byte-level tokenizer (for trying the tools; it writes noise)."""
    config = make_config(**PRESETS["micro"])
    net = random_model(config, seed=seed, std=0.5)
    return save_checkpoint(net, path, tokenizer=byte_tokenizer())
