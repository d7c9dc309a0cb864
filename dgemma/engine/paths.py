"""The decode paths: how one request's denoising step runs this step, and how the step batches them.

    path             module                   runs                                  takes
    FusedTurboPath   engine/fused/paths.py    the pass and decisions on the device,  turbo requests holding a canvas
                                              one captured graph a group (GPU)      K/V slot
    HostTurboPath    engine/host/turbo.py     eager; decisions on the host path      the other turbo requests
    FusedPath        engine/fused/paths.py    the step on the device, one captured  the rest, unless their decisions
                                              graph a group (GPU)                    need the host (a grammar's walk)
    HostPath         engine/host/step.py      eager; decisions on the host path      everything else (every request
                                                                                     on a CPU)

A path answers `accepts(request)`, names the graph a group of its would replay (`graph_key`,
None: eager) and runs a group (`run(group, copy_out)`: `copy_out` when another group replays the
same graph this step, which would overwrite the outputs). The runner asks the paths in the order
above, once per request per step (`Runner.choose`), then batches each path's requests as
`group_requests` says. AR mode is not a denoising step: `Model.ar_events` picks its loop
(engine/fused/ar.py on the Triton path, dense/ar.py elsewhere).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from .request import Request
from .step_plan import DecodeResult


class DecodePath(Protocol):
    """One way a group's denoising step runs (see the module)."""

    name: str

    def accepts(self, r: Request) -> bool: ...
    def graph_key(self, group: list[Request]) -> tuple | None: ...
    def run(self, group: list[Request], copy_out: bool = False) -> list[DecodeResult]: ...


def group_requests(
    requests: list[Request],
    path_of: Callable[[Request], DecodePath],
    order: tuple[DecodePath, DecodePath, DecodePath, DecodePath],
    batch_invariant: bool,
    largest: int | None,
) -> list[tuple[DecodePath, list[Request]]]:
    """The step's groups, in the order they run: `order` is (host, fused, fused turbo, host turbo).

    Batch invariant: one request a group, the default step's in request order (host and fused
    alike), then the fused turbo ones, then the host turbo ones. Otherwise the host path's
    requests, the fused path's and the fused turbo path's in chunks of `largest` (the largest
    graph bucket; without graphs, all of them at once), then every host turbo request in one
    group (each one's active rows padded to the group's most). On a GPU the grouping decides the
    batch, and so the numerics: tests/engine/test_paths.py pins it."""
    host, fused, fused_turbo, host_turbo = order
    of = {path.name: [r for r in requests if path_of(r) is path] for path in order}
    if batch_invariant:
        default = [(path_of(r), [r]) for r in requests if path_of(r) in (host, fused)]
        return default + [(p, [r]) for p in (fused_turbo, host_turbo) for r in of[p.name]]
    size = largest or max(1, *(len(of[p.name]) for p in (host, fused, fused_turbo)))
    groups = [
        (p, of[p.name][i : i + size]) for p in (host, fused, fused_turbo) for i in range(0, len(of[p.name]), size)
    ]
    return groups + ([(host_turbo, of[host_turbo.name])] if of[host_turbo.name] else [])
