"""Old import paths of modules that moved (layout v3), forwarded to where they live now.

`import dgemma.engine.kv_cache` gives the very module `dgemma.dense.kv_cache` (one module object under
two names), so code and pickles written against the old layout keep working, and a patch made
through either name patches the one module. Tests use the new names (tests/test_layout.py checks).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

MOVED = {  # old module path -> where it lives now
    "dgemma.engine.kv_cache": "dgemma.dense.kv_cache",
    "dgemma.engine.reference": "dgemma.dense.reference",
    "dgemma.engine.ar": "dgemma.dense.ar",
    "dgemma.engine.grammar": "dgemma.engine.constraints.grammar",
    "dgemma.infill": "dgemma.engine.constraints.infill",
    "dgemma.tokenizer": "dgemma.inputs.tokenizer",
    "dgemma.media": "dgemma.inputs",
    "dgemma.media.processor": "dgemma.inputs.processor",
    "dgemma.media.decode": "dgemma.inputs.decode",
    "dgemma.media.inputs": "dgemma.inputs.model_inputs",
    "dgemma.kernels.dequant": "dgemma.kernels.avx2",
    "dgemma.chat": "dgemma.cli.chat",
    "dgemma.bench": "dgemma.cli.bench",  # the measuring code is dgemma.benchmark; cli.bench forwards its names
    "dgemma.quant.cli": "dgemma.cli.quantize",
    "dgemma.serve.loadtest": "dgemma.cli.loadtest",
    "dgemma.quant.checkpoint": "dgemma.quant.read",  # split; its documented names (read_quantized, ...) read
    "dgemma.serve.media": "dgemma.serve.media_sources",
}


def new_name(name: str) -> str | None:
    """Where the module once called `name` lives now, or None if it did not move."""
    return MOVED.get(name)


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path and hands back the module already imported under its new one."""

    def find_spec(self, name, path=None, target=None):
        target_name = new_name(name)
        if target_name is None:
            return None
        return importlib.machinery.ModuleSpec(name, self, origin=target_name)

    def create_module(self, spec):
        return importlib.import_module(spec.origin)

    def exec_module(self, module):  # the module ran once, under its new name
        pass

    def get_code(self, name):  # `python -m old.path` runs the new module's code
        spec = importlib.util.find_spec(new_name(name))
        return spec.loader.get_code(spec.name)


def install() -> None:
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.insert(0, _Alias())
