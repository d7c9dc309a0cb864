"""Default-mode generation: batch invariance, seeds, EOS and length handling, streaming, AR mode."""

import pytest
import torch

import dgemma
from checkpoints import EOS
from dgemma.engine.engine import Engine, EngineOptions, Request

PROMPTS = [list(range(5, 27)), [20, 21, 22], [30, 31, 32, 33, 34, 35], [7] * 9]


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["ref_gqa", "ref_wide"])
def test_ragged_batch_rows_equal_single_runs(request, shape):
    model = dgemma.load(request.getfixturevalue(shape)[0])
    max_new = 2 * model.config.canvas_length + 3
    batch = model.generate(PROMPTS, max_new_tokens=max_new, seed=[11, 12, 13, 14], entropy_bound=1.0)
    for r, prompt in enumerate(PROMPTS):
        alone = model.generate([prompt], max_new_tokens=max_new, seed=11 + r, entropy_bound=1.0)
        assert alone.sequences[0] == batch.sequences[r]
        assert alone.decoder_passes[0] == batch.decoder_passes[r]
        assert alone.tokens_per_forward[0] == batch.tokens_per_forward[r]


@pytest.mark.slow
def test_seed_reproducible_and_seeds_differ(ref_gqa):
    model = dgemma.load(ref_gqa[0])
    a = model.generate(PROMPTS[:2], max_new_tokens=20, seed=3)
    b = model.generate(PROMPTS[:2], max_new_tokens=20, seed=3)
    c = model.generate(PROMPTS[:2], max_new_tokens=20, seed=4)
    assert a.sequences == b.sequences
    assert a.sequences != c.sequences


@pytest.mark.slow
def test_eos_cuts_output_and_max_new_tokens_is_exact(ref_gqa):
    model = dgemma.load(ref_gqa[0])
    stopped = 0
    for seed in range(6):
        out = model.generate(PROMPTS, max_new_tokens=13, seed=seed)
        for seq in out.sequences:
            assert 1 <= len(seq) <= 13
            assert all(t not in EOS for t in seq[:-1])
            stopped += seq[-1] in EOS and len(seq) < 13
    assert stopped > 0
    no_eos = model.generate(PROMPTS, max_new_tokens=13, seed=0, eos_token_ids=[])
    assert [len(s) for s in no_eos.sequences] == [13] * len(PROMPTS)


@pytest.mark.slow
def test_tokens_per_forward_counts_passes(ref_gqa):
    model = dgemma.load(ref_gqa[0])
    out = model.generate(
        PROMPTS,
        max_new_tokens=40,
        seed=5,
        eos_token_ids=[],
        entropy_bound=3.0,
        confidence_threshold=5.0,
        stability_threshold=0,
    )
    canvas = model.config.canvas_length
    for passes, tpf in zip(out.decoder_passes, out.tokens_per_forward):
        blocks = -(-40 // canvas)
        assert tpf == pytest.approx(blocks * canvas / passes)
        assert blocks <= passes <= blocks * model.generation_config.max_denoising_steps
    assert max(out.tokens_per_forward) > 1.0  # a loose bound accepts several tokens per step


@pytest.mark.slow
def test_stream_blocks_add_up_to_generate(ref_gqa):
    model = dgemma.load(ref_gqa[0])
    events = list(model.stream(PROMPTS[0], drafts=True, seed=9, max_new_tokens=30))
    blocks = [e for e in events if isinstance(e, dgemma.Block)]
    drafts = [e for e in events if isinstance(e, dgemma.Draft)]
    assert blocks and drafts and blocks[-1].done
    assert sum((b.tokens for b in blocks), []) == model.generate([PROMPTS[0]], seed=9, max_new_tokens=30).sequences[0]
    assert events.index(drafts[0]) < events.index(blocks[0])
    assert all(len(d.canvas) == model.config.canvas_length for d in drafts)


def run_engine(engine: Engine, requests: list[Request]) -> dict[int, dgemma.Finished]:
    """Step an engine until the requests end; their Finished events by request index."""
    ids = [engine.add(r) for r in requests]
    finished = {}
    while engine.has_work:
        finished.update({e.row: e for e in engine.step() if isinstance(e, dgemma.Finished)})
    return {i: finished[rid] for i, rid in enumerate(ids)}


@pytest.mark.slow
def test_batched_passes_run(ref_gqa):
    """Batched (not batch-invariant) passes, the GPU default, produce well-formed output."""
    model = dgemma.load(ref_gqa[0])
    cfg = model.generation_config.with_overrides(max_new_tokens=20)
    engine = Engine(model.net, EngineOptions(batch_invariant=False))
    out = run_engine(engine, [Request(p, cfg, seed) for seed, p in enumerate(PROMPTS)])
    assert all(1 <= len(f.tokens) <= 20 for f in out.values())
    assert all(f.decoder_passes >= 1 for f in out.values())


def test_bad_inputs_raise_clear_errors(ref_gqa):
    model = dgemma.load(ref_gqa[0])
    with pytest.raises(ValueError, match="not a token id"):
        model.generate([[1, 2, 10_000]])
    with pytest.raises(ValueError, match="non-empty"):
        model.generate([[]])
    with pytest.raises(TypeError, match="list of prompts"):
        model.generate([1, 2, 3])
    with pytest.raises(ValueError, match="max_denoising_steps"):
        model.generate([[1, 2]], max_denoising_steps=0)
    with pytest.raises(ValueError, match="t_max must be greater"):
        model.generate([[1, 2]], t_min=0.9, t_max=0.5)
    with pytest.raises(ValueError, match="seeds"):
        model.generate([[1], [2]], seed=[1])
    with pytest.raises(ValueError, match="sampling"):
        model.generate([[1]], sampling="fast")


def _reference_encoder_logits(ref, ids):
    with torch.no_grad():
        hidden = ref.model.encoder(input_ids=ids).last_hidden_state
        logits = ref.lm_head(hidden).float()
        cap = ref.config.text_config.final_logit_softcapping
        return torch.tanh(logits / cap) * cap


def test_ar_logits_equal_reference_encoder(ref_wide):
    path, ref = ref_wide
    model = dgemma.load(path)
    ids = torch.randint(0, model.config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(0))
    expected = _reference_encoder_logits(ref, ids)
    from dgemma.dense.kv_cache import DenseKVCache

    cache = DenseKVCache(model.config, 2, 19, "cpu", torch.float32)
    got = model.net.logits(model.net.encode(ids, cache.plan_encoder(19)))
    assert (got - expected).abs().max().item() < 1e-4


def test_greedy_ar_equals_stepwise_recomputation(ref_wide):
    path, ref = ref_wide
    model = dgemma.load(path)
    prompt = [3, 17, 29, 4, 8]
    out = model.generate([prompt], mode="ar", max_new_tokens=12, eos_token_ids=[])
    seq = list(prompt)
    for _ in range(12):
        logits = _reference_encoder_logits(ref, torch.tensor([seq]))
        seq.append(int(logits[0, -1].argmax()))
    assert out.sequences[0] == seq[len(prompt) :]


@pytest.mark.slow
def test_sampling_every_position_gives_the_same_tokens(ref_gqa):
    """The GPU way (sample all positions, keep the accepted) equals the CPU way (sample accepted only)."""
    model = dgemma.load(ref_gqa[0])
    cfg = model.generation_config.with_overrides(max_new_tokens=20, entropy_bound=1.0)
    outs = []
    for sample_all in (False, True):
        engine = Engine(model.net)
        engine.runner.ops.sample_all_positions = sample_all
        finished = run_engine(engine, [Request(p, cfg, seed) for seed, p in enumerate(PROMPTS[:2])])
        outs.append([finished[i].tokens for i in range(2)])
    assert outs[0] == outs[1]


def test_cut_block_reports_eos_only_when_emitted():
    from dgemma.engine.events import cut_block

    assert cut_block([5, 1, 7], (1,), 10) == ([5, 1], True, 2)
    assert cut_block([5, 6, 1], (1,), 2) == ([5, 6], False, 3)  # EOS past the room: a length stop
    assert cut_block([5, 6], (1,), 5) == ([5, 6], False, 2)
