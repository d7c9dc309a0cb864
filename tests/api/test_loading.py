"""Config forms, generation defaults, dtypes, and loader errors that name the problem."""

import json
import shutil

import pytest
import torch

import dgemma
from dgemma.config import ConfigError, load_generation_config, load_model_config
from dgemma.model.layout import WeightsError


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _to_released_form(path):
    """Rewrite config.json the way the released checkpoint spells the global-layer geometry."""
    cfg = json.loads((path / "config.json").read_text())
    text = cfg["text_config"]
    per_layer = text.pop("per_layer_config")
    first = next(iter(per_layer.values()))
    text["global_head_dim"] = first["head_dim"]
    text["num_global_key_value_heads"] = first["num_key_value_heads"]
    text["attention_k_eq_v"] = True
    text.pop("final_logit_softcapping", None)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parity
def test_released_and_saved_config_forms_agree(ref_gqa, tmp_path):
    path, ref = ref_gqa
    released = _copy(path, tmp_path / "released")
    _to_released_form(released)
    a, b = load_model_config(path), load_model_config(released)
    assert a.layers == b.layers and b.final_logit_softcapping == 30.0
    from transformers import DiffusionGemmaForBlockDiffusion

    ref_released = DiffusionGemmaForBlockDiffusion.from_pretrained(released).eval()
    prompt, canvas = torch.tensor([[3, 4, 5, 6]]), torch.tensor([[9] * 8])
    with torch.no_grad():
        expected = ref_released(input_ids=prompt, decoder_input_ids=canvas).logits
    got = dgemma.load(released).canvas_logits(prompt.tolist(), canvas)
    assert (got - expected).abs().max().item() < 1e-4


def test_generation_config_nulls_take_reference_defaults(tmp_path, ref_gqa):
    d = _copy(ref_gqa[0], tmp_path / "g")
    (d / "generation_config.json").write_text(
        json.dumps({"max_denoising_steps": None, "sampler_config": None, "t_min": None, "eos_token_id": [1, 106, 50]})
    )
    g = load_generation_config(d)
    assert (g.max_denoising_steps, g.entropy_bound, g.t_min, g.t_max) == (48, 0.1, 0.4, 0.8)
    assert (g.stability_threshold, g.confidence_threshold, g.max_new_tokens) == (1, 0.005, 256)
    assert g.eos_token_ids == (1, 106, 50)
    (d / "generation_config.json").write_text(json.dumps({"sampler_config": {"entropy_bound": 0.3}, "t_max": 1.0}))
    g = load_generation_config(d)
    assert g.entropy_bound == 0.3 and g.t_max == 1.0
    (d / "generation_config.json").unlink()
    assert load_generation_config(d).max_denoising_steps == 48


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda c: c.update(model_type="llama"), "unsupported model_type 'llama'"),
        (lambda c: c["text_config"].pop("hidden_size"), "missing the required field 'hidden_size'"),
        (lambda c: c.pop("text_config"), "text_config"),
        (lambda c: c["text_config"].update(num_experts="eight"), "'num_experts' must be an integer"),
        (lambda c: c["text_config"].update(use_bidirectional_attention="all"), "bidirectional"),
    ],
)
def test_bad_config_is_named(tmp_path, ref_gqa, mutate, message):
    d = _copy(ref_gqa[0], tmp_path / "c")
    cfg = json.loads((d / "config.json").read_text())
    mutate(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=message):
        dgemma.load(d)


def test_corrupt_json_is_named(tmp_path, ref_gqa):
    d = _copy(ref_gqa[0], tmp_path / "j")
    (d / "config.json").write_text('{"model_type": "diffusion_gemma", ')
    with pytest.raises(ConfigError, match="config.json is not valid JSON"):
        dgemma.load(d)
    d2 = _copy(ref_gqa[0], tmp_path / "j2")
    (d2 / "generation_config.json").write_text("[1, 2")
    with pytest.raises(ConfigError, match="generation_config.json is not valid JSON"):
        dgemma.load(d2)
    d3 = _copy(ref_gqa[0], tmp_path / "j3")
    (d3 / "generation_config.json").write_text(json.dumps({"max_denoising_steps": -4}))
    with pytest.raises(ConfigError, match="max_denoising_steps must be a positive integer"):
        dgemma.load(d3)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, ref_gqa):
    path = tmp_path_factory.mktemp("sharded")
    ref_gqa[1].save_pretrained(path, max_shard_size="150KB")
    shutil.copy(ref_gqa[0] / "generation_config.json", path / "generation_config.json")
    assert (path / "model.safetensors.index.json").exists()
    return path


def test_sharded_checkpoint_loads(sharded, ref_gqa):
    a = dgemma.load(sharded).canvas_logits([[1, 2, 3]], [[4] * 8])
    b = dgemma.load(ref_gqa[0]).canvas_logits([[1, 2, 3]], [[4] * 8])
    # equal up to rounding: CPU kernels take alignment-dependent paths, and tensors sit at other offsets
    assert (a - b).abs().max().item() < 1e-4


def test_missing_shard_is_named(sharded, tmp_path):
    d = _copy(sharded, tmp_path / "s")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (d / shard).unlink()
    with pytest.raises(WeightsError, match=f"missing shard {shard}"):
        dgemma.load(d)


def _rewrite_weights(src, dst, edit):
    from safetensors.torch import load_file, save_file

    d = _copy(src, dst)
    tensors = load_file(d / "model.safetensors")
    edit(tensors)
    save_file(tensors, d / "model.safetensors")
    return d


def test_missing_tensor_is_named(ref_gqa, tmp_path):
    name = "model.decoder.layers.2.mlp.up_proj.weight"
    d = _rewrite_weights(ref_gqa[0], tmp_path / "m", lambda t: t.pop(name))
    with pytest.raises(WeightsError, match=f"missing tensor {name}"):
        dgemma.load(d)
    scalar = "model.encoder.language_model.layers.4.layer_scalar"
    d = _rewrite_weights(ref_gqa[0], tmp_path / "m2", lambda t: t.pop(scalar))
    with pytest.raises(WeightsError, match=f"missing tensor {scalar}"):
        dgemma.load(d)


def test_misshapen_tensor_is_named(ref_gqa, tmp_path):
    name = "model.decoder.layers.5.experts.gate_up_proj"

    def edit(t):
        t[name] = t[name][:, :-2].contiguous()

    d = _rewrite_weights(ref_gqa[0], tmp_path / "w", edit)
    with pytest.raises(WeightsError, match=f"tensor {name} has shape"):
        dgemma.load(d)


def test_no_weights_is_named(ref_gqa, tmp_path):
    d = _copy(ref_gqa[0], tmp_path / "n")
    (d / "model.safetensors").unlink()
    with pytest.raises(WeightsError, match="no weights"):
        dgemma.load(d)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_loads_and_tracks_float32(ref_gqa, dtype):
    full = dgemma.load(ref_gqa[0])
    half = dgemma.load(ref_gqa[0], dtype=dtype)
    assert half.net.embed_tokens.weight.dtype == getattr(torch, dtype)
    a = full.canvas_logits([[5, 6, 7, 8]], [[9, 10, 11, 12, 13, 14, 15, 16]])
    b = half.canvas_logits([[5, 6, 7, 8]], [[9, 10, 11, 12, 13, 14, 15, 16]])
    assert b.dtype == torch.float32
    assert torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1] > 0.97
    assert len(half.generate([[5, 6, 7]], max_new_tokens=10, seed=0).sequences[0]) >= 1


def test_bad_device_and_dtype(ref_gqa):
    with pytest.raises(ValueError, match="dtype"):
        dgemma.load(ref_gqa[0], dtype="int8")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            dgemma.load(ref_gqa[0], device="cuda")
