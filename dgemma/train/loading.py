"""What a training run starts from, once its checks have passed (checks.py): the tokenizer
(--tokenizer, the checkpoint's, or a byte-level BPE trained on the data), the network with its
generation config (a checkpoint's base, quantised a layer at a time as it loads or read as stored;
or random weights; a resumed run's weights) and, on a LoRA run, the adapters on it.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from ..config import ConfigError, GenerationConfig, load_generation_config
from ..inputs.tokenizer import Tokenizer
from ..model.checkpoint import init_weights
from ..model.diffusion_gemma import DiffusionGemma
from ..model.weights import load_weights
from . import lora
from .checks import CheckedRun
from .data import iter_records
from .tokenizer_train import as_tokenizer, train_bpe


def load_tokenizer(run: CheckedRun, out: Path, is_main: bool, world: int, say) -> Tokenizer:
    """--tokenizer (a directory or a tokenizer.json), the checkpoint's, or (training from a config)
    the one under `out`, trained on the data first by the main process where it is not there yet."""
    a = run.args
    if a.tokenizer:
        path = Path(a.tokenizer)
        return Tokenizer.from_dir(path) if path.is_dir() else _from_file(path)
    if a.model:
        if not (Path(a.model) / "tokenizer.json").exists():
            raise ValueError(f"{a.model} has no tokenizer.json; pass --tokenizer")
        return Tokenizer.from_dir(a.model)
    saved = out / "tokenizer.json"
    if not saved.exists():
        if is_main:
            vocab = run.config.vocab_size
            say(f"training a {vocab}-token BPE tokenizer on {', '.join(a.data)}")
            texts = (_record_text(rec) for _, rec in iter_records(a.data))
            trained = train_bpe(texts, vocab)
            out.mkdir(parents=True, exist_ok=True)
            trained.save(str(saved))
        if world > 1:
            dist.barrier()
    return _from_file(saved)


def load_network(run: CheckedRun) -> tuple[DiffusionGemma, GenerationConfig]:
    """The network on the CPU, in training mode, and its generation config (--generation's
    overrides applied): a fine-tuning run's base (each layer quantised as it is read, or read as
    stored; a full fine-tuning run resumes from its checkpoint's weights), or a fresh model's
    random weights (a resumed run's, from its checkpoint)."""
    a, config = run.args, run.config
    if a.model:
        generation = load_generation_config(a.model, config)
        source = run.resume_from if (run.resume_from and not run.lora_rank) else Path(a.model)
        # a quantised base: each layer quantised as it is read (or read as stored)
        scheme = a.quantization if run.stored_scheme is None else None
        net = load_weights(config, source, "cpu", run.base_dtype, scheme, a.group_size)
        for p in net.parameters():
            if not p.data.untyped_storage().resizable():  # memory-mapped from the file: own the memory
                p.data = p.data.clone()
    else:
        generation = GenerationConfig(eos_token_ids=(1, 6), pad_token_id=0)
        with torch.device("cpu"):
            net = DiffusionGemma(config)
        init_weights(net, std=a.init_std, seed=a.seed)
        if run.resume_from is not None:
            net.load_state_dict(load_weights(config, run.resume_from, "cpu", torch.float32).state_dict())
    if a.generation:
        generation = generation.with_overrides(**a.generation)
    net.train()
    for p in net.parameters():
        p.requires_grad_(True)
    return net, generation


def attach_adapters(net: DiffusionGemma, run: CheckedRun) -> float | None:
    """A LoRA run's adapters on `net`: --adapter's (its rank, alpha and modules), or fresh ones on
    --lora-targets; a resumed run's weights over them. Returns their scale (alpha / r); None
    where the run trains no adapters."""
    a = run.args
    if not run.lora_rank:
        return None
    if run.adapter_file is not None:
        lora.apply_lora(net, run.lora_rank, run.adapter_file.alpha, run.adapter_file.names)
        lora.load_adapters(net, a.adapter)
    else:
        lora.apply_lora(net, run.lora_rank, a.lora_alpha, a.lora_targets, seed=a.seed)
    scale = net.lora_config["lora_alpha"] / run.lora_rank
    if run.resume_from is not None:
        lora.load_adapters(net, run.resume_from)
    return scale


def _record_text(rec: dict) -> str:
    if "text" in rec:
        return str(rec["text"])
    if "messages" in rec:
        return "\n".join(str(m.get("content", "")) for m in rec["messages"] if isinstance(m, dict))
    return f"{rec.get('prompt', '')}{rec.get('completion', '')}"


def _from_file(path: Path) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    try:
        return as_tokenizer(HFTokenizer.from_file(str(path)))
    except Exception as e:
        raise ConfigError(f"{path} is not a valid tokenizer.json: {e}") from None
