"""The memory options of the objective (issue 55, item 3): the cross-entropy over the vocabulary a
chunk of rows at a time, the logits recomputed in the backward (train/chunked.py), and activation
checkpointing per layer, the encoder's K/V as explicit outputs (train/objective.py). Both give the
losses and gradients of the plain computation, to 1e-5; the chunked loss never makes a
[tokens, vocab] tensor, forward or backward."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dgemma.model.checkpoint import make_config, random_model
from dgemma.model.presets import PRESETS
from dgemma.train import lora
from dgemma.train.chunked import chunk_rows, chunked_cross_entropy, chunked_soft_embeds
from dgemma.train.objective import (
    Example,
    collate,
    draw_noise,
    example_generator,
    masked_cross_entropy,
    training_losses,
)


class LargestTensor(TorchDispatchMode):
    """Records the most elements any operator's output had while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def softcapped(hidden, weight, cap):
    logits = torch.nn.functional.linear(hidden, weight).float()
    return torch.tanh(logits / cap) * cap


@pytest.mark.parametrize("cap", [30.0, None])
@pytest.mark.parametrize("rows", [1, 7, 64, 1000])
def test_chunked_cross_entropy_equals_the_whole_logits(cap, rows):
    g = torch.Generator().manual_seed(0)
    tokens, hidden_size, vocab = 50, 24, 301
    hidden = (torch.randn(2, tokens // 2, hidden_size, generator=g) * 2).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=g)).requires_grad_()
    target = torch.randint(vocab, (2, tokens // 2), generator=g)
    mask = torch.rand(2, tokens // 2, generator=g) < 0.7

    want = masked_cross_entropy(softcapped(hidden, weight, cap) if cap else hidden @ weight.T, target, mask)
    want_h, want_w = torch.autograd.grad(want * 3.0, (hidden, weight))
    got = chunked_cross_entropy(hidden, weight, target, mask, cap, rows)
    got_h, got_w = torch.autograd.grad(got * 3.0, (hidden, weight))
    assert abs(got.item() - want.item()) <= 1e-5 * max(1.0, abs(want.item()))
    assert torch.allclose(got_h, want_h, atol=1e-5, rtol=1e-5)
    assert torch.allclose(got_w, want_w, atol=1e-5, rtol=1e-5)
    assert (got_h[~mask] == 0).all()  # unsupervised rows get no gradient


def test_chunked_cross_entropy_never_holds_the_whole_logits():
    g = torch.Generator().manual_seed(1)
    tokens, vocab = 64, 512
    hidden = torch.randn(tokens, 4, generator=g, requires_grad=True)
    weight = torch.randn(vocab, 4, generator=g, requires_grad=True)  # (smaller than a chunk's logits)
    target = torch.randint(vocab, (tokens,), generator=g)
    with LargestTensor() as seen:
        chunked_cross_entropy(hidden, weight, target, torch.ones(tokens, dtype=torch.bool), 30.0, 8).backward()
    assert seen.largest <= 8 * vocab < tokens * vocab
    with LargestTensor() as whole:
        masked_cross_entropy(softcapped(hidden, weight, 30.0), target, torch.ones(tokens, dtype=torch.bool)).backward()
    assert whole.largest >= tokens * vocab  # (what the chunks avoid)
    nothing = chunked_cross_entropy(hidden, weight, target, torch.zeros(tokens, dtype=torch.bool), 30.0, 8)
    assert nothing.item() == 0.0  # as masked_cross_entropy: no supervised position, no loss
    assert chunk_rows(262144) == 64 and chunk_rows(10**9) == 1


def _objective_inputs(config):
    v = config.vocab_size
    examples = [
        Example([2] + [(7 * i + 11) % v for i in range(40)] + [1], [False] * 10 + [True] * 32, complete=True),
        Example([2] + [(5 * i + 3) % v for i in range(30)], [False] + [True] * 30, complete=False),
    ]
    gens = [example_generator(3, 1, i) for i in range(2)]
    batch = collate(examples, config.canvas_length, gens, blocks=2)
    noise = draw_noise(gens, config.canvas_length, v, sc_prob=0.5, blocks=2)
    noise.self_cond = torch.tensor([True, False, True, True])
    return batch, noise


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_checkpointed_layers_and_chunked_losses_equal_the_plain_objective(lora_rank):
    """The whole objective (full fine-tuning: every parameter, the tied embedding through the
    chunked head included; and LoRA) with every memory option against none: equal losses and
    gradients to 1e-5."""
    net = random_model(make_config(**PRESETS["test"]), seed=2, std=0.1).train()
    if lora_rank:
        lora.apply_lora(net, lora_rank, 8.0)
        with torch.no_grad():
            for m in lora.adapters(net).values():
                m.B.normal_(0, 0.1)
    else:
        net.requires_grad_(True)
    batch, noise = _objective_inputs(net.config)

    def run(**memory):
        net.zero_grad(set_to_none=True)
        losses = training_losses(net, batch, noise, ar_weight=0.5, **memory)
        losses.total.backward()
        grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
        return [losses.total.item(), losses.diffusion.item(), losses.ar.item()], grads

    want, want_grads = run()
    for memory in (dict(checkpoint_layers=True), dict(chunk_rows=5), dict(checkpoint_layers=True, chunk_rows=16)):
        got, grads = run(**memory)
        assert got == pytest.approx(want, abs=1e-5), memory
        assert grads.keys() == want_grads.keys() and len(grads) > 10
        for name, g in grads.items():
            assert torch.allclose(g, want_grads[name], atol=1e-5, rtol=1e-4), (memory, name)


def test_chunked_soft_embeds_equal_the_whole():
    net = random_model(make_config(**PRESETS["test"]), seed=4, std=0.1)
    hidden = torch.randn(3, 8, net.config.hidden_size)
    want = net.soft_embed_from_logits(net.logits(hidden))
    assert torch.allclose(chunked_soft_embeds(net, hidden, rows=5), want, atol=1e-6)
