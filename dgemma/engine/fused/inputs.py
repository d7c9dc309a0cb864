"""What one decoder step of a group reads from the host on the Triton path, packed in one buffer:
one host-to-device copy a step (a launch each would cost as much as a kernel, and a CUDA graph
replays from fixed addresses anyway).

    field        shape     dtype    what
    table.<kind> [n, W]    int32    the rows' block tables per layer kind (-1: none; W the planned width)
    lo.<kind>    [n]       int32    the first key position each row's layer kind sees (sliding: the window)
    start.<kind> [n]       int32    the row's prefix length (where its canvas starts)
    positions    [n, C]    int32    RoPE position of each canvas position (start + c)
    temps        [n C]     float32  each position's temperature (the request's, at its step)
    seeds        [n]       int64    the request's seed bits (its Philox key: triton_step.seed_bits)
    passes       [n]       int64    its pass count (the Philox offset: the step's draws)
    bounds       [n]       float32  entropy_bound
    confidence   [n]       float32  confidence_threshold
    stability    [n]       int32    stability_threshold
    fixed        [n, C]    int32    the canvas constraints' fixed tokens (-1: free)
    adapter      [n]       int32    the row's LoRA adapter slot (-1: none; kernels/triton_lora.py)

and for a turbo step (`StepLayout.turbo`; engine/fused/turbo.py):

    slot             [n]     int32    the request's canvas K/V slot (padding: the scratch slot)
    full             [n]     int32    1: the pass computes every position (a canvas's first, a refresh)
    rest_threshold   [n]     float32  this pass's rest threshold (+inf: none rests)
    dormant_entropy  [n]     float32  the rest threshold where resting may be (the next pass's counts; +inf: never)
    freeze_passes    [n]     int64    turbo_freeze_passes
    freeze_entropy   [n]     float32  turbo_freeze_entropy
    eos              [n, E]  int64    the end-of-answer tokens (-1: none; E = MAX_EOS)

Rows past the group (a graph's bucket is larger) get an empty prefix, temperature 1 and nothing
fixed; their outputs are dropped. `HostStep.fill` writes a group's values into a (pinned) host
buffer; `StepTensors.of` views a device copy of it by field.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import sampler
from ..kv.paged_cache import KINDS, PagedKVCache, PagedPass
from ..turbo import may_rest

_DTYPES = {"int32": torch.int32, "float32": torch.float32, "int64": torch.int64}
MAX_EOS = 4  # end-of-answer tokens a turbo step on the device takes (more: the eager turbo step)


@dataclass(frozen=True)
class StepLayout:
    """Where each field lies in the int32 words of one step's buffer, for `rows` rows."""

    rows: int
    canvas: int
    width: int
    turbo: bool = False

    def fields(self) -> list[tuple[str, str, tuple[int, ...]]]:
        n, c, w = self.rows, self.canvas, self.width
        out = [(f"table.{k}", "int32", (n, w)) for k in KINDS] + [(f"lo.{k}", "int32", (n,)) for k in KINDS]
        out += [(f"start.{k}", "int32", (n,)) for k in KINDS]
        out += [
            ("seeds", "int64", (n,)),
            ("passes", "int64", (n,)),
            ("positions", "int32", (n, c)),
            ("temps", "float32", (n * c,)),
        ]
        out += [
            ("bounds", "float32", (n,)),
            ("confidence", "float32", (n,)),
            ("stability", "int32", (n,)),
            ("fixed", "int32", (n, c)),
            ("adapter", "int32", (n,)),
        ]
        if self.turbo:
            out += [
                ("slot", "int32", (n,)),
                ("full", "int32", (n,)),
                ("rest_threshold", "float32", (n,)),
                ("dormant_entropy", "float32", (n,)),
                ("freeze_passes", "int64", (n,)),
                ("freeze_entropy", "float32", (n,)),
                ("eos", "int64", (n, MAX_EOS)),
            ]
        return out

    def offsets(self) -> dict[str, tuple[int, str, tuple[int, ...]]]:
        at, out = 0, {}
        for name, dtype, shape in self.fields():
            words = 1
            for s in shape:
                words *= s
            if dtype == "int64":
                at += at % 2  # 8-byte aligned
                words *= 2
            out[name] = (at, dtype, shape)
            at += words
        return out

    @property
    def words(self) -> int:
        last = self.offsets()
        return max(at + _words(dtype, shape) for at, dtype, shape in last.values())

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each field as a typed view of `buffer` (int32 [words], host or device)."""
        out = {}
        for name, (at, dtype, shape) in self.offsets().items():
            part = buffer[at : at + _words(dtype, shape)]
            out[name] = (part.view(_DTYPES[dtype]) if dtype != "int32" else part).view(shape)
        return out


def _words(dtype: str, shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return 2 * n if dtype == "int64" else n


def host_buffer(layout: StepLayout, device: torch.device) -> torch.Tensor:
    """An int32 host buffer for one step (pinned where the device is CUDA: an asynchronous copy)."""
    return torch.empty(layout.words, dtype=torch.int32, pin_memory=device.type == "cuda")


def fill(layout: StepLayout, buffer: torch.Tensor, cache: PagedKVCache, group: list, scratch: int = 0) -> None:
    """Write the group's step inputs into the host `buffer` (see the module): rows past the group
    are padding (a turbo step's write into canvas K/V slot `scratch`). RuntimeError if a row's table is wider than the layout or a block it sees was
    released (as `PagedKVCache.plan_canvas`)."""
    v = layout.views(buffer)
    n, c = layout.rows, layout.canvas
    starts = [r.kv.length for r in group] + [0] * (n - len(group))
    for kind in KINDS:
        table, lo, start = cache.canvas_tables(kind, [r.kv for r in group], starts, layout.width)
        v[f"table.{kind}"].copy_(table)
        v[f"lo.{kind}"].copy_(lo)
        v[f"start.{kind}"].copy_(start)
    v["positions"].copy_(torch.tensor(starts, dtype=torch.int32)[:, None] + torch.arange(c, dtype=torch.int32))
    temps = [
        float(
            sampler.temperature(
                r.config.max_denoising_steps - r.step, r.config.max_denoising_steps, r.config.t_min, r.config.t_max
            )
        )
        for r in group
    ]
    v["temps"].view(n, c).copy_(
        torch.tensor(temps + [1.0] * (n - len(group)), dtype=torch.float32)[:, None].expand(n, c)
    )
    from ...kernels.triton_step import seed_bits

    pad = [0] * (n - len(group))
    v["seeds"].copy_(torch.tensor([seed_bits(r.seed) for r in group] + pad, dtype=torch.int64))
    v["passes"].copy_(torch.tensor([r.passes + r.block_passes for r in group] + pad, dtype=torch.int64))
    v["bounds"].copy_(torch.tensor([r.config.entropy_bound for r in group] + pad, dtype=torch.float32))
    v["confidence"].copy_(torch.tensor([r.config.confidence_threshold for r in group] + pad, dtype=torch.float32))
    v["stability"].copy_(torch.tensor([r.config.stability_threshold for r in group] + pad, dtype=torch.int32))
    v["adapter"].copy_(torch.tensor([r.adapter_slot for r in group] + [-1] * (n - len(group)), dtype=torch.int32))
    v["fixed"].fill_(-1)
    for i, r in enumerate(group):
        constraints = r.active_constraints
        if constraints is not None and constraints.fixed is not None:
            v["fixed"][i].copy_(constraints.fixed)
    if layout.turbo:
        _fill_turbo(v, group, n, scratch)


def _fill_turbo(v: dict[str, torch.Tensor], group: list, n: int, scratch: int) -> None:
    """A turbo step's fields (see the module); padding rows compute every position into the
    scratch slot."""
    pad = [0] * (n - len(group))
    settings = [r.config.turbo_settings for r in group]
    never = float("inf")  # no position rests (the kernels' threshold: entropy > +inf never holds)
    dormant = [s.dormant_entropy or never for s in settings]
    rest = [d if may_rest(r) else never for r, d in zip(group, dormant)]
    v["full"].copy_(torch.tensor([int(r.turbo.full_pass(s)) for r, s in zip(group, settings)] + [1] * len(pad)))
    v["rest_threshold"].copy_(torch.tensor(rest + pad, dtype=torch.float32))
    v["dormant_entropy"].copy_(torch.tensor(dormant + pad, dtype=torch.float32))
    v["freeze_passes"].copy_(torch.tensor([s.freeze_passes for s in settings] + pad, dtype=torch.int64))
    v["freeze_entropy"].copy_(torch.tensor([s.freeze_entropy for s in settings] + pad, dtype=torch.float32))
    v["eos"].fill_(-1)
    for i, r in enumerate(group):
        eos = list(r.config.eos_token_ids)
        v["eos"][i, : len(eos)].copy_(torch.tensor(eos, dtype=torch.int64))
    v["slot"].copy_(torch.tensor([r.turbo.slot for r in group] + [scratch] * len(pad), dtype=torch.int32))


@dataclass
class StepTensors:
    """A step's inputs on the device (views of one buffer) and the canvas pass they plan."""

    views: dict[str, torch.Tensor]
    plan: PagedPass

    @classmethod
    def of(cls, layout: StepLayout, buffer: torch.Tensor, cache: PagedKVCache, group: list) -> StepTensors:
        v = layout.views(buffer)
        tables = {kind: (v[f"table.{kind}"], v[f"lo.{kind}"], v[f"start.{kind}"]) for kind in KINDS}
        rows = [r.kv for r in group]
        plan = PagedPass(cache, rows, [layout.canvas] * layout.rows, v["positions"], False, {}, {}, {}, tables)
        return cls(v, plan)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.views[name]
