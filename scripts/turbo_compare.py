"""Exact against turbo denoising, the parts the comparison scripts share: turbo settings by name,
--turbo flags, the seeds of a comparison and bootstrap intervals (scripts/turbo_quality.py,
scripts/sudoku_infill.py, scripts/infill_eval.py)."""

from __future__ import annotations

import argparse

import numpy as np

PRESETS = {
    "default": {},
    "aggressive": {"turbo_dormant_entropy": 1.0},
    "refresh4": {"turbo_refresh_every": 4},
}
KNOBS = (
    ("turbo_freeze_passes", int),
    ("turbo_freeze_entropy", float),
    ("turbo_refresh_every", int),
    ("turbo_dormant_entropy", float),
)
NOISE = "exact, other seed"


def setting(text: str) -> tuple[str, dict]:
    """A --settings entry: a preset's name or NAME=K,E,R[,D] -> (name, generate's turbo knobs)."""
    if text in PRESETS:
        return text, {"turbo": True, **PRESETS[text]}
    name, sep, spec = text.partition("=")
    values = spec.split(",")
    if not sep or not name or name in ("exact", NOISE) or len(values) not in (3, 4):
        raise argparse.ArgumentTypeError(
            f"{text!r}: a setting is one of {', '.join(PRESETS)} or NAME=K,E,R[,D] (e.g. f3=3,0.1,0)"
        )
    knobs: dict = {"turbo": True}
    for (key, kind), value in zip(KNOBS, values):
        if value:
            try:
                knobs[key] = kind(value)
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"{text!r}: {key} takes {kind.__name__} values, got {value!r}"
                ) from None
    return name, knobs


def add_turbo_options(p: argparse.ArgumentParser) -> None:
    """--turbo and its knobs, for the task scripts (scripts/sudoku_infill.py, scripts/infill_eval.py)."""
    p.add_argument("--turbo", action="store_true", help="run the diffusion methods with turbo denoising")
    p.add_argument("--turbo-freeze-passes", type=int, help="with --turbo (default: the engine's)")
    p.add_argument("--turbo-freeze-entropy", type=float, help="with --turbo (default: the engine's)")
    p.add_argument("--turbo-refresh-every", type=int, help="with --turbo, 0 for never (default: the engine's)")
    p.add_argument("--turbo-dormant-entropy", type=float, help="with --turbo, 0 for never (default: the engine's)")
    p.add_argument("--compare-turbo", action="store_true", help="exact vs turbo (default, aggressive), side by side")
    p.add_argument("--compare-seeds", type=int, default=5, help="with --compare-turbo: seeds per case")


def compared(args: argparse.Namespace) -> dict[str, dict]:
    """--compare-turbo's settings: exact, exact with other seeds (NOISE: the noise floor), default,
    aggressive, and the --turbo flags' own if given."""
    out = {"exact": {}, NOISE: {}, "default": {"turbo": True}, "aggressive": {"turbo": True, **PRESETS["aggressive"]}}
    if args.turbo:
        out["--turbo flags"] = turbo_knobs(args)
    return out


def compare_seed(base: int, item: int, repeat: int, setting: str) -> int:
    """--compare-turbo's seed for one case or puzzle: base + item + 10**6 repeat, + 500000 on the
    noise floor's row (so no two calls share a seed while items < 500000)."""
    return base + item + 10**6 * repeat + (500_000 if setting == NOISE else 0)


def turbo_knobs(args: argparse.Namespace) -> dict:
    """generate's / infill's turbo keywords from add_turbo_options' flags ({} without --turbo)."""
    if not args.turbo:
        return {}
    knobs = {"turbo": True}
    for key, _ in KNOBS:
        if getattr(args, key) is not None:
            knobs[key] = getattr(args, key)
    return knobs


def bootstrap(
    num: np.ndarray,
    den: np.ndarray,
    resamples: int = 1000,
    seed: int = 0,
    base: tuple[np.ndarray, np.ndarray] | None = None,
    ratio: bool = False,
) -> dict:
    """sum(num) / sum(den) over prompts, with a 95% interval from resampling prompts.

    `base` (num, den of another setting on the same prompts): the statistic is this one minus
    that one (`ratio`: that one over this one), both on the same resample."""
    num, den = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
    idx = np.random.default_rng(seed).integers(0, len(num), size=(resamples, len(num)))

    def stat(rows) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            own = num[rows].sum(-1) / den[rows].sum(-1)
            if base is None:
                return own
            other = base[0][rows].sum(-1) / base[1][rows].sum(-1)
            return other / own if ratio else own - other

    point = float(stat(np.arange(len(num))))
    lo, hi = np.nanpercentile(stat(idx), [2.5, 97.5]) if len(num) else (float("nan"),) * 2
    return {"value": point, "lo": float(lo), "hi": float(hi)}


def interval(r: dict, fmt: str) -> str:
    """A bootstrap result as `value [lo, hi]`."""
    return f"{r['value']:{fmt}} [{r['lo']:{fmt}}, {r['hi']:{fmt}}]"
