"""The check modules the worker runs (one group for all): each `check_*` function, in order."""

import importlib

MODULES = (
    "checks_model",
    "checks_sampling",
    "checks_engine",
    "checks_quant",
    "checks_grammar",
    "checks_vision",
    "checks_failure",
)


def all_checks():
    """[(module.function name, function)] in a fixed order (the same on every rank)."""
    out = []
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            continue
        out += [(f"{name}.{f}", getattr(module, f)) for f in sorted(vars(module)) if f.startswith("check_")]
    return out
