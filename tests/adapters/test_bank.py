"""The adapter bank (dgemma/adapters/bank.py): what it reads, what it refuses (one line each, the bank
unchanged), its slots and content hashes."""

from __future__ import annotations

import json
import os

import pytest
import torch

from adapter_files import ATTENTION, adapter_tensors, write_adapter
from dgemma.adapters import AdapterBank, AdapterError, parse_lora_flag, read_adapter
from dgemma.model.checkpoint import make_config
from dgemma.model.presets import PRESETS
from dgemma.train import lora


@pytest.fixture(scope="module")
def config():
    return make_config(**PRESETS["test"])


@pytest.fixture
def bank(config):
    return AdapterBank(config, torch.device("cpu"), torch.float32, max_loras=2, max_rank=8)


def refused(fn, *args, match: str, **kwargs) -> str:
    """The one-line AdapterError `fn` raises."""
    with pytest.raises(AdapterError, match=match) as e:
        fn(*args, **kwargs)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_an_adapter_takes_a_slot_with_its_scale_folded_in(bank, config, tmp_path):
    path = write_adapter(tmp_path / "a", config, rank=4, alpha=8, seed=1)
    entry = bank.load("a", path)
    assert (entry.slot, entry.rank, bank.names) == (0, 4, ["a"])
    found = lora.read_adapters(path)
    name = "layers.1.self_attn.q_proj"
    a, b = found.tensors[f"{name}.lora_A.weight"], found.tensors[f"{name}.lora_B.weight"]
    assert torch.equal(bank.slots.a[name][0, :4], a)
    assert torch.allclose(bank.slots.b[name][0, :, :4], b * 2.0)  # alpha / r = 2
    assert bank.slots.a[name][0, 4:].abs().sum() == 0 and bank.slots.a[name][1].abs().sum() == 0
    bank.remove("a")
    assert bank.names == [] and bank.slots.a[name].abs().sum() == 0 and bank.slots.free_slot() == 0


def test_content_hash_follows_the_weights_not_the_name(bank, config, tmp_path):
    one = read_adapter("x", write_adapter(tmp_path / "one", config, seed=1), config)
    same = read_adapter("y", write_adapter(tmp_path / "same", config, seed=1), config)
    other = read_adapter("x", write_adapter(tmp_path / "other", config, seed=2), config)
    scaled = read_adapter("x", write_adapter(tmp_path / "scaled", config, seed=1, alpha=4), config)
    assert one.key == same.key and len({one.key, other.key, scaled.key}) == 3


def test_slots_full_and_taken_names_are_refused(bank, config, tmp_path):
    for i, name in enumerate("ab"):
        bank.load(name, write_adapter(tmp_path / name, config, seed=i))
    refused(bank.load, "a", tmp_path / "a", match="loaded already")
    refused(bank.load, "c", tmp_path / "a", match="all 2 adapter slots are taken")
    assert bank.names == ["a", "b"]


def test_rank_above_the_limit_is_refused(bank, config, tmp_path):
    path = write_adapter(tmp_path / "big", config, rank=16)
    refused(bank.load, "big", path, match=r"rank 16 is above the largest rank served here \(8, --max-lora-rank\)")
    assert bank.names == []


def test_shapes_of_another_base_are_refused(bank, config, tmp_path):
    other = make_config(**dict(PRESETS["test"], hidden_size=96))
    path = write_adapter(tmp_path / "other", other, rank=4)
    refused(bank.load, "other", path, match=r"layers\.0\.mlp\.down_proj has lora_A .*this base needs")


def test_targets_the_base_lacks_are_refused(bank, config, tmp_path):
    tensors = adapter_tensors(config, rank=2, sites=ATTENTION)
    tensors["layers.0.router.proj.lora_A.weight"] = torch.ones(2, config.hidden_size)
    tensors["layers.0.router.proj.lora_B.weight"] = torch.ones(config.num_experts, 2)
    lora.write_adapters(tmp_path / "router", tensors, 2, 4)
    refused(bank.load, "router", tmp_path / "router", match="targets layers.0.router.proj, which is not an attention")
    deep = make_config(**dict(PRESETS["test"], num_layers=5))
    lora.write_adapters(tmp_path / "deep", adapter_tensors(deep, rank=2, sites=("mlp.up_proj",)), 2, 4)
    refused(bank.load, "deep", tmp_path / "deep", match="layer 3, which the model does not have")
    # global layers have no v_proj: V is K's projection
    tensors = {"layers.2.self_attn.v_proj.lora_A.weight": torch.ones(2, 64)}
    tensors["layers.2.self_attn.v_proj.lora_B.weight"] = torch.ones(32, 2)
    lora.write_adapters(tmp_path / "v", tensors, 2, 4)
    refused(bank.load, "v", tmp_path / "v", match="global layers have no v_proj")


def test_missing_corrupt_and_non_finite_files_are_one_line_each(bank, config, tmp_path):
    refused(bank.load, "gone", tmp_path / "nowhere", match="does not exist")
    path = write_adapter(tmp_path / "a", config)
    (path / lora.ADAPTER_WEIGHTS).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    refused(bank.load, "corrupt", path, match="is not a readable safetensors file")
    (path / lora.ADAPTER_WEIGHTS).unlink()
    refused(bank.load, "half", path, match="adapter_model.safetensors is missing")
    write_adapter(tmp_path / "cfg", config)
    (tmp_path / "cfg" / lora.ADAPTER_CONFIG).write_text("{")
    refused(bank.load, "cfg", tmp_path / "cfg", match="not valid JSON")
    tensors = adapter_tensors(config, rank=2, sites=("mlp.up_proj",))
    tensors["layers.1.mlp.up_proj.lora_B.weight"][0, 0] = float("inf")
    lora.write_adapters(tmp_path / "nan", tensors, 2, 4)
    refused(bank.load, "nan", tmp_path / "nan", match="not finite")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / lora.ADAPTER_CONFIG).write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4}))
    torch.save({}, pickled / "adapter_model.bin")
    refused(bank.load, "pickled", pickled, match="adapter_model.safetensors is missing")  # never a pickle
    assert bank.names == []


def test_paths_outside_the_adapter_directory_are_refused(bank, config, tmp_path):
    root, outside = tmp_path / "loras", tmp_path / "elsewhere"
    root.mkdir()
    write_adapter(outside, config)
    write_adapter(root / "inside", config)
    refused(bank.load, "x", "../elsewhere", lora_dir=root, match="outside the adapter directory")
    refused(bank.load, "x", str(outside), lora_dir=root, match="outside the adapter directory")
    os.symlink(outside, root / "link")
    refused(bank.load, "x", "link", lora_dir=root, match="outside the adapter directory")
    refused(bank.load, "x", "owner/name", lora_dir=root, match="no adapter directory owner/name")
    assert bank.load("inside", "inside", lora_dir=root).slot == 0


def test_a_hub_id_while_offline_is_one_line(bank, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    message = refused(bank.load, "hub", "someone/some-adapter", match="HF_HUB_OFFLINE=1")
    assert message.startswith("adapter someone/some-adapter:")


def test_names_and_the_serve_flag(tmp_path):
    for bad in ("", "has space", "-dash", "x" * 129, "new\nline"):
        refused(parse_lora_flag, f"{bad}=/tmp/a", match="adapter name")
    assert parse_lora_flag("math=/tmp/a") == ("math", "/tmp/a")
    assert parse_lora_flag(str(tmp_path / "style")) == ("style", str(tmp_path / "style"))
