"""The shipped model, dgemma-tiny: present, small, the real architecture, and the default everywhere."""

import argparse
import json

import pytest
import torch

import dgemma
from dgemma.cli import main
from dgemma.cli.common import load_model

REQUIRED = (
    "config.json",
    "model.safetensors",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "MODEL_CARD.md",
)


def test_shipped_files_size_and_architecture():
    d = dgemma.default_model_dir()
    assert d.name == "dgemma-tiny" and d.parent.name == "assets"
    for name in REQUIRED:
        assert (d / name).is_file(), name
    assert (d / "model.safetensors").stat().st_size < 30_000_000
    model = dgemma.load()
    cfg = model.config
    kinds = {s.kind for s in cfg.layers}
    assert kinds == {"sliding_attention", "full_attention"}
    assert any(not s.has_v_proj for s in cfg.layers)  # global layers with V = K
    assert cfg.num_experts >= 4 and 1 < cfg.top_k_experts < cfg.num_experts
    assert model.tokenizer.token_to_id("<|turn>") == 5 and model.tokenizer.token_to_id("<turn|>") == 6
    assert "chat_template" in json.loads((d / "tokenizer_config.json").read_text())
    card = (d / "MODEL_CARD.md").read_text()
    for needle in ("dgemma train", "stdlib", "parameters", "tokens per forward"):
        assert needle in card, needle


@pytest.mark.slow
def test_shipped_model_is_the_default_and_writes_python(capsys):
    model = dgemma.load()
    assert model.path == dgemma.default_model_dir()
    out = model.generate(["def fibonacci(n):"], max_new_tokens=32, seed=0)
    text = model.tokenizer.decode(out.sequences[0])
    assert len(out.sequences[0]) > 0 and text.strip()
    assert out.tokens_per_forward[0] > 0
    args = argparse.Namespace(model=None, device="cpu", dtype="float32")
    assert load_model(args).path == dgemma.default_model_dir()  # what `dgemma serve` uses without --model
    assert main(["run", "def fibonacci(n):", "--max-new-tokens", "16", "--seed", "0"]) == 0
    assert capsys.readouterr().out.strip()


@pytest.mark.parity
def test_shipped_model_matches_transformers():
    from transformers import DiffusionGemmaForBlockDiffusion

    d = dgemma.default_model_dir()
    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(d, dtype=torch.float32).eval()
    model = dgemma.load(dtype="float32")  # the reference in float32 (the default is the stored bf16)
    prompt = [model.tokenizer.encode("def fibonacci(n):")]
    canvas = torch.randint(
        0, model.config.vocab_size, (1, model.config.canvas_length), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        expected = ref(input_ids=torch.tensor(prompt), decoder_input_ids=canvas).logits
    assert (model.canvas_logits(prompt, canvas) - expected).abs().max().item() < 1e-3
