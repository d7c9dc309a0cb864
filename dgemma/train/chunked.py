"""The vocabulary-sized parts of the objective, a chunk of rows at a time.

The released model's vocabulary has 262,144 words: the logits of 2,048 tokens are 2 GiB in
float32, and autograd would keep them (and the softmax, and their gradient) alive from the
forward to the backward. Here the LM head, the softcap and the cross-entropy run over `rows`
hidden states at a time, and the backward recomputes each chunk's logits instead of keeping
them, so no [tokens, vocab] float32 tensor ever exists: at most one [rows, vocab] chunk and its
softmax. liger-kernel's fused cross-entropy does the same on CUDA only, so it cannot be the
path the CPU tests check; this one runs anywhere torch does.

The arithmetic is the model's (`DiffusionGemma.logits`: the tied head in the activations'
dtype, float32 tanh softcapping) and `objective.masked_cross_entropy`'s, so the chunked loss and
its gradients equal the unchunked ones to float32 rounding (tests/train/test_chunked_loss.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Rows per chunk when the caller does not say: [rows, vocab] float32 logits of about this many bytes
# (64 rows at the released vocabulary). The backward holds about four such tensors at once.
CHUNK_BYTES = 64 * 2**20


def chunk_rows(vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Rows of [rows, vocab] float32 logits that take about `chunk_bytes` (at least 1)."""
    return max(1, chunk_bytes // (4 * vocab_size))


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype]:
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


def _capped_logits(hidden: torch.Tensor, weight: torch.Tensor, cap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(softcapped float32 logits, tanh(logits / cap) or None) of one chunk: the model's head."""
    logits = F.linear(hidden, weight).float()
    if not cap:
        return logits, None
    t = torch.tanh(logits / cap)
    return t * cap, t


class ChunkedCrossEntropy(torch.autograd.Function):
    """sum_i row_weight[i] * CE(softcap(hidden[i] @ weight.T), target[i]), a chunk of rows at a
    time; the backward recomputes each chunk's logits. `weight` is the tied embedding table
    [vocab, hidden]; its gradient is accumulated chunk by chunk where it needs one."""

    @staticmethod
    def forward(ctx, hidden, weight, target, row_weight, cap, rows):
        device_type = hidden.device.type
        ctx.autocast = (device_type, *_autocast_state(device_type))
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], rows):
            end = min(hidden.shape[0], start + rows)
            logits, _ = _capped_logits(hidden[start:end], weight, cap)
            ce = torch.logsumexp(logits, dim=-1) - logits.gather(1, target[start:end, None]).squeeze(1)
            total += (ce * row_weight[start:end]).sum()
            del logits, ce
        ctx.save_for_backward(hidden, weight, target, row_weight)
        ctx.cap, ctx.rows = cap, rows
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden, weight, target, row_weight = ctx.saved_tensors
        device_type, enabled, dtype = ctx.autocast
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        with torch.autocast(device_type, dtype=dtype, enabled=enabled):
            for start in range(0, hidden.shape[0], ctx.rows):
                end = min(hidden.shape[0], start + ctx.rows)
                h = hidden[start:end]
                logits, t = _capped_logits(h, weight, ctx.cap)
                grad = torch.softmax(logits, dim=-1)
                del logits
                grad[torch.arange(end - start, device=grad.device), target[start:end]] -= 1.0
                grad *= (row_weight[start:end] * grad_total)[:, None]
                if t is not None:  # d(cap * tanh(z / cap)) / dz = 1 - tanh^2
                    grad *= 1.0 - t * t
                    del t
                if need_hidden:
                    grad_hidden[start:end] = (grad.to(weight.dtype) @ weight).to(hidden.dtype)
                if need_weight:
                    grad_weight.addmm_(grad.t(), h.float())
                del grad
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    mask: torch.Tensor,
    cap: float | None,
    rows: int | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of softcap(hidden @ weight.T) against `target` over the True positions
    of `mask` (0 when there are none), as `objective.masked_cross_entropy(model.logits(hidden),
    target, mask)` computes it, a chunk of `rows` rows at a time (default: `chunk_rows`). Only the
    supervised rows go through the head: the others add nothing to the loss or its gradient."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    keep = mask.reshape(-1).nonzero().squeeze(1)
    count = keep.numel()
    if count == 0:
        return (flat.sum() * 0.0).float()  # 0, still connected to the graph
    rows = rows or chunk_rows(weight.shape[0])
    chosen = flat.index_select(0, keep)
    row_weight = torch.full((count,), 1.0 / count, dtype=torch.float32, device=flat.device)
    return ChunkedCrossEntropy.apply(chosen, weight, target.reshape(-1).index_select(0, keep), row_weight, cap, rows)


@torch.no_grad()
def chunked_soft_embeds(net, hidden: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """`net.soft_embed_from_logits(net.logits(hidden))` (the self-conditioning input of the
    no-grad first pass) a chunk of rows at a time: one chunk's logits and softmax at once."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    rows = rows or chunk_rows(net.config.vocab_size)
    out = [net.soft_embed_from_logits(net.logits(flat[s : s + rows])) for s in range(0, flat.shape[0], rows)]
    return torch.cat(out).reshape(*hidden.shape[:-1], -1)
