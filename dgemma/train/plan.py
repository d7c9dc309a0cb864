"""The memory plan of a fine-tuning step: what one optimizer step of `dgemma finetune` holds at
its peak, and what would fit where it does not (`finetune_refusal`: the trainer's check before it
loads; `dgemma memory --finetune`).

The peak: a frozen base (quantised: QLoRA), the adapters with their gradients and AdamW's two
moments (float32), the activations activation checkpointing keeps (each layer's input in every
pass, the KV cache the decoder reads and, in the backward, its gradient), one layer's activations
while it is recomputed and differentiated, one chunk of the vocabulary-sized loss (chunked.py),
and the CUDA context (on a CPU: the process's own interpreter and libraries). Pure arithmetic on
the config, as memory_plan.py's serving plan is (whose weight counts it shares).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..config import ModelConfig
from ..engine.kv.budget import dtype_bytes
from ..memory_plan import RESERVE, counted_bytes, parameter_counts
from ..quant import schemes

LORA_TARGETS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)  # train/lora.py's default targets (attention and the dense MLP)
ADAM_BYTES = 16  # a float32 trained parameter: itself, its gradient, AdamW's exp_avg and exp_avg_sq
LOSS_CHUNK_BYTES = 64 * 2**20  # train/chunked.py's CHUNK_BYTES: [rows, vocab] float32 logits per chunk
LOSS_CHUNK_TENSORS = 4  # a chunk's logits, tanh, softmax / gradient and a temporary, at once
# A layer's backward holds, beside the activations its forward saved, the gradients flowing
# through it: counted as half as much again (an estimate; with it the plan's step part came out
# 1.83 GiB against 1.68 measured for the released size at 512 tokens on a CPU, and above the
# live tensors' peak on the mid model: scripts/qlora_memory.py, docs/training.md).
BACKWARD_FACTOR = 1.5
LORA_RANK_ROOM = 16  # the adapters' rank the per-token count assumes (their share is small at any rank)
CPU_PROCESS_RESERVE = 2**29  # a CPU process's interpreter, torch and libraries (hub/fit.py's CPU_RESERVE)
FINETUNE_SEQ_LENS = (8192, 4096, 2048, 1024, 512, 256)  # shorter sequences a refusal may suggest
FINETUNE_RANKS = (8, 4)  # smaller ranks a refusal may suggest


@dataclass(frozen=True)
class FinetuneWork:
    """What a fine-tuning plan is for: the base's quantised parts in `scheme` (None: full
    precision, `group_size` for int4), its other parts in `weight_dtype`; adapters of `lora_rank`
    on `targets` (module-name suffixes; rank 0: full fine-tuning, every parameter trained);
    micro-batches of `batch` sequences of `seq_len` tokens with `blocks` canvases each;
    activations in `act_dtype`; per-layer `checkpointing`; loss chunks of `chunk_rows` rows (None:
    about LOSS_CHUNK_BYTES; 0: the whole logits); on a "cuda" or "cpu" device."""

    scheme: str | None = "int4"
    group_size: int | None = None
    lora_rank: int = 16
    targets: tuple[str, ...] = LORA_TARGETS
    seq_len: int = 2048
    batch: int = 1
    blocks: int = 1
    weight_dtype: torch.dtype = torch.bfloat16
    act_dtype: torch.dtype = torch.bfloat16
    checkpointing: bool = True
    chunk_rows: int | None = None
    device: str = "cuda"


@dataclass(frozen=True)
class FinetunePlan:
    """The bytes of one fine-tuning step's peak, part by part (`parts`), for `work`."""

    work: FinetuneWork
    base: dict[str, int]  # the frozen (or, rank 0, trained) weights by part, as stored
    adapters: int  # trained parameters, gradients and AdamW state
    trained_parameters: int
    checkpoints: int  # what the forward keeps for the backward
    recompute: int  # one layer's activations and gradients during its backward
    loss_chunk: int
    reserve: int  # the CUDA context, or a CPU process's own

    @property
    def parts(self) -> dict[str, int]:
        cpu = self.work.device == "cpu"
        return {
            f"base ({self.work.scheme or 'unquantised'})": sum(self.base.values()),
            "adapters and optimizer" if self.work.lora_rank else "gradients and optimizer": self.adapters,
            "activation checkpoints" if self.work.checkpointing else "activations": self.checkpoints,
            "one layer's recompute" if self.work.checkpointing else "one layer's backward": self.recompute,
            "loss chunk": self.loss_chunk,
            "process (interpreter, torch)" if cpu else "CUDA context": self.reserve,
        }

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        gib = 2**30
        return ", ".join(f"{name} {size / gib:.2f} GiB" for name, size in self.parts.items()) + (
            f": {self.total / gib:.2f} GiB"
        )


def trained_parameters(
    config: ModelConfig, rank: int, targets: tuple[str, ...] = LORA_TARGETS, counts: dict | None = None
) -> int:
    """Adapter parameters of rank `rank` on the linears named by `targets` (r x (in + out) each);
    rank 0: every parameter of the text stack (full fine-tuning; its buffers are not trained).
    `counts`: `parameter_counts(config)`, where the caller has it."""
    if rank == 0:
        from ..model.diffusion_gemma import DiffusionGemma

        with torch.device("meta"):
            return sum(p.numel() for p in DiffusionGemma(config).parameters())
    counts = counts or parameter_counts(config)
    total = 0
    for part in ("attention", "dense"):
        for name, (rows, cols, _) in counts[part].items():
            if name.removesuffix(".weight").endswith(targets):
                total += rank * (rows + cols)
    return total


def layer_activation_elements(config: ModelConfig, spec, tokens: int, keys: int, masked: bool) -> tuple[int, int]:
    """(float32 elements, activation-dtype elements) one layer's forward saves for its backward
    over `tokens` tokens attending to `keys` keys, counted from the tensors autograd keeps
    (measured per op on the mid model, quant/modules.py's differentiable experts): the norms'
    float32 inputs, the residual stream, the attention's q, k, v, output and RoPE tables, the
    dense MLP's and the routed experts' intermediates, and the keys and values repeated across
    query heads where SDPA cannot group them itself (a mask, or head_dim over 256)."""
    h, k = config.hidden_size, config.top_k_experts
    qd, kvd = config.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    norms = 4 * h  # RMSNorm computes in float32 whatever the activations are
    rest = (
        3 * h  # the norms' outputs the adapters and the residual adds keep
        + 2 * k * h  # the experts' outputs before and after their routing weights
        + 3 * k * config.moe_intermediate_size  # gate|up and gelu(gate) of each routed slot
        + 4 * config.intermediate_size  # the dense MLP's gate, up, gelu and product
        + 3 * qd  # q, the attention output, q's norm
        + 2 * kvd  # k's and v's norms
        + 2 * spec.head_dim  # the RoPE tables
        + 8 * LORA_RANK_ROOM  # adapters' r-wide intermediates
        + 2 * config.num_experts  # router logits and probabilities
    )
    grouped = masked or spec.head_dim > 256
    kv = 2 * kvd * keys + (2 * qd * keys if grouped and config.num_heads > spec.num_kv_heads else 0)
    return norms * tokens, rest * tokens + kv


def plan_finetune(config: ModelConfig, work: FinetuneWork = FinetuneWork(), counts: dict | None = None) -> FinetunePlan:
    """The peak of one fine-tuning step of `work` on a model of `config`: pure arithmetic on the
    config, so `dgemma memory --finetune` and `dgemma finetune`'s check before loading print and
    test the same figure. Measured against a CPU step in scripts/qlora_memory.py (docs/training.md).
    `counts`: `parameter_counts(config)`, where the caller plans several variants of one model."""
    counts = counts or parameter_counts(config)
    act = dtype_bytes(work.act_dtype)
    base = counted_bytes(counts, work.scheme, work.group_size, work.weight_dtype)
    trained = trained_parameters(config, work.lora_rank, work.targets, counts)
    extra = ADAM_BYTES - dtype_bytes(work.weight_dtype) if work.lora_rank == 0 else ADAM_BYTES
    adapters = trained * extra
    h, c, layers = config.hidden_size, config.canvas_length, len(config.layers)
    rows = work.batch * work.blocks  # canvases a micro-batch denoises
    enc_tokens, dec_tokens = work.batch * work.seq_len, rows * c
    kv_positions = sum(2 * s.num_kv_heads * s.head_dim for s in config.layers)
    kv = kv_positions * act * (work.batch * (work.seq_len + c) + (rows * (work.seq_len + c) if work.blocks > 1 else 0))

    def layer(tokens: int, keys_per_row: int, row_count: int, masked: bool) -> int:
        worst = 0
        for spec in config.layers:
            f32, other = layer_activation_elements(config, spec, tokens, keys_per_row * row_count, masked)
            worst = max(worst, 4 * f32 + act * other)
        return worst

    encoder_masked = work.batch > 1 or work.seq_len >= config.sliding_window
    enc_layer = layer(enc_tokens, work.seq_len, work.batch, encoder_masked)
    dec_layer = layer(dec_tokens, work.seq_len + c, rows, False)
    # outputs of the final norm and the rows the losses read (encoder and decoder)
    heads = 3 * (enc_tokens + dec_tokens) * h * act
    if work.checkpointing:
        kept = layers * (enc_tokens + dec_tokens) * h * act + heads
        recompute = int(BACKWARD_FACTOR * max(enc_layer, dec_layer))
    else:
        kept = layers * (enc_layer + dec_layer) + heads
        recompute = int((BACKWARD_FACTOR - 1) * max(enc_layer, dec_layer))
    checkpoints = kept + 2 * kv  # the K/V the decoder reads, and their gradients in the encoder's backward
    if work.chunk_rows == 0:
        logits_rows = max(enc_tokens, dec_tokens)
    else:
        logits_rows = work.chunk_rows or max(1, LOSS_CHUNK_BYTES // (4 * config.vocab_size))
        logits_rows = min(logits_rows, max(enc_tokens, dec_tokens))
    loss_chunk = LOSS_CHUNK_TENSORS * logits_rows * config.vocab_size * 4
    if work.lora_rank == 0:  # full fine-tuning: the tied table's float32 gradient from the chunked loss
        loss_chunk += config.vocab_size * h * 4
    reserve = CPU_PROCESS_RESERVE if work.device == "cpu" else RESERVE
    return FinetunePlan(work, base, adapters, trained, checkpoints, recompute, loss_chunk, reserve)


def _longest_fitting(
    config: ModelConfig, work: FinetuneWork, memory: int, counts: dict
) -> tuple[int, FinetunePlan] | None:
    """The longest of FINETUNE_SEQ_LENS shorter than `work`'s whose plan fits `memory`, with that plan."""
    for seq_len in FINETUNE_SEQ_LENS:
        if seq_len < work.seq_len:
            plan = plan_finetune(config, replace(work, seq_len=seq_len), counts)
            if plan.total <= memory:
                return seq_len, plan
    return None


def finetune_fixes(config: ModelConfig, work: FinetuneWork, memory: int) -> list[str]:
    """What would fit `memory` when `work` does not, as flags with their plans' totals: shorter
    sequences; a smaller scheme (with shorter sequences if it needs them); one sequence per
    micro-batch; a smaller rank."""
    gib = 2**30
    fixes = []
    counts = parameter_counts(config)
    shorter = _longest_fitting(config, work, memory, counts)
    if shorter is not None:
        fixes.append(f"--seq-len {shorter[0]} ({shorter[1].total / gib:.1f} GiB)")
    order = [None, *schemes.auto_names()]
    for scheme in order[order.index(work.scheme) + 1 :] if work.scheme in order else ():
        other = replace(work, scheme=scheme)
        plan = plan_finetune(config, other, counts)
        if plan.total <= memory:
            fixes.append(f"--quantization {scheme} ({plan.total / gib:.1f} GiB)")
            break
        shorter = _longest_fitting(config, other, memory, counts)
        if shorter is not None:
            fixes.append(f"--quantization {scheme} --seq-len {shorter[0]} ({shorter[1].total / gib:.1f} GiB)")
            break
    if work.batch > 1:
        plan = plan_finetune(config, replace(work, batch=1), counts)
        if plan.total <= memory:
            fixes.append(f"--batch-size 1 ({plan.total / gib:.1f} GiB)")
    for rank in FINETUNE_RANKS:
        if 0 < rank < work.lora_rank:
            plan = plan_finetune(config, replace(work, lora_rank=rank), counts)
            if plan.total <= memory:
                fixes.append(f"--lora-rank {rank} ({plan.total / gib:.1f} GiB)")
                break
    return fixes


def finetune_refusal(config: ModelConfig, work: FinetuneWork, plan: FinetunePlan, memory: int, where: str) -> str:
    """One line: the plan does not fit `memory` bytes of `where`, and what would."""
    gib = 2**30
    fixes = finetune_fixes(config, work, memory)
    hint = "it would fit with " + " or ".join(fixes) if fixes else "no smaller scheme, sequence or rank fits it either"
    return (
        f"fine-tuning does not fit this device's {memory / gib:.1f} GiB ({where}): {plan.describe()}; {hint}; "
        "--force trains anyway"
    )
