"""LoRA adapters inside the engine's network: many adapters on one base, chosen per row of a pass.

The training path attaches an adapter as a forward hook (train/lora.py), which keeps the module as
it is and so turns off every fast replacement of it (kernels/cpu.py's packed and AMX modules,
kernels/fused.py's fused layer). Serving wants the opposite: the base's fast GEMM stays, and the
adapter's low-rank delta is added beside it, for the rows of the pass that use an adapter:

    y = base(x) + (x @ A_s.T) @ B_s.T        (alpha / r folded into B_s once, at load)

for the rows whose request runs adapter slot s, whatever the base's scheme (bf16, float32, or a
quantised GEMM: the adapter is kept in the activations' dtype beside it, so that the expand's GEMM
adds into the base's output in place, `out.addmm_(x @ A.T, B.T)`, rounded once).

`LoraSlots` holds every adapter weight in slots preallocated once ([S, R, K] for A, [S, N, R] for
B per adapted linear, zero beyond an adapter's rank), so loading writes into memory that exists
and a captured graph keeps its pointers. `AdapterRows` is one network's use of them: the rows'
selection of the pass it runs now (`RowGroups`: the rows grouped per slot, set around a pass by
`selected`). `adapted_network` is a
copy of an engine network (every tensor shared) whose attention projections and dense MLP add the
selected adapters' deltas: a fused MLP (oneDNN post-ops, AMX) runs fused whenever no row of the
pass has an adapter there, and unfused, with the deltas between its GEMMs, when one has.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from . import cpu, native

# The linears an adapter may target, in each layer (PEFT's attention and dense-MLP targets).
SITES = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
MLP_SITES = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def site_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of every linear an adapter may target, by its name `layers.N.<site>`
    (global layers have no v_proj: V is K's projection)."""
    h, heads, inter = config.hidden_size, config.num_heads, config.intermediate_size
    shapes = {}
    for i, spec in enumerate(config.layers):
        q, kv = heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        layer = {
            "self_attn.q_proj": (h, q),
            "self_attn.k_proj": (h, kv),
            "self_attn.o_proj": (q, h),
            "mlp.gate_proj": (h, inter),
            "mlp.up_proj": (h, inter),
            "mlp.down_proj": (inter, h),
        }
        if spec.has_v_proj:
            layer["self_attn.v_proj"] = (h, kv)
        shapes.update({f"layers.{i}.{site}": shape for site, shape in layer.items()})
    return shapes


@dataclass(frozen=True)
class RowGroups:
    """The rows of one pass grouped per adapter slot: `batch` rows (requests), and for each slot some
    row runs, the runs of consecutive rows on it ((start, end) ranges; None: every row of the pass),
    so that each run is a view of the pass's activations and its delta adds in place (no gather,
    no scatter). Rows without an adapter are in no group."""

    batch: int
    groups: tuple[tuple[int, tuple[tuple[int, int], ...] | None], ...]

    @staticmethod
    def of(slots: Sequence[int]) -> RowGroups | None:
        """`slots[i]`: row i's adapter slot, -1 for none; None when no row has one."""
        used = sorted({s for s in slots if s >= 0})
        if not used:
            return None
        if len(used) == 1 and all(s == used[0] for s in slots):
            return RowGroups(len(slots), ((used[0], None),))
        runs: dict[int, list[tuple[int, int]]] = {s: [] for s in used}
        start = 0
        for i in range(1, len(slots) + 1):
            if i == len(slots) or slots[i] != slots[start]:
                if slots[start] >= 0:
                    runs[slots[start]].append((start, i))
                start = i
        return RowGroups(len(slots), tuple((s, tuple(runs[s])) for s in used))


class LoraSlots:
    """Adapter weights in `max_loras` preallocated slots of rank up to `max_rank`, for every linear
    of `shapes` (`site_shapes`), in `dtype` on `device`.

    A slot's B holds alpha / r (or rsLoRA's alpha / sqrt(r)) folded in. State owned by whoever
    made it (an adapter bank): engine networks read it (`AdapterRows`), the bank writes a slot
    between steps."""

    def __init__(
        self,
        shapes: dict[str, tuple[int, int]],
        max_loras: int,
        max_rank: int,
        device: torch.device,
        dtype: torch.dtype,
    ):
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_rank must be >= 1 (got {max_loras}, {max_rank})")
        self.shapes, self.max_loras, self.max_rank = dict(shapes), max_loras, max_rank
        self.device, self.dtype = torch.device(device), dtype
        self.a = {
            name: torch.zeros(max_loras, max_rank, k, device=device, dtype=dtype) for name, (k, _) in shapes.items()
        }
        self.b = {
            name: torch.zeros(max_loras, n, max_rank, device=device, dtype=dtype) for name, (_, n) in shapes.items()
        }
        self.ranks = [0] * max_loras  # 0: an empty slot
        self.targets: list[frozenset[str]] = [frozenset()] * max_loras  # the linears each slot adapts

    # ---------------------------------------------------------------- writing slots
    @torch.no_grad()
    def write(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]], rank: int, scale: float) -> None:
        """Put an adapter into `slot`: `weights[name] = (A [rank, K], B [N, rank])` for the linears
        it adapts (checked against `shapes` by the caller); the rest of the slot is zeroed."""
        if not 0 <= slot < self.max_loras or not 0 < rank <= self.max_rank:
            raise ValueError(f"slot {slot} / rank {rank} outside {self.max_loras} slots of rank {self.max_rank}")
        self.clear(slot)
        for name, (a, b) in weights.items():
            self.a[name][slot, :rank].copy_(a)
            self.b[name][slot, :, :rank].copy_(b.float() * scale)
        self.ranks[slot], self.targets[slot] = rank, frozenset(weights)

    @torch.no_grad()
    def clear(self, slot: int) -> None:
        for name in self.targets[slot]:
            self.a[name][slot].zero_()
            self.b[name][slot].zero_()
        self.ranks[slot], self.targets[slot] = 0, frozenset()

    def free_slot(self) -> int | None:
        return next((s for s, r in enumerate(self.ranks) if r == 0), None)


class AdapterRows:
    """One network's use of the slots: their weights (shared by every network over the same slots)
    and the rows' selection of the pass this network runs now (its own, so that two engines over
    one model never see each other's rows)."""

    def __init__(self, slots: LoraSlots, on_device: bool = False):
        self.slots = slots
        self.selection: RowGroups | None = None
        # the fused GPU layer's form of the selection (kernels/triton_lora.py): each row's slot, an
        # int32 device tensor [B] (-1: none), read by the kernels, never by the host
        self.on_device = on_device
        self.row_slots: torch.Tensor | None = None

    @contextlib.contextmanager
    def rows(self, slots: Sequence[int]) -> Iterator[None]:
        """Within the block, the network's passes run row i with adapter slot `slots[i]` (-1: none)."""
        if self.on_device:
            self.row_slots = torch.tensor(list(slots), dtype=torch.int32).to(self.slots.device, non_blocking=True)
        else:
            self.selection = RowGroups.of(list(slots))
        try:
            yield
        finally:
            self.selection, self.row_slots = None, None

    @contextlib.contextmanager
    def device_rows(self, row_slots: torch.Tensor) -> Iterator[None]:
        """`rows` with the slots already on the device ([B] int32: a step's inputs, as a graph reads them)."""
        self.row_slots = row_slots
        try:
            yield
        finally:
            self.row_slots = None

    def touches(self, names: Sequence[str]) -> bool:
        """Whether a row of the pass running now has an adapter on any of these linears."""
        sel, targets = self.selection, self.slots.targets
        return sel is not None and any(name in targets[s] for s, _ in sel.groups for name in names)

    def add(self, name: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (= base(x), [..., N]) plus each selected adapter's delta on linear `name` for its
        rows: a GEMM pair a run of consecutive rows on one slot (all of the pass's rows when one slot
        holds them all), the second adding into `out` in place."""
        sel = self.selection
        if sel is None:
            return out
        slots = self.slots
        out = out.contiguous()
        k, n = x.shape[-1], out.shape[-1]
        per_row, out_rows = x.reshape(sel.batch, -1, k), out.view(sel.batch, -1, n)
        for slot, runs in sel.groups:
            if name not in slots.targets[slot]:
                continue
            r = slots.ranks[slot]
            a, b = slots.a[name][slot, :r], slots.b[name][slot, :, :r]
            for start, end in runs or ((0, sel.batch),):
                low = per_row[start:end].reshape(-1, k).to(a.dtype) @ a.t()
                target = out_rows[start:end].view(-1, n)
                if b.dtype == out.dtype:  # the expand's GEMM adds into the output: one rounding, no temporary
                    target.addmm_(low, b.t())
                else:
                    target.add_((low @ b.t()).to(out.dtype))
        return out


@contextlib.contextmanager
def selected(net: nn.Module, slots: Sequence[int] | None) -> Iterator[None]:
    """Run `net`'s passes within the block with row i on adapter slot `slots[i]` (-1: none); a
    network without adapters (or no `slots`) runs as it is."""
    rows = getattr(net, "lora_rows", None)
    if rows is None or slots is None:
        yield
        return
    with rows.rows(slots):
        yield


@contextlib.contextmanager
def device_rows(net: nn.Module, row_slots: torch.Tensor) -> Iterator[None]:
    """`selected` for the fused GPU network, the slots [B] already on the device (the fused step's
    inputs); a network without adapters on the device runs as it is."""
    rows = getattr(net, "lora_rows", None)
    if rows is None or not rows.on_device:
        yield
        return
    with rows.device_rows(row_slots):
        yield


def on_device(net: nn.Module) -> bool:
    """Whether `net` runs its adapters on the device from per-row slot tensors (the fused GPU layer):
    then a request with an adapter may take the fused step."""
    rows = getattr(net, "lora_rows", None)
    return rows is not None and rows.on_device


# ------------------------------------------------------------------------- adapted modules
class AdaptedLinear(nn.Module):
    """`base(x)` (any linear: packed, AMX, widened, quantised, plain) plus the selected adapters'
    deltas on linear `name`."""

    def __init__(self, base: nn.Module, rows: AdapterRows, name: str):
        super().__init__()
        self.base, self.rows, self.name = base, rows, name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rows.add(self.name, x, self.base(x))


class AdaptedGatedMLP(nn.Module):
    """A fused dense MLP (gelu and `* up` inside the GEMMs: oneDNN post-ops, or one AMX call): fused
    when no row of the pass has an adapter on it, else gate and up unfused with their deltas, gelu * up,
    down with its delta. `gate_up(x) -> (gate, up)` and `down(act)` are the base's GEMMs alone."""

    def __init__(
        self,
        fused: nn.Module,
        gate_up: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        down: Callable[[torch.Tensor], torch.Tensor],
        approximate: str,
        rows: AdapterRows,
        prefix: str,
    ):
        super().__init__()
        self.fused, self.gate_up, self.down = fused, gate_up, down
        self.approximate, self.rows = approximate, rows
        self.names = tuple(f"{prefix}.{site}" for site in MLP_SITES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.rows.touches(self.names):
            return self.fused(x)
        gate_name, up_name, down_name = self.names
        gate, up = self.gate_up(x)
        gate, up = self.rows.add(gate_name, x, gate), self.rows.add(up_name, x, up)
        act = F.gelu(gate, approximate=self.approximate).mul_(up)
        return self.rows.add(down_name, act, self.down(act))


def _lean_mlp_parts(mlp: cpu.LeanDenseMLP):
    def gate_up(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.contiguous()
        return cpu.packed_matmul(x, mlp.gate), cpu.packed_matmul(x, mlp.up)

    return gate_up, mlp.down_proj


def _amx_mlp_parts(mlp: native.AMXGatedMLP):
    """The AMX MLP's packed gate|up, read by the plain AMX linear: its tiles pair 16 gate rows with
    16 up rows, which is `pack_linear`'s layout of those rows interleaved; so the GEMM's output is
    gate and up in alternate blocks of 16 columns (no second copy of the weights)."""

    def gate_up(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        m = flat.shape[0]
        # one copy puts gate's blocks before up's: [M, I/16, 2, 16] -> [M, 2, I/16, 16]
        out = mlp.kernel.linear(flat, mlp.gate_up).view(m, -1, 2, 16).transpose(1, 2).contiguous()
        return out[:, 0].view(*x.shape[:-1], -1), out[:, 1].view(*x.shape[:-1], -1)

    def down(act: torch.Tensor) -> torch.Tensor:
        out = mlp.kernel.linear(act.reshape(-1, act.shape[-1]).contiguous(), mlp.down)
        return out.view(*act.shape[:-1], -1)

    return gate_up, down


def _adapted_mlp(mlp: nn.Module, rows: AdapterRows, prefix: str) -> nn.Module:
    if hasattr(mlp, "gate_proj"):  # DenseMLP: plain, widened or quantised projections, each adapted alone
        for site in MLP_SITES:
            leaf = site.split(".")[1]
            setattr(mlp, leaf, AdaptedLinear(getattr(mlp, leaf), rows, f"{prefix}.{site}"))
        return mlp
    if isinstance(mlp, cpu.LeanDenseMLP):
        return AdaptedGatedMLP(mlp, *_lean_mlp_parts(mlp), mlp.approximate, rows, prefix)
    if isinstance(mlp, native.AMXGatedMLP):
        approximate = "none" if mlp.exact_gelu else "tanh"
        return AdaptedGatedMLP(mlp, *_amx_mlp_parts(mlp), approximate, rows, prefix)
    raise TypeError(f"no adapted form of {type(mlp).__name__}")


@torch.no_grad()
def adapted_network(net: nn.Module, slots: LoraSlots) -> nn.Module:
    """A copy of an engine network (every tensor shared; `net` itself unchanged) whose layers add
    the selected adapters' deltas (see the module); `selected(copy, rows)` picks each row's adapter."""
    fast, rows = cpu.tree_copy(net), AdapterRows(slots)
    for i, layer in enumerate(fast.layers):
        attn = layer.self_attn
        inner = getattr(attn, "attn", attn)  # kernels/fused.py's TritonAttention wraps the attention
        for leaf in ("q_proj", "k_proj", "v_proj", "o_proj"):
            base = getattr(inner, leaf)
            if base is not None:
                setattr(inner, leaf, AdaptedLinear(base, rows, f"layers.{i}.self_attn.{leaf}"))
        layer.mlp = _adapted_mlp(layer.mlp, rows, f"layers.{i}")
    fast.lora_rows = rows
    return fast


__all__ = [
    "MLP_SITES",
    "SITES",
    "AdaptedGatedMLP",
    "AdaptedLinear",
    "AdapterRows",
    "LoraSlots",
    "RowGroups",
    "adapted_network",
    "device_rows",
    "on_device",
    "selected",
    "site_shapes",
]
