"""Fixture repos for the fake hub (tests/hub/fake_hub.py), as {path in repo: bytes}.

- `tiny_repo()`: the shipped dgemma-tiny as a hub repo lays out a release: two shards named by
  model.safetensors.index.json, config / generation config / tokenizer files, a README.md, and an
  `original/` weights file that a `*.safetensors` glob would also take (dgemma must not fetch it).
- One pre-quantised build per published layout, made from dgemma-tiny's weights (its dimensions, 8-12 MB each):
  `fp8_dynamic_repo()` (compressed-tensors FP8_DYNAMIC, RedHatAI's `...-FP8-dynamic`), `nvfp4_repo()`
  (compressed-tensors NVFP4, W4A4, RedHatAI's `...-NVFP4`) and `modelopt_nvfp4_repo()` (NVIDIA ModelOpt NVFP4).

The quantised builds take dgemma's own writer (`dgemma.quant.write.write_quantized`, compressed-tensors
names: experts per expert as vLLM's loader reads them, one nvfp4 global scale for what vLLM fuses) and
rewrite its output as each producer stores it:

- FP8-dynamic: config.json's `quantization_config`, compressed-tensors, format `float-quantized`, weights fp8 per
  channel, input activations fp8 dynamic per token; a module's `weight` (float8_e4m3fn) and `weight_scale` (bf16
  [out, 1]: the model dtype, as llm-compressor stores it).
- NVFP4 (compressed-tensors): format `nvfp4-pack-quantized`, weights and input activations fp4 `tensor_group` of 16
  (activations `dynamic: "local"`); `weight_packed` (uint8), `weight_scale` (fp8), `weight_global_scale` and
  `input_global_scale` (float32 [1]).
- NVFP4 (ModelOpt): hf_quant_config.json `{"producer", "quantization": {"quant_algo": "NVFP4", ...}}` and
  config.json's `quantization_config` with `quant_method: modelopt` (what ModelOpt's `convert_hf_quant_config_format`
  makes of it); `weight` (uint8), `weight_scale` (fp8), `weight_scale_2` (float32 [] = 1 / the global scale) and
  `input_scale` (float32 []).

The two compressed-tensors `quantization_config` blocks are, key for key, what compressed-tensors 0.20.1's
`ModelCompressor.update_config` writes for the presets FP8_DYNAMIC and NVFP4 with this `ignore` (compared once by
hand: importing the library takes ~10 s, too slow for these fixtures; tests/quant/test_quant_checkpoint.py checks dgemma's
own blocks against it). Both llm-compressor builds also ship llm-compressor's `recipe.yaml`. The `ignore` /
`exclude_modules` patterns are the fixtures' own (router, vision tower, self-conditioning, lm_head kept in bf16): no
published list was read byte for byte.
"""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load, load_file, save

from dgemma.loading import default_model_dir
from dgemma.model.layout import INDEX_FILE, natural_key
from dgemma.quant.write import write_quantized

TINY = default_model_dir()
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
ORIGINAL = "original/model-00001-of-00002.safetensors"  # a file dgemma must not fetch
TINY_SHARES = (0.6, 0.4)
FP8_ACTIVATIONS = {
    "dynamic": True,
    "group_size": None,
    "num_bits": 8,
    "strategy": "token",
    "symmetric": True,
    "type": "float",
}
NVFP4_ACTIVATIONS = {
    "dynamic": "local",
    "group_size": 16,
    "num_bits": 4,
    "observer": "static_minmax",
    "scale_dtype": "torch.float8_e4m3fn",
    "strategy": "tensor_group",
    "symmetric": True,
    "type": "float",
}
CT_IGNORE = ["lm_head", "re:.*router.*", "re:.*vision.*", "re:.*self_conditioning.*"]
MODELOPT_EXCLUDE = ["lm_head", "*router*", "*vision*", "*self_conditioning*"]
MODELOPT_PRODUCER = {"name": "modelopt", "version": "0.39.0"}
INPUT_SCALE = 0.02  # a calibrated activation scale stands here: dgemma does not quantise activations
RECIPE = """default_stage:
  default_modifiers:
    QuantizationModifier:
      targets: [Linear]
      ignore: {ignore}
      scheme: {scheme}
"""


# ---------------------------------------------------------------------------------------------------- helpers
def safetensors_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    return save({k: v.contiguous() for k, v in tensors.items()}, metadata=metadata or {"format": "pt"})


def shards(tensors: dict[str, torch.Tensor], shares: tuple[float, ...] = (0.5, 0.5)) -> dict[str, bytes]:
    """One shard per share of the bytes (model-0000k-of-0000n.safetensors, tensors in natural order) and the index."""
    names = sorted(tensors, key=natural_key)
    sizes = [tensors[n].numel() * tensors[n].element_size() for n in names]
    total, groups, filled = sum(sizes), [[] for _ in shares], 0
    ends = [sum(shares[: i + 1]) / sum(shares) * total for i in range(len(shares))]
    for name, size in zip(names, sizes):
        groups[next((i for i, end in enumerate(ends) if filled < end), len(shares) - 1)].append(name)
        filled += size
    files, weight_map = {}, {}
    for i, group in enumerate(groups):
        shard = f"model-{i + 1:05d}-of-{len(shares):05d}.safetensors"
        files[shard] = safetensors_bytes({n: tensors[n] for n in group})
        weight_map.update({n: shard for n in group})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    files[INDEX_FILE] = (json.dumps(index, indent=2) + "\n").encode()
    return files


def tensors_of(files: dict[str, bytes]) -> dict[str, torch.Tensor]:
    """Every tensor of a repo's weights (the shards its index names, or model.safetensors)."""
    if INDEX_FILE in files:
        names = sorted(set(json.loads(files[INDEX_FILE])["weight_map"].values()))
    else:
        names = ["model.safetensors"]
    out: dict[str, torch.Tensor] = {}
    for name in names:
        out.update(load(files[name]))
    return out


def _side_files(source: Path) -> dict[str, bytes]:
    files = {name: (source / name).read_bytes() for name in SIDE_FILES}
    card = source / "MODEL_CARD.md"
    files["README.md"] = card.read_bytes() if card.is_file() else b"# model\n"
    return files


def _json(payload: object) -> bytes:
    return (json.dumps(payload, indent=2) + "\n").encode()


# ---------------------------------------------------------------------------------------------------- the release
def tiny_repo(source: Path = TINY) -> dict[str, bytes]:
    """dgemma-tiny laid out as a hub release: 2 index-named shards, side files, README.md, `original/`.

    The first shard holds 60% of the bytes (11.4 MiB): more than huggingface_hub's 10 MiB download chunk, so a
    connection cut past the first chunk (`FakeHub.cut_next_get(..., after > 10 MiB)`) shows the client's Range
    resume; it resumes from the last whole chunk it wrote (an earlier cut makes it fetch the file again)."""
    tensors = load_file(str(source / "model.safetensors"))
    files = _side_files(source)
    files.update(shards(tensors, TINY_SHARES))
    first = load(files["model-00001-of-00002.safetensors"])
    files[ORIGINAL] = safetensors_bytes(first, {"format": "pt", "layout": "original"})  # not the shard's bytes
    return files


# ---------------------------------------------------------------------------------------------------- quantised
def _dgemma_quantized(scheme: str, source: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """dgemma's own quantised checkpoint of `source`: its config.json and its tensors (fresh containers each call)."""
    config_text, tensors = _written(scheme, source)
    return json.loads(config_text), dict(tensors)


@functools.lru_cache(maxsize=4)
def _written(scheme: str, source: Path) -> tuple[str, dict[str, torch.Tensor]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = write_quantized(source, Path(tmp) / "q", scheme)
        tensors = {k: v.clone() for k, v in load_file(str(out / "model.safetensors")).items()}
        return (out / "config.json").read_text(), tensors


def _modules_with(tensors: dict[str, torch.Tensor], part: str) -> list[str]:
    return sorted({n.rpartition(".")[0] for n in tensors if n.endswith("." + part)}, key=natural_key)


def fp8_dynamic_repo(source: Path = TINY) -> dict[str, bytes]:
    """compressed-tensors FP8_DYNAMIC as llm-compressor writes it (RedHatAI's `...-FP8-dynamic`)."""
    config, tensors = _dgemma_quantized("fp8", source)
    for module in _modules_with(tensors, "weight_scale"):
        tensors[f"{module}.weight_scale"] = tensors[f"{module}.weight_scale"].to(torch.bfloat16)
    block = config["quantization_config"]
    group = block["config_groups"]["group_0"]
    assert group["format"] == "float-quantized" and group["input_activations"] == FP8_ACTIVATIONS, group
    block["ignore"] = CT_IGNORE
    files = _side_files(source)
    files["config.json"] = _json(config)
    files["recipe.yaml"] = RECIPE.format(ignore=json.dumps(CT_IGNORE), scheme="FP8_DYNAMIC").encode()
    files.update(shards(tensors))
    return files


def nvfp4_repo(source: Path = TINY) -> dict[str, bytes]:
    """compressed-tensors NVFP4 (W4A4) as llm-compressor writes it (RedHatAI's `...-NVFP4`)."""
    config, tensors = _dgemma_quantized("nvfp4", source)
    for module in _modules_with(tensors, "weight_global_scale"):
        tensors[f"{module}.input_global_scale"] = torch.tensor([1.0 / INPUT_SCALE], dtype=torch.float32)
    block = config["quantization_config"]
    group = block["config_groups"]["group_0"]
    assert group["format"] == "nvfp4-pack-quantized", group
    group["input_activations"] = dict(NVFP4_ACTIVATIONS)
    block["ignore"] = CT_IGNORE
    files = _side_files(source)
    files["config.json"] = _json(config)
    files["recipe.yaml"] = RECIPE.format(ignore=json.dumps(CT_IGNORE), scheme="NVFP4").encode()
    files.update(shards(tensors))
    return files


def modelopt_nvfp4_repo(source: Path = TINY) -> dict[str, bytes]:
    """NVIDIA ModelOpt NVFP4 as its unified HF export writes it: hf_quant_config.json and config.json's block."""
    config, ct = _dgemma_quantized("nvfp4", source)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in ct.items():
        module, _, part = name.rpartition(".")
        if part == "weight_packed":
            tensors[f"{module}.weight"] = tensor
        elif part == "weight_global_scale":
            tensors[f"{module}.weight_scale_2"] = (1.0 / tensor.float()).reshape(())
            tensors[f"{module}.input_scale"] = torch.tensor(INPUT_SCALE, dtype=torch.float32)
        else:
            tensors[name] = tensor
    hf_quant_config = {
        "producer": MODELOPT_PRODUCER,
        "quantization": {
            "quant_algo": "NVFP4",
            "kv_cache_quant_algo": None,
            "group_size": 16,
            "exclude_modules": MODELOPT_EXCLUDE,
        },
    }
    fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    config["quantization_config"] = {
        "config_groups": {"group_0": {"input_activations": dict(fp4), "weights": dict(fp4), "targets": ["Linear"]}},
        "ignore": MODELOPT_EXCLUDE,
        "quant_algo": "NVFP4",
        "producer": MODELOPT_PRODUCER,
        "quant_method": "modelopt",
    }
    files = _side_files(source)
    files["config.json"] = _json(config)
    files["hf_quant_config.json"] = _json(hf_quant_config)
    files.update(shards(tensors))
    return files


# layout -> (a repo id in the producer's naming, the builder, dgemma's scheme for it)
QUANTIZED_REPOS = {
    "fp8-dynamic": ("RedHatAI/dgemma-tiny-FP8-dynamic", fp8_dynamic_repo, "fp8"),
    "nvfp4": ("RedHatAI/dgemma-tiny-NVFP4", nvfp4_repo, "nvfp4"),
    "modelopt-nvfp4": ("nvidia/dgemma-tiny-NVFP4", modelopt_nvfp4_repo, "nvfp4"),
}
