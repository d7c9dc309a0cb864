"""LoRA adapters in PEFT's format, both ways (issue 55, item 1): what dgemma writes, PEFT loads onto
transformers' DiffusionGemmaForBlockDiffusion with the same logits; what PEFT writes, dgemma loads
with the same logits; a file whose encoder and decoder copies differ is refused in one line; a file
in dgemma's older format still loads. Also: every path docs/training.md names exists."""

from __future__ import annotations

import importlib
import json
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import dgemma
from dgemma.train import lora
from oracle import build_reference

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[2]
ATTN_MLP = (
    r"model\.(?:decoder|encoder\.language_model)\.layers\.\d+\."
    r"(?:self_attn\.(?:q_proj|k_proj|v_proj|o_proj)|mlp\.(?:gate_proj|up_proj|down_proj))"
)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A random GQA reference checkpoint (sliding and K=V global layers, 4 experts), float32."""
    path = tmp_path_factory.mktemp("peft") / "base"
    build_reference(path, "gqa", seed=3)
    return path


def _inputs(model, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, model.config.vocab_size, (2, 11), generator=g)
    canvas = torch.randint(0, model.config.vocab_size, (2, model.config.canvas_length), generator=g)
    return prompt, canvas


def _randomise(adapters: dict, seed: int) -> None:
    """Non-zero A and B (B starts at zero: an adapter that changes nothing would prove nothing)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in adapters.values():
            m.A.normal_(0, 0.3, generator=g)
            m.B.normal_(0, 0.3, generator=g)


def _reference(path: Path):
    from transformers import DiffusionGemmaForBlockDiffusion

    return DiffusionGemmaForBlockDiffusion.from_pretrained(path).eval()


def _dgemma_adapted(base: Path, tmp_path: Path, rank: int = 4, alpha: float = 6.0, targets="attention,mlp"):
    """dgemma's model of `base` with random adapters, its logits, and the adapters written to tmp_path/ad."""
    model = dgemma.load(base, dtype="float32")
    prompt, canvas = _inputs(model)
    plain = model.canvas_logits(prompt.tolist(), canvas)
    lora.apply_lora(model.net, rank, alpha, targets)
    _randomise(lora.adapters(model.net), seed=1)
    model.reset_engine_net()
    adapted = model.canvas_logits(prompt.tolist(), canvas)
    assert (adapted - plain).abs().max().item() > 1e-2  # the adapters change the outputs
    lora.save_adapters(model.net, tmp_path / "ad", base_model=str(base))
    return model, adapted, (prompt, canvas)


# ------------------------------------------------------------------ what dgemma writes


@pytest.mark.parity
def test_written_config_and_keys_are_peft_s(base, tmp_path):
    model, _, _ = _dgemma_adapted(base, tmp_path)
    cfg = json.loads((tmp_path / "ad" / lora.ADAPTER_CONFIG).read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 6
    assert cfg["base_model_name_or_path"] == str(base) and cfg["target_modules"] == ATTN_MLP
    keys = load_file(str(tmp_path / "ad" / lora.ADAPTER_WEIGHTS)).keys()
    adapted = lora.adapters(model.net)
    assert len(keys) == 2 * 2 * len(adapted)  # A and B, for the decoder and the encoder
    for name in adapted:
        for stack in ("model.decoder.", "model.encoder.language_model."):
            assert f"base_model.model.{stack}{name}.lora_A.weight" in keys

    # the pattern, full-matched as PEFT does, picks the adapted text Linears of both stacks and nothing else
    ref = _reference(base)
    matched = {n for n, _ in ref.named_modules() if re.fullmatch(cfg["target_modules"], n)}
    want = {stack + name for name in adapted for stack in ("model.decoder.", "model.encoder.language_model.")}
    assert matched == want
    assert any("vision_tower" in n and n.endswith("q_proj") for n, _ in ref.named_modules())  # there to miss

    # a subset of layers names them; a module only some layers have (v_proj: not on K=V layers) stays \d+
    sub = lora.target_pattern(["layers.1.mlp.up_proj", "layers.3.mlp.up_proj", "layers.0.self_attn.v_proj"])
    assert re.fullmatch(sub, "model.encoder.language_model.layers.3.mlp.up_proj")
    assert not re.fullmatch(sub, "model.decoder.layers.2.mlp.up_proj")
    assert not re.fullmatch(sub, "model.decoder.layers.13.mlp.up_proj")


@pytest.mark.slow
@pytest.mark.parity
def test_peft_loads_what_dgemma_writes(base, tmp_path):
    from peft import PeftModel

    _, adapted, (prompt, canvas) = _dgemma_adapted(base, tmp_path, rank=4, alpha=6.0)
    ref = _reference(base)
    with torch.no_grad():
        plain = ref(input_ids=prompt, decoder_input_ids=canvas).logits
    peft_model = PeftModel.from_pretrained(ref, tmp_path / "ad").eval()
    wrapped = [n for n, m in peft_model.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A]
    assert len(wrapped) * 2 == len(load_file(str(tmp_path / "ad" / lora.ADAPTER_WEIGHTS)))  # each key used once
    assert not any("vision" in n for n in wrapped)
    with torch.no_grad():
        expected = peft_model(input_ids=prompt, decoder_input_ids=canvas).logits
    assert (expected - plain).abs().max().item() > 1e-2
    assert (adapted - expected).abs().max().item() < 1e-4


# ------------------------------------------------------------------ what PEFT writes


def _peft_adapter(base: Path, out: Path, tie: bool = True, use_rslora: bool = False):
    """A LoRA made by PEFT on transformers' model, random non-zero, the encoder's copies tied to the
    decoder's (as a run meant for dgemma trains them), saved with save_pretrained; returns the PEFT model."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=3, lora_alpha=5, target_modules=ATTN_MLP, lora_dropout=0.0, use_rslora=use_rslora)
    peft_model = get_peft_model(_reference(base), config)
    modules = dict(peft_model.base_model.model.named_modules())
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, m in modules.items():
            if name.startswith("model.decoder.layers.") and hasattr(m, "lora_A"):
                m.lora_A["default"].weight.normal_(0, 0.3, generator=g)
                m.lora_B["default"].weight.normal_(0, 0.3, generator=g)
                twin = modules[name.replace("model.decoder.", "model.encoder.language_model.", 1)]
                if tie:
                    twin.lora_A["default"], twin.lora_B["default"] = m.lora_A["default"], m.lora_B["default"]
    peft_model.save_pretrained(out)
    return peft_model.eval()


@pytest.mark.slow
@pytest.mark.parity
@pytest.mark.parametrize("use_rslora", [False, True])  # rsLoRA: scale alpha / sqrt(r), not alpha / r
def test_dgemma_loads_what_peft_writes(base, tmp_path, use_rslora):
    peft_model = _peft_adapter(base, tmp_path / "ad", use_rslora=use_rslora)
    model = dgemma.load(base, dtype="float32")
    prompt, canvas = _inputs(model, seed=2)
    plain = model.canvas_logits(prompt.tolist(), canvas)
    names = model.load_adapters(tmp_path / "ad")
    assert len(names) == 5 * 7 + 6  # 5 sliding layers with v_proj, 1 K=V global layer without
    scale = 5 / 3**0.5 if use_rslora else 5 / 3
    assert model.net.lora_config["r"] == 3 and lora.adapters(model.net)[names[0]].scale == pytest.approx(scale)
    with torch.no_grad():
        expected = peft_model(input_ids=prompt, decoder_input_ids=canvas).logits
    got = model.canvas_logits(prompt.tolist(), canvas)
    assert (got - plain).abs().max().item() > 1e-2
    assert (got - expected).abs().max().item() < 1e-4
    # generation runs the adapters too (the engine's network keeps hooked modules)
    assert model.generate(prompt[:1].tolist(), max_new_tokens=4, seed=0).sequences


def test_differing_encoder_and_decoder_sets_are_refused(base, tmp_path):
    _dgemma_adapted(base, tmp_path)
    weights = tmp_path / "ad" / lora.ADAPTER_WEIGHTS
    tensors = load_file(str(weights))
    key = "base_model.model.model.encoder.language_model.layers.2.mlp.up_proj.lora_B.weight"
    tensors[key] = tensors[key] + 1e-3
    save_file(tensors, str(weights))
    model = dgemma.load(base, dtype="float32")
    with pytest.raises(lora.AdapterError) as e:
        model.load_adapters(tmp_path / "ad")
    assert "\n" not in str(e.value) and key in str(e.value) and "not equal" in str(e.value)
    assert not lora.adapters(model.net)  # nothing attached

    del tensors[key]  # one copy missing: refused too, naming the key that has no twin
    save_file(tensors, str(weights))
    with pytest.raises(ValueError, match=re.escape(key.replace("encoder.language_model", "decoder"))):
        lora.load_adapters(model.net, tmp_path / "ad")

    stray = "base_model.model.model.encoder.vision_tower.encoder.layers.0.self_attn.q_proj.linear.lora_A.weight"
    save_file({**tensors, stray: torch.ones(4, 8)}, str(weights))  # a module dgemma does not adapt
    with pytest.raises(ValueError, match=re.escape(stray) + " is not a LoRA A or B matrix of a text layer"):
        lora.load_adapters(model.net, tmp_path / "ad")

    cfg = json.loads((tmp_path / "ad" / lora.ADAPTER_CONFIG).read_text())
    (tmp_path / "ad" / lora.ADAPTER_CONFIG).write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora"):
        lora.load_adapters(model.net, tmp_path / "ad")


@pytest.mark.slow
@pytest.mark.parity
def test_untied_peft_adapter_is_refused(base, tmp_path):
    _peft_adapter(base, tmp_path / "ad", tie=False)
    with pytest.raises(lora.AdapterError, match=r"^\S+: the encoder's and decoder's adapters are not equal at \S+"):
        dgemma.load(base, dtype="float32").load_adapters(tmp_path / "ad")


# ------------------------------------------------------------------ dgemma's older format


def test_old_dgemma_format_still_loads(base, tmp_path):
    """The format dgemma wrote before: its own key names and config (`format: dgemma-lora`)."""
    model, adapted, (prompt, canvas) = _dgemma_adapted(base, tmp_path, rank=2, alpha=3.0, targets="attention")
    old = tmp_path / "old"
    old.mkdir()
    tensors = lora.adapter_state_dict(model.net)
    assert all(k.startswith("layers.") for k in tensors)
    save_file(tensors, str(old / lora.ADAPTER_WEIGHTS))
    config = {"format": "dgemma-lora", "r": 2, "lora_alpha": 3.0, "target_modules": sorted(lora.adapters(model.net))}
    (old / lora.ADAPTER_CONFIG).write_text(json.dumps({**config, "base_model": str(base)}))
    fresh = dgemma.load(base, dtype="float32")
    fresh.load_adapters(old)
    assert torch.equal(fresh.canvas_logits(prompt.tolist(), canvas), adapted)
    # ... and saved again, it is in PEFT's format and gives the same logits
    lora.save_adapters(fresh.net, tmp_path / "again")
    assert json.loads((tmp_path / "again" / lora.ADAPTER_CONFIG).read_text())["peft_type"] == "LORA"
    again = dgemma.load(base, dtype="float32")
    again.load_adapters(tmp_path / "again")
    assert torch.equal(again.canvas_logits(prompt.tolist(), canvas), adapted)


def test_base_model_name_is_the_hub_id_of_a_cached_snapshot(tmp_path):
    snapshot = tmp_path / "hub" / "models--google--diffusiongemma-26B-A4B-it" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    assert lora.base_model_name(snapshot) == "google/diffusiongemma-26B-A4B-it"
    assert lora.base_model_name(tmp_path) == str(tmp_path.resolve())


# ------------------------------------------------------------------ the docs


def test_every_path_docs_training_names_exists():
    text = (ROOT / "docs" / "training.md").read_text()
    paths = set(re.findall(r"\b((?:dgemma|tests|scripts|docs)/[\w./-]+\.(?:py|md|json))\b", text))
    assert "dgemma/train/lora.py" in paths
    assert [p for p in paths if not (ROOT / p).exists()] == []
    # dotted names (dgemma.train.objective.training_losses, ...) resolve too
    names = set(re.findall(r"\b(dgemma(?:\.[A-Za-z_]\w*)+)\b", text))
    assert "dgemma.train.objective.training_losses" in names
    missing = []
    for name in names:
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
                break
            except ImportError:
                continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr, None)
        if obj is None:
            missing.append(name)
    assert missing == []


# ------------------------------------------------------------------ the trainer's checkpoints


@pytest.mark.slow
def test_lora_run_resumes_bit_identically_from_peft_checkpoints(tmp_path):
    """`dgemma finetune --lora-rank` checkpoints its adapters in PEFT's format, and a run resumed
    from one ends exactly where the uninterrupted run does."""
    from dgemma.model.checkpoint import make_tiny_random
    from dgemma.train.trainer import TrainArgs, train

    base = make_tiny_random(tmp_path / "base", seed=4)
    (tmp_path / "data.jsonl").write_text(
        "\n".join(json.dumps({"prompt": f"f{i}(", "completion": f"{i} + {i})"}) for i in range(12)) + "\n"
    )

    def run(out: Path, on_step=None) -> Path:
        args = dict(out=str(out), data=[str(tmp_path / "data.jsonl")], model=str(base), steps=4, batch_size=2)
        args.update(seq_len=24, lr=1e-2, warmup=0, save_every=2, eval_fraction=0.0, log_every=100, threads=1)
        train(TrainArgs(**args, lora_rank=2, merge=False), on_step=on_step)
        return out

    def crash(step: int, record: dict) -> None:
        if step == 3:  # a kill after step 3: the last checkpoint is step 2's
            raise RuntimeError("killed")

    full = run(tmp_path / "full")
    cfg = json.loads((full / "checkpoints" / "step-000002" / lora.ADAPTER_CONFIG).read_text())
    assert cfg["peft_type"] == "LORA" and cfg["base_model_name_or_path"] == str(base.resolve())
    with pytest.raises(RuntimeError, match="killed"):
        run(tmp_path / "cut", crash)
    run(tmp_path / "cut")  # resumes from step 2's checkpoint
    want, got = (load_file(str(p / lora.ADAPTER_WEIGHTS)) for p in (full, tmp_path / "cut"))
    assert want.keys() == got.keys() and all(k.startswith("base_model.model.model.") for k in want)
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert any(k.endswith("lora_B.weight") and want[k].abs().max() > 0 for k in want)  # it trained
