"""Quantised checkpoints (dgemma/quant/: write.py, read.py, quant_config.py, pack.py): what
`dgemma quantize` writes, decompressed by the compressed-tensors library itself, equals what dgemma
reads back; the library's own config block and layouts, ModelOpt's NVFP4, and every bad config's
one-line error."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import dgemma
from dgemma.cli import main
from dgemma.config import ConfigError
from dgemma.model.checkpoint import make_tiny_random
from dgemma.model.layout import WeightsError
from dgemma.quant.formats import SCHEMES, QuantError, dequantize, quantize
from dgemma.quant.modules import QuantExperts
from dgemma.quant.pack import QuantPartsError, split_rows
from dgemma.quant.quant_config import DISK_FORMATS, EMBEDDING_FORMATS, QuantConfigError, QuantGroup, quantization_config
from dgemma.quant.read import quantised_modules, read_quantized, to_qtensor
from dgemma.quant.tensor_sources import TensorReader

pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import BaseCompressor, ModelCompressor  # noqa: E402
from compressed_tensors.compressors.format import infer_module_format  # noqa: E402
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    preset_name_to_scheme,
)

GROUP = {"fp8": None, "int8": None, "int4": 32, "nvfp4": None}
EXPERT = re.compile(r"model\.decoder\.(layers\.\d+\.experts)\.(\d+)\.(gate|up|down)_proj")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_random(tmp_path_factory.mktemp("tiny") / "src")


def quantize_cli(src: Path, out: Path, scheme: str, *extra: str) -> Path:
    argv = ["quantize", "--model", str(src), "--scheme", scheme, "--out", str(out), "--shard-size", "100kB", *extra]
    if GROUP[scheme]:
        argv += ["--group-size", str(GROUP[scheme])]
    assert main(argv) == 0
    return out


@pytest.fixture(scope="module")
def written(tiny, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quantized")
    out = {s: quantize_cli(tiny, root / s, s) for s in SCHEMES}
    out["int4-bf16"] = quantize_cli(tiny, root / "int4-bf16", "int4", "--dtype", "bf16")  # bf16 group scales
    return out


def library_scheme(scheme: str, group_size: int | None) -> QuantizationScheme:
    """The library's scheme for dgemma's: FP8_DYNAMIC, W8A16 per channel, W4A16, NVFP4A16."""
    if scheme == "fp8":
        return preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])
    if scheme == "nvfp4":
        return preset_name_to_scheme("NVFP4A16", ["Linear"])
    args = QuantizationArgs(num_bits=8, type="int", strategy="channel", symmetric=True, dynamic=False)
    if scheme == "int4":
        args = QuantizationArgs(
            num_bits=4, type="int", strategy="group", group_size=group_size, symmetric=True, dynamic=False
        )
    return QuantizationScheme(targets=["Linear"], weights=args)


def quant_block(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())["quantization_config"]


def dgemma_weight(weights, module: str) -> torch.Tensor:
    """The dequantised weight of one module on disk, from what read_quantized returns (experts fused)."""
    m = EXPERT.fullmatch(module)
    if m is None:
        return dequantize(weights[module.removeprefix("model.decoder.") + ".weight"])
    experts, e, proj = m.group(1), int(m.group(2)), m.group(3)
    full = dequantize(weights[f"{experts}.{'down_proj' if proj == 'down' else 'gate_up_proj'}"].select(e))
    half = full.shape[0] // 2
    return full if proj == "down" else full[:half] if proj == "gate" else full[half:]


def library_decompress(path: Path, only: str = "") -> dict[str, torch.Tensor]:
    """The quantised modules' weights (those matching the regex `only`) as the library decompresses
    them, from the config it parses."""
    config = QuantizationConfig.model_validate(quant_block(path))
    reader = TensorReader(path)
    out = {}
    for module, parts in quantised_modules(list(reader.files)).items():
        if not re.search(only, module):
            continue
        kind = "Embedding" if module.endswith("embed_tokens") else "Linear"
        scheme = next(g for g in config.config_groups.values() if g.targets == [kind])
        compressor = BaseCompressor.get_value_from_registry(scheme.format or config.format)
        out[module] = compressor.decompress({p: reader.get(t) for p, t in parts.items()}, scheme)["weight"]
    return out


@pytest.mark.parity
@pytest.mark.parametrize("variant", [*SCHEMES, "int4-bf16"])
def test_library_decompression_equals_dgemma_dequantize(written, variant):
    path, scheme = written[variant], variant.split("-")[0]
    assert len(list(path.glob("model-*-of-*.safetensors"))) > 1  # sharded, with an index
    from transformers.utils.quantization_config import CompressedTensorsConfig

    CompressedTensorsConfig.from_dict({"quantization_config": quant_block(path)})  # transformers parses it too
    info, weights = read_quantized(path)
    assert (info.quant_method, info.format, info.scheme, info.group_size) == (
        "compressed-tensors",
        DISK_FORMATS[scheme],
        scheme,
        GROUP[scheme] or (16 if scheme == "nvfp4" else None),
    )
    lib = library_decompress(path, r"layers\.[05]\.")  # a sliding and the global layer
    assert len(lib) == 2 * (7 + 8 * 3) - 1  # attention, MLP and 8 experts (no v_proj on the global layer)
    for module, want in lib.items():
        # the library computes in the scales' dtype and rounds nvfp4's output to bfloat16
        assert torch.equal(dgemma_weight(weights, module).to(want.dtype), want), module
    if variant == "int4-bf16":
        assert weights["layers.0.experts.gate_up_proj"].parts["weight_scale"].dtype == torch.bfloat16


@pytest.mark.parametrize("scheme", SCHEMES)
def test_config_block_is_what_the_library_writes(tmp_path, scheme):
    ignore = ["model.decoder.layers.0.router.proj", "lm_head"]
    lib = library_scheme(scheme, GROUP[scheme])
    fmt = infer_module_format(torch.nn.Linear, lib).value  # the format the library picks for the scheme
    assert fmt == DISK_FORMATS[scheme]
    lib.format = fmt
    config = QuantizationConfig(
        config_groups={"group_0": lib}, format=fmt, quantization_status="compressed", ignore=ignore
    )
    (tmp_path / "config.json").write_text("{}")
    ModelCompressor(quantization_config=config).update_config(str(tmp_path))
    assert quantization_config(scheme, GROUP[scheme], ignore) == quant_block(tmp_path)


@pytest.mark.parametrize("embeddings", ["int8", "fp8"])
def test_quantised_embeddings(tiny, tmp_path, embeddings):
    path = quantize_cli(tiny, tmp_path / "q", "nvfp4", "--quantize-embeddings", embeddings)
    block = quant_block(path)
    emb = QuantizationConfig.model_validate(block).config_groups["group_1"]
    assert (
        emb.targets == ["Embedding"]
        and infer_module_format(torch.nn.Embedding, emb).value == EMBEDDING_FORMATS[embeddings]
    )
    assert block["format"] == "mixed-precision"
    info, weights = read_quantized(path)
    assert {g.scheme for g in info.groups} == {"nvfp4", embeddings}
    want = library_decompress(path, "embed_tokens")["model.decoder.embed_tokens"]
    assert torch.equal(dequantize(weights["embed_tokens.weight"]), want)
    table = TensorReader(tiny).get("model.decoder.embed_tokens.weight")
    assert torch.equal(dequantize(weights["embed_tokens.weight"]), dequantize(quantize(table, embeddings)))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_experts_unfused_on_disk_fused_on_load(tiny, written, scheme):
    path, source = written[scheme], TensorReader(tiny)
    names = set(TensorReader(path).files)
    assert not any("experts.gate_up_proj" in n or "experts.down_proj" in n for n in names)
    assert {
        "model.decoder.layers.2.experts.7.gate_proj.weight_scale",
        "model.decoder.layers.2.experts.7.up_proj.weight_scale",
        "model.decoder.layers.2.experts.7.down_proj.weight_scale",
    } <= names
    _, weights = read_quantized(path)
    for name in ("layers.2.experts.gate_up_proj", "layers.2.experts.down_proj"):
        # the same parts, bit for bit, as quantising the fused tensor while loading
        want = quantize(source.get("model.decoder." + name), scheme, GROUP[scheme])
        got = weights[name]
        assert got.shape == want.shape and got.group_size == want.group_size
        assert got.parts.keys() == want.parts.keys() and all(
            torch.equal(got.parts[k], want.parts[k]) for k in want.parts
        ), name
    q, k, v = (weights[f"layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    if scheme == "nvfp4":  # one global scale for what vLLM fuses
        assert torch.equal(q.parts["weight_global_scale"], k.parts["weight_global_scale"])
        assert torch.equal(q.parts["weight_global_scale"], v.parts["weight_global_scale"])
    else:  # per-row scales: the same as quantising each on its own
        alone = quantize(source.get("model.decoder.layers.0.self_attn.k_proj.weight"), scheme, GROUP[scheme])
        assert torch.equal(dequantize(k), dequantize(alone))


@pytest.mark.parametrize("scheme", ["int4", "nvfp4"])
def test_fused_experts_on_disk_are_read_as_they_are(tiny, written, tmp_path, scheme):
    """A writer that keeps experts fused ([E, 2I, H] parts under `experts.gate_up_proj.<part>`)."""
    tensors = {n: t for n, t in all_tensors(written[scheme]).items() if ".experts." not in n}
    source = TensorReader(tiny)
    for name in ("model.decoder.layers.0.experts.gate_up_proj", "model.decoder.layers.0.experts.down_proj"):
        tensors.update({f"{name}.{k}": v for k, v in quantize(source.get(name), scheme, GROUP[scheme]).parts.items()})
    path = write_checkpoint(tmp_path / "fused", tensors, base_config(written[scheme]), quant_block(written[scheme]))
    _, weights = read_quantized(path)
    assert sorted(n for n in weights if "experts" in n) == [
        "layers.0.experts.down_proj",
        "layers.0.experts.gate_up_proj",
    ]
    for name in ("layers.0.experts.gate_up_proj", "layers.0.experts.down_proj"):
        want = quantize(source.get("model.decoder." + name), scheme, GROUP[scheme])
        assert weights[name].shape == want.shape and torch.equal(dequantize(weights[name]), dequantize(want))


def test_kept_tensors_and_the_ignore_list(tmp_path):
    """Against transformers' own model of a checkpoint with a vision tower: every nn.Linear not
    quantised is on the ignore list (under its checkpoint name), and kept tensors are unchanged."""
    from vision_checkpoint import write_vision_checkpoint

    model = write_vision_checkpoint(tmp_path / "src", processor=False)
    path = quantize_cli(tmp_path / "src", tmp_path / "q", "fp8")
    linears = {
        n.replace("model.encoder.language_model.", "model.decoder.")  # the text stack is tied, stored as the decoder
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
    }
    targets = re.compile(r"model\.decoder\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)")
    quantised = {m for m in linears if targets.fullmatch(m)}
    assert set(quant_block(path)["ignore"]) == linears - quantised
    assert any("vision_tower" in n for n in quant_block(path)["ignore"])
    source, out = TensorReader(tmp_path / "src"), TensorReader(path)
    kept = [n for n in source.files if n in out.files and f"{n.rpartition('.')[0]}.weight_scale" not in out.files]
    assert any("vision_tower" in n for n in kept) and any("router.proj" in n for n in kept)
    assert all(torch.equal(source.get(n), out.get(n)) for n in kept)
    _, weights = read_quantized(path)
    assert not any("vision" in n for n in weights)


def write_checkpoint(path: Path, tensors: dict[str, torch.Tensor], config: dict, block: dict | None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(dict(config, **({"quantization_config": block} if block else {}))))
    return path


def all_tensors(path: Path) -> dict[str, torch.Tensor]:
    reader = TensorReader(path)
    return {n: reader.get(n) for n in reader.files}


def base_config(path: Path) -> dict:
    config = json.loads((path / "config.json").read_text())
    config.pop("quantization_config", None)
    return config


def library_compressed(tiny: Path, scheme_name: str, scheme: QuantizationScheme) -> dict[str, torch.Tensor]:
    """Layer 0's q_proj and experts (per expert, vLLM's names) compressed by the library's own
    compressor from bf16 weights and scales (int64 weight_shape, bf16 scales: as llm-compressor saves)."""
    source, out = TensorReader(tiny), {}
    weights = {"model.decoder.layers.0.self_attn.q_proj": source.get("model.decoder.layers.0.self_attn.q_proj.weight")}
    gate_up, down = (source.get(f"model.decoder.layers.0.experts.{p}") for p in ("gate_up_proj", "down_proj"))
    half = gate_up.shape[1] // 2
    for e in range(gate_up.shape[0]):
        weights[f"model.decoder.layers.0.experts.{e}.gate_proj"] = gate_up[e, :half]
        weights[f"model.decoder.layers.0.experts.{e}.up_proj"] = gate_up[e, half:]
        weights[f"model.decoder.layers.0.experts.{e}.down_proj"] = down[e]
    compressor = BaseCompressor.get_value_from_registry(scheme.format)
    scales = {}  # nvfp4: gate and up with one global scale (llm-compressor's fused-layer global scales)
    for e in range(gate_up.shape[0]):
        gate, up = split_rows(quantize(gate_up[e], scheme_name, GROUP[scheme_name]), [half, half])
        scales.update(
            {f"model.decoder.layers.0.experts.{e}.gate_proj": gate, f"model.decoder.layers.0.experts.{e}.up_proj": up}
        )
    for module, w in weights.items():
        q = scales.get(module) or quantize(w, scheme_name, GROUP[scheme_name])
        state = {"weight": w.bfloat16(), "weight_scale": q.parts["weight_scale"].bfloat16()}
        if scheme_name == "nvfp4":
            state = {
                "weight": w,
                "weight_scale": q.parts["weight_scale"].float(),
                "weight_global_scale": q.parts["weight_global_scale"],
            }
        out.update({f"{module}.{k}": v for k, v in compressor.compress(state, scheme).items()})
    return out


@pytest.mark.parametrize("name", ["FP8_DYNAMIC", "W8A16", "INT8", "W4A16", "NVFP4A16"])
def test_reads_what_the_library_compresses(tiny, tmp_path, name):
    scheme_name = {"FP8_DYNAMIC": "fp8", "W8A16": "int8", "INT8": "int8", "W4A16": "int4", "NVFP4A16": "nvfp4"}[name]
    if name in ("W8A16", "W4A16"):  # per channel / with the test's group size
        scheme = library_scheme(scheme_name, GROUP[scheme_name])
    else:
        scheme = preset_name_to_scheme(name, ["Linear"])
    scheme.format = infer_module_format(torch.nn.Linear, scheme).value  # INT8 (W8A8): int-quantized, an int8 `weight`
    tensors = library_compressed(tiny, scheme_name, scheme)
    config = QuantizationConfig(
        config_groups={"group_0": scheme}, format=scheme.format, quantization_status="compressed"
    )
    path = write_checkpoint(tmp_path / name, tensors, base_config(tiny), None)
    ModelCompressor(quantization_config=config).update_config(str(path))
    info, weights = read_quantized(path)
    assert info.scheme == scheme_name and sorted(weights) == [
        "layers.0.experts.down_proj",
        "layers.0.experts.gate_up_proj",
        "layers.0.self_attn.q_proj.weight",
    ]
    assert weights["layers.0.experts.gate_up_proj"].shape == (8, 64, 64)
    for module, want in library_decompress(path).items():
        assert torch.equal(dgemma_weight(weights, module).to(want.dtype), want), module


def modelopt_from(path: Path, out: Path, layout: str) -> Path:
    """dgemma's nvfp4 checkpoint rewritten as ModelOpt writes NVFP4: `weight` (uint8), `weight_scale`
    (fp8), `weight_scale_2` = 1 / compressed-tensors' global scale, `input_scale`."""
    tensors = {}
    for name, t in all_tensors(path).items():
        module, _, part = name.rpartition(".")
        if part == "weight_packed":
            tensors[f"{module}.weight"] = t
        elif part == "weight_global_scale":
            tensors[f"{module}.weight_scale_2"] = (1.0 / t).reshape(())
            tensors[f"{module}.input_scale"] = torch.tensor(0.02)
        else:
            tensors[name] = t
    fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    groups = {"group_0": {"input_activations": fp4, "weights": fp4, "targets": ["Linear"]}}
    exclude = ["lm_head", "*router*", "*self_conditioning*"]
    if layout == "config.json":
        block = {
            "config_groups": groups,
            "ignore": exclude,
            "quant_algo": "NVFP4",
            "kv_cache_scheme": None,
            "producer": {"name": "modelopt", "version": "0.37.0"},
            "quant_method": "modelopt",
        }
        return write_checkpoint(out, tensors, base_config(path), block)
    write_checkpoint(out, tensors, base_config(path), None)
    legacy = {
        "producer": {"name": "modelopt", "version": "0.29.0"},
        "quantization": {
            "quant_algo": "NVFP4",
            "kv_cache_quant_algo": None,
            "group_size": 16,
            "exclude_modules": exclude,
        },
    }
    (out / "hf_quant_config.json").write_text(json.dumps(legacy))
    return out


@pytest.mark.parametrize("layout", ["config.json", "hf_quant_config.json"])
def test_modelopt_nvfp4_reads_to_the_same_weights(written, tmp_path, layout):
    path = modelopt_from(written["nvfp4"], tmp_path / "modelopt", layout)
    info, weights = read_quantized(path)
    assert (info.quant_method, info.scheme, info.group_size) == ("modelopt", "nvfp4", 16)
    _, ours = read_quantized(written["nvfp4"])
    assert sorted(weights) == sorted(ours)
    for name in ours:
        want = dequantize(ours[name])
        assert torch.allclose(dequantize(weights[name]), want, rtol=1e-6, atol=0), name  # 1 / (1 / g): float rounding


def test_fusing_gate_and_up_with_different_global_scales(written, tmp_path):
    """Another writer's gate and up of one expert with their own nvfp4 global scales: fused on the
    smaller one, exactly when the ratio is a power of two, else within half an fp8 step per group."""
    tensors = all_tensors(written["nvfp4"])
    gate, up = (f"model.decoder.layers.1.experts.3.{p}_proj" for p in ("gate", "up"))
    scale, global_scale = tensors[f"{up}.weight_scale"].float(), tensors[f"{up}.weight_global_scale"]
    _, before = read_quantized(written["nvfp4"])
    expected = dequantize(before["layers.1.experts.gate_up_proj"].select(3))
    half = expected.shape[0] // 2
    group = QuantGroup("g", "nvfp4", 16, ("Linear",), "nvfp4-pack-quantized")
    for ratio, exact in [(0.5, True), (1 / 1.3, False)]:  # up's global scale (and its group scales) times ratio
        changed = dict(tensors)
        changed[f"{up}.weight_scale"] = (scale * ratio).to(torch.float8_e4m3fn)
        changed[f"{up}.weight_global_scale"] = global_scale * ratio
        path = write_checkpoint(
            tmp_path / str(ratio), changed, base_config(written["nvfp4"]), quant_block(written["nvfp4"])
        )
        _, weights = read_quantized(path)
        fused = weights["layers.1.experts.gate_up_proj"].select(3)
        assert torch.equal(fused.parts["weight_global_scale"], changed[f"{up}.weight_global_scale"])  # the smaller one
        got = dequantize(fused)
        stored = {p: {k.rpartition(".")[2]: v for k, v in changed.items() if k.startswith(p + ".")} for p in (gate, up)}
        alone = {p: dequantize(to_qtensor(parts, group, p)) for p, parts in stored.items()}  # each on its own scales
        assert torch.equal(got[half:], alone[up])  # up keeps its scales
        if exact:
            assert torch.equal(
                changed[f"{up}.weight_scale"].float(), scale * ratio
            )  # (the fixture's scales halve exactly)
            assert torch.equal(got, expected)
        else:  # gate's fp8 scales rescaled and rounded once
            bound = 2**-4 * alone[gate].abs() + 6 * 2**-10 / fused.parts["weight_global_scale"]
            assert ((got[:half] - alone[gate]).abs() <= bound).all()
            assert not torch.equal(got[:half], alone[gate])


def mutate(path: Path, out: Path, block=None, drop=(), rename=None) -> Path:
    """A copy of a quantised checkpoint with its quantization_config replaced or tensors dropped."""
    tensors = {n: t for n, t in all_tensors(path).items() if not any(n.startswith(d) for d in drop)}
    return write_checkpoint(out, tensors, base_config(path), block if block is not None else quant_block(path))


def edit(block: dict, **changes) -> dict:
    block = json.loads(json.dumps(block))
    for path, value in changes.items():
        *keys, last = path.split("__")
        node = block
        for k in keys:
            node = node[k]
        node[last] = value
    return block


W = "config_groups__group_0__weights__"
BAD_CONFIGS = [
    ({"quant_method": "gptq"}, "unknown quant_method 'gptq'"),
    ({"format": "foo-quantized"}, "unknown compressed-tensors format 'foo-quantized'"),
    ({"format": "marlin-24"}, "format 'marlin-24' is not one dgemma reads"),
    ({"config_groups__group_0__format": "dense"}, "format 'dense' in config group 'group_0' is not one dgemma reads"),
    ({W + "num_bits": 3}, "int3 weights, strategy group, format pack-quantized cannot be run by dgemma"),
    ({W + "symmetric": False}, "asymmetric"),
    ({W + "strategy": "block"}, "strategy block"),
    ({W + "group_size": 12}, "int4 group size must be a positive multiple of 8 (got 12)"),
    ({W + "actorder": "group"}, "actorder 'group'"),
    ({"quantization_status": "frozen"}, "quantization_status is 'frozen'"),
    ({"transform_config": {"config_groups": {"r": {}}}}, "transform_config is set"),
    ({"sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity_config is set"),
    ({"config_groups": {}}, "config_groups is missing or empty"),
    ({"config_groups": {"W4A4": ["Linear"]}}, "preset dgemma does not know"),
    ({"config_groups__group_0__weights": None}, "has no weights quantization"),
]


@pytest.mark.parametrize("changes, words", BAD_CONFIGS)
def test_bad_quantization_configs(written, tmp_path, changes, words):
    path = written["int4"]
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"] = edit(config["quantization_config"], **changes)
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuantConfigError) as e:
        read_quantized(bad)
    assert words in str(e.value) and "\n" not in str(e.value)
    assert isinstance(e.value, ConfigError) and isinstance(e.value, QuantError)


MODELOPT_BAD = [
    ({"quant_algo": "INT4_AWQ"}, "ModelOpt quant_algo 'INT4_AWQ' is not one dgemma reads"),
    ({"quant_algo": None}, "ModelOpt config has no quant_algo"),
    ({"group_size": 32}, "ModelOpt NVFP4 with group_size 32"),
]


@pytest.mark.parametrize("changes, words", MODELOPT_BAD)
def test_bad_modelopt_configs(written, tmp_path, changes, words):
    path = modelopt_from(written["nvfp4"], tmp_path / "m", "config.json")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(changes)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuantConfigError, match=re.escape(words)):
        read_quantized(path)


def test_unquantised_checkpoint_is_refused(tiny):
    with pytest.raises(QuantConfigError, match="is not quantised: config.json has no quantization_config"):
        read_quantized(tiny)


BAD_PARTS = [
    (
        dict(drop=["model.decoder.layers.1.self_attn.o_proj.weight_scale"]),
        "missing tensor model.decoder.layers.1.self_attn.o_proj.weight_scale",
    ),
    (
        dict(drop=["model.decoder.layers.0.experts.3.up_proj."]),
        "missing tensors of model.decoder.layers.0.experts.3.up_proj",
    ),
    (dict(block="fp8"), "stores weight_packed, not the weight its config group (fp8, format float-quantized) reads"),
    (dict(block="ignore"), "layers.2.mlp.up_proj is stored quantised but quantization_config's ignore list names it"),
    (dict(block="targets"), "model.decoder.layers.0.mlp.down_proj is stored quantised but no config group targets it"),
    (dict(block="int8", scheme="fp8"), "weight has dtype torch.float8_e4m3fn, expected torch.int8 for int8"),
    (dict(block="group", scheme="int4"), "has groups of 32 inputs; its config group says 64"),
]


@pytest.mark.parametrize("change, words", BAD_PARTS)
def test_missing_or_misfit_parts(written, tmp_path, change, words):
    path = written[change.get("scheme", "nvfp4")]
    block = quant_block(path)
    if change.get("block") == "int8":  # an int-quantized int8 config over fp8 tensors
        block = edit(
            block,
            format="int-quantized",
            config_groups__group_0__format="int-quantized",
            config_groups__group_0__weights__type="int",
        )
    elif change.get("block") == "group":
        block = edit(block, config_groups__group_0__weights__group_size=64)
    elif change.get("block") == "fp8":
        block = quantization_config("fp8")
    elif change.get("block") == "ignore":
        block = edit(block, ignore=["model.decoder.layers.2.mlp.up_proj"])
    elif change.get("block") == "targets":
        block = edit(block, config_groups__group_0__targets=["re:.*self_attn.*", "re:.*experts.*"])
    bad = mutate(path, tmp_path / "bad", block=block, drop=change.get("drop", ()))
    with pytest.raises(QuantPartsError) as e:
        info, weights = read_quantized(bad)
        [weights[n] for n in weights]
    assert words in str(e.value) and "\n" not in str(e.value)
    assert isinstance(e.value, WeightsError)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--scheme", "int3"], "unknown quantization scheme 'int3'"),
        (["--scheme", "int4", "--group-size", "12"], "int4 group size must be a positive multiple of 8 (got 12)"),
        (["--scheme", "fp8", "--group-size", "32"], "a group size applies to int4 only"),
        (
            ["--scheme", "int4", "--group-size", "128"],
            "int4 needs the input size (32) to be a multiple of its group size 128",
        ),
        (["--scheme", "fp8", "--dtype", "int8"], "--dtype must be one of"),
        (["--scheme", "fp8", "--model", "/nonexistent/model"], "--model /nonexistent/model: no such directory"),
        (["--scheme", "fp8", "--out", "QUANTISED"], "exists and is not empty"),
        (["--scheme", "fp8", "--model", "QUANTISED"], "is already quantised"),
    ],
)
def test_quantize_cli_errors_are_one_line_and_exit_2(capsys, tiny, written, tmp_path, argv, words):
    out = tmp_path / "out"
    argv = [str(written["fp8"]) if a == "QUANTISED" else a for a in argv]  # later flags win in argparse
    assert main(["quantize", "--model", str(tiny), "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1, err
    assert not out.exists()  # nothing half-written left behind


@pytest.mark.slow
def test_quantize_random_weights_of_a_named_size(tmp_path):
    """`dgemma quantize --size NAME` streams random weights of that size through the same writer
    (how the released size is written without its weights): the file loads, holds the scheme's
    parts and generates; --model and --size together are refused."""
    out = tmp_path / "micro-int4"
    assert main(["quantize", "--size", "micro", "--scheme", "int4", "--group-size", "32", "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["format"] == "pack-quantized" and config["dtype"] == "bfloat16"
    model = dgemma.load(out, dtype="bfloat16")
    assert model.net.quantization == ("int4", 32)
    assert isinstance(model.net.layers[0].experts, QuantExperts)
    assert model.net.layers[0].experts.gate_up_proj.weight_scale.dtype == torch.bfloat16
    assert len(model.generate([[2, 5, 6]], max_new_tokens=8, seed=0).sequences[0]) == 8
    assert (
        main(["quantize", "--size", "micro", "--model", str(out), "--scheme", "int4", "--out", str(tmp_path / "x")])
        == 2
    )
