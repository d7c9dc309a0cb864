"""What resolving a model name gives: a local checkpoint directory, what to call it, where it came
from, and the scheme the fit check chose (its own module: resolve.py and fetch.py both make one)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .fit import Fit, FitRequest


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint directory ready to load, and what to call it."""

    path: Path
    name: str  # the repo id of a hub checkpoint (what `serve` serves it as), else the directory's name
    repo_id: str | None = None
    commit: str | None = None  # the hub commit the snapshot holds
    quantization: str | None = None  # the scheme to load with: the one asked for, or auto's choice
    fit: Fit | None = None
    fetched: int = 0  # bytes this call downloaded


def scheme_to_load(result: Fit | None, request: FitRequest | None) -> str | None:
    """The scheme to load with: the fit check's pick, else what was asked (never "auto")."""
    if result is not None:
        return result.scheme
    return request.quantization if request is not None and request.quantization != "auto" else None
