"""Fit before fetch: whether a checkpoint's memory plan fits the device it will load on, and which
scheme `--quantization auto` picks, from config.json, the quantisation config and the safetensors
headers alone (no weights).

One check for a local directory and for a hub repo before its download: `CheckpointFacts` holds
what both provide. The plan is memory_plan.py's, made for the device's total memory: a
GPU's on CUDA, the machine's RAM on a CPU (where the CUDA context's reserve becomes the process's
own: the interpreter, torch, the tokenizer). A pre-quantised checkpoint's weights are counted from
its headers as stored, its floating tensors in the dtype they load in; a full-precision one's from
its config (the headers add nothing there, and are not read). The plan is for one request of
SINGLE_REQUEST_CONTEXT positions unless the caller says more (serve: --max-active requests of
--max-context positions).

With `tensor_parallel_size` N > 1 the plan is the largest rank's (memory_plan.py's
`rank_plans`), checked against one device's memory: each rank has a device of the same size (on
a CPU the ranks share the machine's RAM, so each gets 1/N of it). A size the model cannot be split
into is parallel/plan.py's one-line ShardError, before anything else.

`FitRequest.memory` stands in for the device's memory: the `dgemma` command sets it from
DGEMMA_DEVICE_MEMORY (a size: 24GiB, 16GB, a byte count), for planning on one machine what another
will run, and for tests.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..config import ModelConfig, load_model_config
from ..quant import schemes
from .errors import FitError, HubError

DEVICE_MEMORY_ENV = "DGEMMA_DEVICE_MEMORY"
SINGLE_REQUEST_CONTEXT = 8192  # run, chat, bench and dgemma.load plan one request of this many positions
CPU_RESERVE = 2**29  # on a CPU, in place of the CUDA context: the interpreter, torch, the tokenizer
TENSOR_PARALLEL_SIZES = (2, 4, 8, 16)  # larger splits a refusal may suggest
CONTEXTS = (65536, 32768, 16384, 8192, 4096)  # shorter contexts a refusal may suggest
BATCHES = (4, 2, 1)
HEADER_BITS = {
    "F64": 64,
    "F32": 32,
    "F16": 16,
    "BF16": 16,
    "I64": 64,
    "I32": 32,
    "I16": 16,
    "I8": 8,
    "U64": 64,
    "U32": 32,
    "U16": 16,
    "U8": 8,
    "BOOL": 8,
    "F8_E4M3": 8,
    "F8_E5M2": 8,
    "F8_E8M0": 8,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "F4": 4,
}
FLOATS = ("F64", "F32", "F16", "BF16")
QUANT_PARTS = ("scale", "zero_point", "weight_packed", "weight_shape", "g_idx")  # as model/weights.py
GIB = 2**30


@dataclass(frozen=True)
class FitRequest:
    """What the caller will load and run: the device; the dtype the weights load in, given the
    checkpoint directory (`functools.partial(devices.resolve_dtype, requested, device)`: the hub does
    not decide dtypes); the scheme asked for ("auto": the best that fits); the shape of the work
    the plan is for. `memory`: bytes to plan for instead of the device's. `flags`: the command's
    flags a refusal may suggest (--quantization, --max-context, --max-active, --force); () for the
    API, whose refusals name `load()`'s arguments. `tensor_parallel_size` / `expert_parallel`:
    the split the model loads in (the plan is per rank, against each rank's device)."""

    device: torch.device
    dtype: Callable[[Path], torch.dtype]
    quantization: str | None = None
    group_size: int | None = None
    max_active: int = 1
    max_context: int | None = SINGLE_REQUEST_CONTEXT  # None: the model's max_position_embeddings
    kv_cache_memory: int | None = None
    prefill_chunk: int = 2048
    turbo: bool = False  # every canvas with its turbo canvas K/V buffer (engine/turbo.py)
    memory: int | None = None
    memory_source: str = DEVICE_MEMORY_ENV  # what `memory` is, in a refusal: the variable, or `--card`
    flags: tuple[str, ...] = ()
    tensor_parallel_size: int = 1
    expert_parallel: bool = False

    def workload(self, scheme: str | None, config: ModelConfig):
        """The `memory_plan.Workload` of this request for a model of `config`, its weights in `scheme`
        (the context capped at the model's max_position_embeddings)."""
        from ..memory_plan import Workload

        longest = config.max_position_embeddings
        return Workload(
            scheme,
            self.group_size,
            self.max_active,
            min(self.max_context or longest, longest),
            self.kv_cache_memory,
            self.prefill_chunk,
            self.turbo,
            self.tensor_parallel_size,
            self.expert_parallel,
        )

    def fix(self, knob: str, value: object) -> str:
        """How the caller changes `knob`: `--max-context 8192`, or `quantization='int4'`."""
        return f"--{knob.replace('_', '-')} {value}" if self.flags else f"{knob}={value!r}"

    def has(self, knob: str) -> bool:
        return f"--{knob.replace('_', '-')}" in self.flags if self.flags else knob == "quantization"


@dataclass(frozen=True)
class CheckpointFacts:
    """What the fit check reads of a checkpoint: its config, its quantisation config, its headers."""

    name: str
    config_dir: Path  # holds config.json (and for a local checkpoint everything else)
    config: ModelConfig
    quant: object | None = None  # quant.quant_config.QuantInfo of a pre-quantised checkpoint
    tensors: dict[str, tuple[str, tuple[int, ...]]] | None = None  # headers: name -> (dtype, shape)
    from_hub: bool = False


@dataclass(frozen=True)
class Fit:
    """The outcome: the plan, the scheme to load with, the device's memory, and whether it fits."""

    plan: object  # memory_plan.MemoryPlan
    scheme: str | None
    memory: int | None
    where: str
    fits: bool
    message: str = ""  # a refusal's text (a forced load's warning)

    def describe(self) -> str:
        """One line: what the plan takes and what the device has."""
        if self.memory is None:
            return f"memory plan {self.plan.describe()} ({self.where}: its memory is unknown, not checked)"
        if not self.fits:
            return self.message
        return f"fits this device's {self.memory / GIB:.1f} GiB ({self.where}): {self.plan.describe()}"


# ------------------------------------------------------------------------------------------ facts
def quant_info(raw: dict, config_dir: Path):
    """The QuantInfo of a pre-quantised checkpoint (config.json's quantization_config, else
    ModelOpt's hf_quant_config.json), or None."""
    from ..quant.quant_config import load_quantization_config, parse_quantization_config

    if raw.get("quantization_config") is None and not (config_dir / "hf_quant_config.json").is_file():
        return None
    return parse_quantization_config(load_quantization_config(config_dir)[1])


def local_headers(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor's (dtype, shape) from a checkpoint directory's safetensors headers."""
    from safetensors import safe_open

    from ..model.layout import WeightsError, weight_files

    out = {}
    for file in sorted(set(weight_files(path).values())):
        try:
            with safe_open(file, framework="pt") as f:  # the header only
                for name in f.keys():
                    part = f.get_slice(name)
                    out[name] = (part.get_dtype(), tuple(part.get_shape()))
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise WeightsError(f"{file} is not a safetensors file: {e}") from None
    return out


def local_facts(path: Path, name: str | None = None) -> CheckpointFacts:
    """A checkpoint directory's facts; headers are read only where they count (pre-quantised)."""
    config = load_model_config(path)
    quant = quant_info(config.raw, path)
    name = name or Path(os.path.abspath(path)).name  # `.` and `..` named as the directories they are
    return CheckpointFacts(name, path, config, quant, local_headers(path) if quant else None)


def hub_headers(metadata) -> dict[str, tuple[str, tuple[int, ...]]]:
    """huggingface_hub's SafetensorsRepoMetadata as name -> (dtype, shape)."""
    return {
        name: (info.dtype, tuple(info.shape))
        for file in metadata.files_metadata.values()
        for name, info in file.tensors.items()
    }


def read_json_file(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise HubError(f"cannot read {path.name}: {e}") from None
    return data if isinstance(data, dict) else {}


# ------------------------------------------------------------------------------------------ plans
def auto_order() -> tuple[str | None, ...]:
    """What `--quantization auto` tries, the first whose plan fits: the unquantised weights, then
    the schemes of quant/schemes.py's table that `auto` may pick, in its order (fp8, int8, int4,
    nvfp4)."""
    return (None, *schemes.auto_names())


def device_memory(
    device: torch.device, override: int | None = None, source: str = DEVICE_MEMORY_ENV
) -> tuple[int | None, str]:
    """The bytes the weights and the engine share on `device` (or `override`, named `source`), and
    what they are; None where unknown (then nothing is checked)."""
    if override is not None:
        return override, source
    if device.type == "cuda":
        try:
            index = device.index if device.index is not None else torch.cuda.current_device()
            return torch.cuda.get_device_properties(index).total_memory, f"cuda:{index}"
        except (RuntimeError, AssertionError, AttributeError):  # torch without CUDA: nothing to ask
            return None, str(device)
    if device.type == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "RAM"
        except (ValueError, OSError, AttributeError):
            return None, "RAM"
    return None, str(device)


def stored_weight_bytes(tensors: dict[str, tuple[str, tuple[int, ...]]], dtype: torch.dtype) -> int:
    """A pre-quantised checkpoint's weights in memory: codes and scales as stored, the floating
    tensors (embeddings, norms, routers) in the dtype they load in."""
    size = torch.empty(0, dtype=dtype).element_size()
    total = 0
    for name, (kind, shape) in tensors.items():
        count = 1
        for dim in shape:
            count *= dim
        if kind in FLOATS and not any(part in name for part in QUANT_PARTS):
            total += count * size
        else:
            total += (count * HEADER_BITS.get(kind, 8) + 7) // 8
    return total


def plan_for(facts: CheckpointFacts, dtype: torch.dtype, scheme: str | None, request: FitRequest):
    """memory_plan.py's plan for this checkpoint and request (a pre-quantised checkpoint's
    weights from its headers; on a CPU the process's reserve, not CUDA's); split across ranks,
    the largest rank's."""
    from ..memory_plan import largest, plan_memory

    if request.tensor_parallel_size != 1:
        return largest(rank_plans_for(facts, dtype, scheme, request))
    plan = plan_memory(facts.config, dtype, request.workload(scheme, facts.config))
    if facts.quant is not None and facts.tensors is not None:
        plan = replace(plan, weights={"stored": stored_weight_bytes(facts.tensors, dtype)}, scheme=facts.quant.scheme)
    if request.device.type == "cpu":
        plan = replace(plan, reserve=CPU_RESERVE)
    return plan


def rank_plans_for(facts: CheckpointFacts, dtype: torch.dtype, scheme: str | None, request: FitRequest) -> list:
    """Each rank's plan (memory_plan.rank_plans) for this checkpoint and request. A
    pre-quantised checkpoint's stored bytes are cut by the share of its scheme's weights each rank
    holds (the headers name tensors, not what a split keeps of them)."""
    from ..memory_plan import rank_plans, weight_bytes

    work = request.workload(scheme, facts.config)
    if facts.quant is not None and facts.tensors is not None:
        stored, known = stored_weight_bytes(facts.tensors, dtype), facts.quant.scheme
        known = known if schemes.find(known) is not None else None  # "mixed": the unquantised shares
        plans = rank_plans(facts.config, dtype, replace(work, scheme=known, group_size=facts.quant.group_size))
        whole = sum(weight_bytes(facts.config, known, facts.quant.group_size, dtype).values())
        plans = [
            replace(p, weights={"stored": stored * sum(p.weights.values()) // whole}, scheme=facts.quant.scheme)
            for p in plans
        ]
    else:
        plans = rank_plans(facts.config, dtype, work)
    if request.device.type == "cpu":
        plans = [replace(p, reserve=CPU_RESERVE) for p in plans]
    return plans


def variant(
    plan,
    facts: CheckpointFacts,
    dtype: torch.dtype,
    request: FitRequest,
    batch: int | None = None,
    context: int | None = None,
):
    """`plan` for another batch or context: the same weights, memory_plan's KV pool and step buffers
    for the new shape (without building the model again, as plan_memory does)."""
    from ..memory_plan import kv_bytes, step_buffer_bytes

    batch, context = batch or plan.batch, context or plan.context
    config = facts.config
    if plan.ranks > 1:  # the rank's own shapes
        from ..parallel.plan import ShardPlan

        config = ShardPlan.build(config, plan.ranks, plan.expert_parallel).rank_config(plan.rank)
    kv = request.kv_cache_memory
    kv = int(kv if kv is not None else kv_bytes(config, 1, context, dtype))
    steps = step_buffer_bytes(config, batch, request.prefill_chunk, dtype, request.turbo)
    return replace(plan, kv_cache=kv, step_buffers=steps, batch=batch, context=context)


def rank_memory(request: FitRequest) -> tuple[int | None, str]:
    """`device_memory` for one rank: each rank's own device, or on a CPU its share of the RAM."""
    memory, where = device_memory(request.device, request.memory, request.memory_source)
    ranks = request.tensor_parallel_size
    if ranks > 1 and request.device.type == "cpu" and memory is not None:
        return memory // ranks, f"{where} shared by {ranks} ranks"
    return memory, where


def check_fit(facts: CheckpointFacts, request: FitRequest, force: bool = False) -> Fit:
    """Plan `facts` for `request` on its device and pick the scheme; FitError (saying what would
    fit) when nothing asked for fits, unless `force` (then the Fit says so and loading goes on)."""
    if request.quantization not in (None, "auto"):  # a bad scheme or group size: the loader's own words
        from ..quant.formats import check_scheme

        check_scheme(request.quantization, schemes.get(request.quantization).group.chosen(request.group_size))
    if request.tensor_parallel_size != 1:  # a size that cannot be split: one line, before anything else
        from ..parallel.plan import ShardPlan

        ShardPlan.build(facts.config, request.tensor_parallel_size, request.expert_parallel)
    dtype = request.dtype(facts.config_dir)
    memory, where = rank_memory(request)
    if facts.quant is not None and request.quantization not in (None, "auto"):
        raise HubError(
            f"{facts.name} is already quantised ({facts.quant.scheme}): load it without "
            f"{'--quantization' if request.flags else 'quantization'}"
        )
    if request.quantization == "auto" and facts.quant is None:
        order = auto_order()
        for scheme in order:  # the first whose plan fits
            plan = plan_for(facts, dtype, scheme, request)
            if memory is None or plan.total <= memory:
                return Fit(plan, scheme, memory, where, True)
        scheme = order[-1]
    else:
        scheme = None if facts.quant is not None else request.quantization
        plan = plan_for(facts, dtype, scheme, request)
        if memory is None or plan.total <= memory:
            return Fit(plan, scheme, memory, where, True)
    message = refusal(facts, request, dtype, plan, memory, where)
    if not force:
        raise FitError(message)
    return Fit(plan, scheme, memory, where, False, message)


def refusal(facts: CheckpointFacts, request: FitRequest, dtype: torch.dtype, plan, memory: int, where: str) -> str:
    """Why `plan` does not fit, and what would: a smaller scheme, a shorter context, fewer
    requests at once (only the knobs the caller has), or --force."""
    fixes = []
    order = auto_order()
    if facts.quant is None and request.has("quantization") and plan.scheme in order:
        for scheme in order[order.index(plan.scheme) + 1 :]:
            other = plan_for(facts, dtype, scheme, request)
            if other.total <= memory:
                build = " or a pre-quantised build of it, a smaller download" if facts.from_hub else ""
                fixes.append(f"{request.fix('quantization', scheme)} ({other.total / GIB:.1f} GiB{build})")
                break
    if request.tensor_parallel_size > 1 or request.has("tensor_parallel_size"):
        fixes += larger_split(facts, request, dtype, plan)
    for knob, values, now, shape in (
        ("max_context", CONTEXTS, plan.context, "context"),
        ("max_active", BATCHES, plan.batch, "batch"),
    ):
        if not request.has(knob):
            continue
        for value in values:  # the largest smaller value whose plan fits
            other = variant(plan, facts, dtype, request, **{shape: value})
            if value < now and other.total <= memory:
                fixes.append(f"{request.fix(knob, value)} ({other.total / GIB:.1f} GiB)")
                break
    split = ", larger tensor-parallel size" if request.tensor_parallel_size > 1 else ""
    hint = (
        "it would fit with " + " or ".join(fixes)
        if fixes
        else f"no smaller scheme{split}, context or batch fits it either"
    )
    if request.flags:
        force = "; --force loads it anyway" if "--force" in request.flags else ""
    else:
        force = "; force=True loads it anyway"
    if request.tensor_parallel_size > 1:
        where = f"{where}, tensor-parallel size {request.tensor_parallel_size}"
    return f"{facts.name} does not fit this device's {memory / GIB:.1f} GiB ({where}): {plan.describe()}; {hint}{force}"


def larger_split(facts: CheckpointFacts, request: FitRequest, dtype: torch.dtype, plan) -> list[str]:
    """The smallest larger tensor-parallel size the model splits into whose per-rank plan (same
    scheme) fits, as a fix; [] if none of TENSOR_PARALLEL_SIZES does."""
    from ..parallel.plan import ShardError

    for size in TENSOR_PARALLEL_SIZES:
        if size <= request.tensor_parallel_size:
            continue
        split = replace(request, tensor_parallel_size=size)
        try:
            other = plan_for(facts, dtype, plan.scheme, split)
        except ShardError:
            continue
        memory = rank_memory(split)[0]  # a CPU's RAM shared by more ranks
        if other.total <= memory:
            return [f"{request.fix('tensor_parallel_size', size)} ({other.total / GIB:.1f} GiB per rank)"]
    return []
