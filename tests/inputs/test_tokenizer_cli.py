"""Tokenizer and chat template, the CLI, checkpoints written by dgemma, and no transformers at run time."""

import json
import subprocess
import sys

import pytest
import torch

import dgemma
from dgemma.cli import main
from dgemma.inputs.tokenizer import ChatTemplateError
from dgemma.model.checkpoint import make_tiny_random


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_random(tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)


def test_tokenizer_roundtrip_and_bos(tiny):
    tok = dgemma.load(tiny).tokenizer
    ids = tok.encode("def f(x):\n    return x  # é ✓")
    assert ids[0] == tok.bos_token_id == 2
    assert tok.decode(ids) == "def f(x):\n    return x  # é ✓"


def test_chat_template_default_and_overrides(tiny, tmp_path):
    tok = dgemma.load(tiny).tokenizer
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == "<bos><|turn>system\nbe brief<turn|>\n<|turn>user\nhi<turn|>\n<|turn>model\n"
    ids = tok.apply_chat_template(msgs)
    assert ids[0] == 2 and ids.count(tok.token_to_id("<|turn>")) == 3 and ids.count(tok.token_to_id("<turn|>")) == 2
    assert tok.decode(ids, skip_special_tokens=False) == text
    # a template in chat_template.jinja wins over tokenizer_config.json
    import shutil

    d = shutil.copytree(tiny, tmp_path / "t")
    (d / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}")
    assert dgemma.load(d).tokenizer.apply_chat_template(msgs, tokenize=False) == "[system]be brief[user]hi"
    with pytest.raises(ChatTemplateError, match="content"):
        tok.apply_chat_template([{"role": "user"}])


@pytest.mark.slow
def test_cli_run_prints_completion(tiny, capsys):
    assert main(["run", "--model", str(tiny), "def fibonacci(n):", "--max-new-tokens", "40", "--seed", "0"]) == 0
    out = capsys.readouterr().out
    model = dgemma.load(tiny)
    expected = model.generate([model.tokenizer.encode("def fibonacci(n):")], max_new_tokens=40, seed=0)
    assert out == model.tokenizer.decode(expected.sequences[0]) + "\n"
    assert main(["run", "--model", str(tiny), "hi", "--chat", "--show-canvas", "--max-new-tokens", "8"]) == 0
    assert main(["run", "--model", str(tiny), "hi", "--mode", "ar", "--max-new-tokens", "5"]) == 0


def test_cli_errors_are_one_line(tiny, tmp_path, capsys):
    assert main(["run", "--model", str(tmp_path / "nope"), "x"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["run", "--model", str(tiny), "x", "--steps", "0"]) == 2
    assert "--steps must be a positive integer" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parity
def test_dgemma_checkpoint_loads_in_transformers(tiny):
    from transformers import DiffusionGemmaForBlockDiffusion

    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(tiny).eval()
    model = dgemma.load(tiny)
    prompt, canvas = torch.tensor([[2, 50, 60, 70]]), torch.randint(0, 384, (1, 32))
    with torch.no_grad():
        expected = ref(input_ids=prompt, decoder_input_ids=canvas).logits
    assert (model.canvas_logits(prompt.tolist(), canvas) - expected).abs().max().item() < 1e-4
    torch.manual_seed(1)
    ref_out = ref.generate(prompt, max_new_tokens=40)
    got = model.generate(prompt.tolist(), max_new_tokens=40, sampling="reference", seed=1)
    want = []
    for t in ref_out.sequences[0, 4:44].tolist():
        want.append(t)
        if t in (1, 6):
            break
    assert got.sequences[0] == want


@pytest.mark.slow
@pytest.mark.subprocess
def test_runtime_never_imports_transformers(tiny):
    # nor torch._dynamo: ~2 s of every process's start (a meta-device normal_ imported it)
    code = (
        "import sys, dgemma; m = dgemma.load(sys.argv[1]); m.generate(['x'], max_new_tokens=4, seed=0);"
        "import dgemma.cli; assert 'transformers' not in sys.modules, 'transformers imported';"
        "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo imported'"
    )
    subprocess.run([sys.executable, "-c", code, str(tiny)], check=True)
    cfg = json.loads((tiny / "config.json").read_text())
    assert cfg["text_config"]["per_layer_config"]


@pytest.mark.slow
def test_encoding_a_long_text_lets_other_threads_run():
    """tokenizers' encode holds the GIL for the whole text (a server's other requests and /health
    stop); dgemma's Tokenizer encodes through encode_batch, which releases it."""
    import threading
    import time

    from dgemma.inputs.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(dgemma.default_model_dir())
    text = "def f(x):\n    return x + 1\n" * 40_000  # ~1 MB: about a second of work
    ticks, done = [], threading.Event()

    def encode():
        tok.encode(text)
        done.set()

    worker = threading.Thread(target=encode)
    started = time.monotonic()
    worker.start()
    while not done.is_set():
        ticks.append(time.monotonic())
        time.sleep(0.005)
    worker.join()
    elapsed = time.monotonic() - started
    gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    assert elapsed > 0.2 and len(ticks) > 10  # this thread ran while the text was encoded
    assert max(gaps, default=0) < elapsed / 2
    assert tok.max_token_chars >= max(len(t) for t in tok._tok.get_vocab())
