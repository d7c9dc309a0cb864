"""Training: the objective against a hand computation, data masks, the loop (loss goes down, exact
resume), LoRA, the CLI's checkpoints in transformers, and FSDP2 on two gloo processes."""

import json
import math
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import dgemma
from dgemma.api import Model
from dgemma.cli import main
from dgemma.config import GenerationConfig
from dgemma.dense.kv_cache import DenseKVCache
from dgemma.model.checkpoint import byte_tokenizer, make_config, random_model
from dgemma.model.presets import PRESETS
from dgemma.train import lora
from dgemma.train.data import ExampleOrder, chat_example, document_examples, load_examples, prompt_completion_example
from dgemma.train.objective import (
    Example,
    choose_block,
    collate,
    draw_noise,
    example_generator,
    masked_cross_entropy,
    training_losses,
)
from dgemma.train.tokenizer_train import as_tokenizer, train_bpe
from dgemma.train.trainer import TrainArgs, Trainer, lr_at, train

CODE = '''def add(a, b):
    """Return the sum of a and b."""
    return a + b


def scale(values, k):
    return [k * v for v in values]


class Counter:
    def __init__(self):
        self.n = 0

    def bump(self):
        self.n += 1
        return self.n
'''


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("train")
    (d / "text").mkdir()
    for i in range(6):
        (d / "text" / f"f{i}.py").write_text(CODE.replace("add", f"add{i}"))
    records = [{"prompt": f"def f{i}(x):\n", "completion": f"    return x + {i}\n"} for i in range(20)]
    records += [
        {"messages": [{"role": "user", "content": f"double {i}"}, {"role": "assistant", "content": str(2 * i)}]}
        for i in range(20)
    ]
    (d / "sft.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    byte_tokenizer().save(str(d / "tokenizer.json"))
    return d


def small_args(workdir: Path, out: Path, **kw) -> TrainArgs:
    base = dict(
        out=str(out),
        data=[str(workdir / "text")],
        config="test",
        tokenizer=str(workdir / "tokenizer.json"),
        steps=6,
        batch_size=2,
        seq_len=48,
        lr=3e-3,
        warmup=2,
        save_every=2,
        eval_every=100,
        eval_batches=1,
        eval_fraction=0.0,
        log_every=100,
        threads=1,
    )
    base.update(kw)
    return TrainArgs(**base)


# ---------------------------------------------------------------- the objective


def test_masked_cross_entropy_by_hand():
    logits = torch.tensor([[[2.0, 0.0, -1.0], [0.5, 0.5, 0.0]], [[0.0, 3.0, 1.0], [1.0, 1.0, 1.0]]])
    target = torch.tensor([[0, 2], [1, 1]])
    mask = torch.tensor([[True, True], [False, True]])

    def ce(row, t):
        return math.log(sum(math.exp(v) for v in row)) - row[t]

    want = (ce([2.0, 0.0, -1.0], 0) + ce([0.5, 0.5, 0.0], 2) + ce([1.0, 1.0, 1.0], 1)) / 3
    assert masked_cross_entropy(logits, target, mask).item() == pytest.approx(want, abs=1e-6)
    assert masked_cross_entropy(logits, target, torch.zeros_like(mask)).item() == 0.0


def test_loss_equals_hand_computation_on_a_fixed_batch():
    """training_losses (batched, differentiable cache, ragged rows, 2 blocks per row) against a
    per-row recomputation through the inference path (Model.canvas_logits)."""
    config = make_config(**PRESETS["test"])
    net = random_model(config, seed=3, std=0.3)
    model = Model(net, GenerationConfig())
    c, vocab = config.canvas_length, config.vocab_size
    examples = [
        Example([2] + list(range(20, 45)) + [1], [False] * 10 + [True] * 17, complete=True),
        Example([2] + list(range(60, 78)), [False] + [True] * 18, complete=False),
    ]
    gens = [example_generator(7, 0, i) for i in range(2)]
    batch = collate(examples, c, gens, blocks=2)
    noise = draw_noise(gens, c, vocab, sc_prob=0.5, blocks=2)
    noise.self_cond = torch.tensor([True, False, False, True])  # both kinds in each row
    got = training_losses(net, batch, noise, ar_weight=0.7)

    # AR: each row alone through the encoder, -log p(next) summed over supervised targets.
    ar_sum, ar_n = 0.0, 0
    for e in examples:
        cache = DenseKVCache(config, 1, len(e.ids))
        ids = torch.tensor([e.ids])
        logp = net.logits(net.encode(ids, cache.plan_encoder(len(e.ids)))).log_softmax(-1)[0]
        for i in range(1, len(e.ids)):
            if e.mask[i]:
                ar_sum -= logp[i - 1, e.ids[i]].item()
                ar_n += 1
    # Diffusion: each block's noisy canvas after its own prefix, first pass fed back when self-conditioned.
    d_sum, d_n = 0.0, 0
    for j in range(4):
        e, start = examples[j // 2], batch.block_start[j]
        assert start >= 1 and e.mask[start]
        target = (e.ids[start : start + c] + [0] * c)[:c]
        sup = (e.mask[start : start + c] + [e.complete] * c)[:c]
        canvas = [int(noise.tokens[j, k]) if noise.corrupt[j, k] else target[k] for k in range(c)]
        first = model.canvas_logits([e.ids[:start]], [canvas])
        logits = model.canvas_logits([e.ids[:start]], [canvas], first) if noise.self_cond[j] else first
        logp = logits.log_softmax(-1)[0]
        for k in range(c):
            if sup[k]:
                d_sum -= logp[k, target[k]].item()
                d_n += 1
    assert got.ar.item() == pytest.approx(ar_sum / ar_n, abs=1e-4)
    assert got.diffusion.item() == pytest.approx(d_sum / d_n, abs=1e-4)
    assert got.total.item() == pytest.approx(d_sum / d_n + 0.7 * ar_sum / ar_n, abs=1e-4)
    got.total.backward()  # the whole objective backpropagates
    assert net.embed_tokens.weight.grad is not None and net.layers[0].experts.gate_up_proj.grad.abs().sum() > 0


def test_noise_draws_are_per_example_and_uniform():
    gens = lambda idx: [example_generator(1, 5, i) for i in idx]  # noqa: E731
    whole = draw_noise(gens(range(4)), 16, 100)
    halves = [draw_noise(gens(r), 16, 100) for r in (range(2), range(2, 4))]
    for field in ("t", "corrupt", "tokens", "self_cond"):
        assert torch.equal(getattr(whole, field), torch.cat([getattr(h, field) for h in halves]))
    many = draw_noise(gens(range(400)), 64, 100)
    assert many.t.min() >= 1e-3 and many.t.max() < 1
    assert abs(many.corrupt.float().mean() - many.t.mean()) < 0.03  # each position corrupted w.p. t
    assert abs(many.self_cond.float().mean() - 0.5) < 0.08
    assert many.tokens.min() >= 0 and many.tokens.max() == 99


def test_block_choice():
    g = torch.Generator().manual_seed(0)
    truncated = Example(list(range(2, 22)), [False] * 5 + [True] * 15, complete=False)
    for _ in range(50):
        start, target, mask = choose_block(truncated, 8, g)
        assert 5 <= start <= 12 and target == truncated.ids[start : start + 8] and all(mask)
    done = Example([2, 10, 11, 1], [False, True, True, True], complete=True)
    starts = set()
    for _ in range(50):
        start, target, mask = choose_block(done, 8, g)
        starts.add(start)
        assert target == (done.ids[start:] + [0] * 8)[:8] and all(mask)  # pad after EOS is supervised
    assert starts == {1, 2, 3}
    assert choose_block(Example([2, 9, 1], [False] * 3), 8, g) == (3, [0] * 8, [False] * 8)


# ---------------------------------------------------------------- data


def test_data_formats_and_loss_masks(workdir):
    tok = as_tokenizer(byte_tokenizer())
    bos, eos = 2, 1
    ex = prompt_completion_example(tok.encode("Q:", False), tok.encode(" 42", False), 64, bos, eos)
    assert tok.decode([t for t, m in zip(ex.ids, ex.mask) if m], skip_special_tokens=False) == " 42<eos>"
    assert ex.ids[0] == bos and ex.complete

    chat = chat_example(
        tok,
        [
            {"role": "system", "content": "terse"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "bye"},
            {"role": "assistant", "content": "ciao"},
        ],
        256,
    )
    supervised = tok.decode([t for t, m in zip(chat.ids, chat.mask) if m], skip_special_tokens=False)
    assert supervised == "hello<turn|>\nciao<turn|>\n"
    assert tok.decode(chat.ids, skip_special_tokens=False).startswith("<bos><|turn>system\nterse<turn|>")

    docs = document_examples(list(range(300, 400)), 33, bos, eos)
    assert [len(d.ids) for d in docs] == [33, 33, 33, 6] and [d.complete for d in docs] == [False] * 3 + [True]
    assert all(d.ids[0] == bos and not d.mask[0] and all(d.mask[1:]) for d in docs) and docs[-1].ids[-1] == eos

    train_set, held = load_examples([workdir / "text", workdir / "sft.jsonl"], tok, 64, eval_fraction=0.3)
    assert train_set and held and len(train_set) + len(held) >= 6 + 40  # long files span several windows
    s = ExampleOrder(train_set, seed=0)
    first_epoch = [id(s[i]) for i in range(len(s))]
    assert sorted(first_epoch) == sorted(map(id, train_set))  # a permutation per epoch

    bad = workdir / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_examples([bad], tok, 64)


def test_bpe_tokenizer_has_gemma_specials():
    tok = train_bpe([CODE] * 20, 400)
    assert [tok.token_to_id(t) for t in ("<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>")] == [0, 1, 2, 5, 6]
    assert tok.get_vocab_size() <= 400
    wrapped = as_tokenizer(tok)
    ids = wrapped.encode(CODE)
    assert ids[0] == 2 and wrapped.decode(ids) == CODE and len(ids) < len(CODE) / 3
    assert wrapped.encode("<|turn>user\n", add_special_tokens=False)[0] == 5


# ---------------------------------------------------------------- the loop


def test_every_preset_is_a_train_config_and_micro_is_make_tiny(tmp_path):
    from dgemma.config import load_model_config
    from dgemma.model.checkpoint import make_tiny_random
    from dgemma.train.checks import model_config_from

    assert list(PRESETS) == ["tiny", "test", "micro", "mid", "real"]
    for name, sizes in PRESETS.items():
        config = model_config_from(name)
        assert (config.hidden_size, config.canvas_length) == (sizes["hidden_size"], sizes["canvas_length"]), name
    assert model_config_from("tiny").num_parameters() == 9_925_180  # the shipped dgemma-tiny (its model card)
    micro = load_model_config(make_tiny_random(tmp_path / "micro"))
    assert micro == model_config_from("micro")


def test_lr_schedule():
    assert lr_at(0, 1.0, 10, 100, 0.1) == pytest.approx(0.1)
    assert lr_at(9, 1.0, 10, 100, 0.1) == pytest.approx(1.0)
    assert lr_at(10, 1.0, 10, 100, 0.1) == pytest.approx(1.0)
    assert lr_at(55, 1.0, 10, 100, 0.1) == pytest.approx(0.55)
    assert lr_at(100, 1.0, 10, 100, 0.1) == pytest.approx(0.1)


@pytest.mark.slow
def test_a_few_steps_lower_the_loss(workdir, tmp_path):
    args = small_args(
        workdir,
        tmp_path / "run",
        steps=40,
        batch_size=4,
        eval_every=40,
        eval_batches=2,
        eval_data=[str(workdir / "text")],
        save_every=40,
    )
    trainer = Trainer(args)
    before = trainer.evaluate()
    result = trainer.run()
    assert result.step == 40 and not result.interrupted
    assert result.eval["eval_ar"] < before["eval_ar"] - 1.0
    assert result.eval["eval_diffusion"] < before["eval_diffusion"] - 1.0
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    steps = [r for r in log if "loss" in r]
    assert steps[-1]["step"] == 40 and steps[-1]["tokens_per_s"] > 0 and log[-1]["eval_ar"] == result.eval["eval_ar"]


def _weights(path: Path) -> dict:
    return load_file(str(path / "model.safetensors"))


@pytest.mark.slow
def test_resume_after_interruption_reproduces_the_uninterrupted_run(workdir, tmp_path):
    kw = dict(grad_accum=2, blocks=2)
    full = train(small_args(workdir, tmp_path / "full", **kw))
    assert full.step == 6

    # A crash (kill) after step 5: the last checkpoint is step 4, so steps 5-6 are redone.
    def crash(step, record):
        if step == 5:
            raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        train(small_args(workdir, tmp_path / "crash", **kw), on_step=crash)
    assert sorted(p.name for p in (tmp_path / "crash" / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
    resumed = train(small_args(workdir, tmp_path / "crash", **kw))
    assert resumed.step == 6

    # Ctrl-C after step 3: the step finishes, a checkpoint is written, the run stops; then resumes.
    def ctrl_c(step, record):
        if step == 3:
            os.kill(os.getpid(), signal.SIGINT)

    stopped = train(small_args(workdir, tmp_path / "sigint", **kw), on_step=ctrl_c)
    assert stopped.interrupted and stopped.step == 4
    assert (tmp_path / "sigint" / "checkpoints" / "step-000004").is_dir()
    train(small_args(workdir, tmp_path / "sigint", **kw))

    want = _weights(tmp_path / "full")
    for run in ("crash", "sigint"):
        got = _weights(tmp_path / run)
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), run
    assert not torch.equal(
        want["model.decoder.embed_tokens.weight"],
        _weights(tmp_path / "full" / "checkpoints" / "step-000004")["model.decoder.embed_tokens.weight"],
    )


# ---------------------------------------------------------------- LoRA


def test_lora_save_load_merge_round_trip(tmp_path):
    config = make_config(**PRESETS["test"])
    base = random_model(config, seed=1, std=0.3)
    names = lora.apply_lora(base, rank=4, alpha=8)
    assert len(names) == config.num_layers * 7 - sum(not s.has_v_proj for s in config.layers)
    trainable = {n for n, p in base.named_parameters() if p.requires_grad}
    assert trainable and all(".lora." in n for n in trainable)
    assert not any("router" in n or "experts" in n for n in trainable)
    with torch.no_grad():
        for m in lora.adapters(base).values():
            m.B.normal_(0, 0.1)
    model = Model(base, GenerationConfig())
    prompt, canvas = [[2, 40, 41, 42, 43]], torch.randint(0, 384, (1, 8))
    adapted = model.canvas_logits(prompt, canvas)
    plain = Model(random_model(config, seed=1, std=0.3), GenerationConfig()).canvas_logits(prompt, canvas)
    assert (adapted - plain).abs().max() > 1e-2  # the adapters matter

    lora.save_adapters(base, tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").stat().st_size < 200_000
    fresh = random_model(config, seed=1, std=0.3)
    lora.load_adapters(fresh, tmp_path / "adapter")
    assert torch.equal(Model(fresh, GenerationConfig()).canvas_logits(prompt, canvas), adapted)

    lora.merge_lora(fresh)
    assert not lora.adapters(fresh) and all(not hasattr(m, "lora") for m in fresh.modules())
    merged = Model(fresh, GenerationConfig()).canvas_logits(prompt, canvas)
    assert (merged - adapted).abs().max() < 1e-4


@pytest.mark.slow
def test_finetune_lora_cli_freezes_router_and_merges(workdir, tmp_path, capsys):
    base_dir = tmp_path / "base"
    assert (
        main(
            [
                "train",
                "--config",
                "test",
                "--data",
                str(workdir / "text"),
                "--out",
                str(base_dir),
                "--tokenizer",
                str(workdir / "tokenizer.json"),
                "--steps",
                "2",
                "--batch-size",
                "2",
                "--seq-len",
                "32",
                "--threads",
                "1",
            ]
        )
        == 0
    )
    out = tmp_path / "ft"
    assert (
        main(
            [
                "finetune",
                "--model",
                str(base_dir),
                "--data",
                str(workdir / "sft.jsonl"),
                "--out",
                str(out),
                "--lora-rank",
                "4",
                "--steps",
                "4",
                "--batch-size",
                "2",
                "--seq-len",
                "32",
                "--lr",
                "1e-2",
                "--warmup",
                "0",
                "--threads",
                "1",
            ]
        )
        == 0
    )
    adapter = load_file(str(out / "adapter_model.safetensors"))
    assert adapter and all(".self_attn." in k or ".mlp." in k for k in adapter)
    base_w, merged_w = _weights(base_dir), _weights(out)
    changed = {k for k in base_w if not torch.equal(base_w[k], merged_w[k])}
    assert changed and all(("self_attn" in k or ".mlp." in k) and k.endswith("proj.weight") for k in changed)
    assert any("router" in k for k in base_w) and not any("router" in k or "experts" in k for k in changed)

    merged_again = tmp_path / "merged"
    assert main(["merge-lora", "--model", str(base_dir), "--adapter", str(out), "--out", str(merged_again)]) == 0
    again = _weights(merged_again)
    assert max((again[k] - merged_w[k]).abs().max().item() for k in again) < 1e-6
    assert dgemma.load(out).generate(["def"], max_new_tokens=8, seed=0).sequences


def test_cli_errors_are_one_line(workdir, tmp_path, capsys):
    assert main(["train", "--config", "nope", "--data", "stdlib", "--out", str(tmp_path / "x")]) == 2
    assert "neither a preset" in capsys.readouterr().err
    assert (
        main(
            [
                "finetune",
                "--model",
                str(tmp_path / "missing"),
                "--data",
                str(workdir / "text"),
                "--out",
                str(tmp_path / "y"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.startswith("dgemma: error:") and err.count("\n") == 1
    assert (
        main(
            [
                "train",
                "--config",
                "test",
                "--data",
                str(tmp_path / "none"),
                "--out",
                str(tmp_path / "z"),
                "--tokenizer",
                str(workdir / "tokenizer.json"),
            ]
        )
        == 2
    )
    assert "does not exist" in capsys.readouterr().err


# ---------------------------------------------------------------- checkpoints in transformers


@pytest.mark.slow
@pytest.mark.parity
def test_train_cli_checkpoint_loads_and_generates_in_transformers(workdir, tmp_path):
    from transformers import DiffusionGemmaForBlockDiffusion

    out = tmp_path / "ckpt"
    cfg = tmp_path / "model.json"
    cfg.write_text(json.dumps({**PRESETS["test"], "canvas_length": 16}))
    assert (
        main(
            [
                "train",
                "--config",
                str(cfg),
                "--data",
                str(workdir / "text"),
                "--out",
                str(out),
                "--steps",
                "3",
                "--batch-size",
                "2",
                "--seq-len",
                "32",
                "--threads",
                "1",
            ]
        )
        == 0
    )
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert (out / name).exists(), name
    assert "chat_template" in json.loads((out / "tokenizer_config.json").read_text())

    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(out).eval()
    model = dgemma.load(out)
    prompt = torch.tensor([model.tokenizer.encode("def add(a, b):")])
    canvas = torch.randint(0, model.config.vocab_size, (1, 16))
    with torch.no_grad():
        expected = ref(input_ids=prompt, decoder_input_ids=canvas).logits
    assert (model.canvas_logits(prompt.tolist(), canvas) - expected).abs().max().item() < 1e-4
    torch.manual_seed(5)
    ref_out = ref.generate(prompt, max_new_tokens=32)
    got = model.generate(prompt.tolist(), max_new_tokens=32, sampling="reference", seed=5)
    want = []
    for t in ref_out.sequences[0, prompt.shape[1] : prompt.shape[1] + 32].tolist():
        want.append(t)
        if t in (1, 6):
            break
    assert got.sequences[0] == want


# ---------------------------------------------------------------- FSDP2 on two processes


@pytest.mark.slow
@pytest.mark.subprocess
def test_fsdp2_two_gloo_processes_stay_in_sync(workdir, tmp_path):
    common = dict(
        data=[str(workdir / "text")],
        config="test",
        tokenizer=str(workdir / "tokenizer.json"),
        steps=3,
        batch_size=2,
        seq_len=32,
        lr=1e-2,
        warmup=0,
        save_every=2,
        eval_every=3,
        eval_batches=1,
        eval_fraction=0.0,
        log_every=1,
        threads=1,
    )
    dist_out = tmp_path / "fsdp"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    worker = Path(__file__).parent / "fsdp_worker.py"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(worker),
        json.dumps({**common, "out": str(dist_out)}),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check = json.loads((dist_out / "fsdp_check.json").read_text())
    assert check["sharded"]
    assert check["fingerprints"][0] == check["fingerprints"][1]

    # The same global examples in one process (2 micro-batches per step) give the same model.
    single = train(TrainArgs(out=str(tmp_path / "single"), grad_accum=2, **common))
    assert single.last_losses["loss"] == pytest.approx(check["loss"], abs=1e-5)
    a, b = _weights(dist_out), _weights(tmp_path / "single")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4
    start = _weights(dist_out / "checkpoints" / "step-000002")
    assert max((a[k] - start[k]).abs().max().item() for k in a) > 1e-3  # training moved the weights


def test_bf16_autocast_trains(workdir, tmp_path):
    result = train(small_args(workdir, tmp_path / "bf16", steps=3, dtype="bfloat16", log_every=1))
    assert math.isfinite(result.last_losses["loss"]) and result.last_losses["loss"] > 0
    weights = _weights(tmp_path / "bf16")
    assert all(t.dtype == torch.float32 for t in weights.values())  # fp32 master weights


def test_a_warmup_longer_than_the_run_is_said_and_weights_are_0644(workdir, tmp_path, capsys):
    old = os.umask(0o022)
    try:
        assert (
            main(
                [
                    "train",
                    "--config",
                    "test",
                    "--data",
                    str(workdir / "text"),
                    "--out",
                    str(tmp_path / "w"),
                    "--tokenizer",
                    str(workdir / "tokenizer.json"),
                    "--steps",
                    "2",
                    "--warmup",
                    "5",
                    "--batch-size",
                    "2",
                    "--seq-len",
                    "32",
                    "--threads",
                    "1",
                ]
            )
            == 0
        )
        adapted = random_model(make_config(**PRESETS["test"]), seed=2)
        lora.apply_lora(adapted, rank=2, alpha=4)
        lora.save_adapters(adapted, tmp_path / "adapter")
    finally:
        os.umask(old)
    err = capsys.readouterr().err
    assert "warning: --warmup 5 is not below --steps 2" in err and "never to --lr" in err
    weights = [*(tmp_path / "w").rglob("*.safetensors"), tmp_path / "adapter" / "adapter_model.safetensors"]
    assert len(weights) > 1 and all(stat.S_IMODE(p.stat().st_mode) == 0o644 for p in weights)
