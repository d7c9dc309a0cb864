"""Tokens per forward with a grammar against without one, on the same prompts and seeds.

    python scripts/grammar_speed.py [--model DIR] [--prompts 16] [--max-new-tokens 128]

Structured output must keep the canvas parallel: docs/server.md reports this script's table
(issue #14 asks for at least half the unconstrained tokens per forward on dgemma-tiny). Tokens
per forward is the engine's one definition (generated tokens up to EOS per decoder pass).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import dgemma  # noqa: E402

PROMPTS = [
    "import os\n",
    "def parse(data):\n    return",
    "class Config:\n",
    "for line in lines:\n",
    "# Copyright",
    "import json\n\ndef load(path):\n",
    "def __init__(self, name):\n",
    "try:\n    import",
    "if __name__ == '__main__':\n",
    "def test_",
    "from typing import",
    "    def read(self, n=-1):\n",
    "x = [",
    "raise ValueError(",
    "with open(path) as f:\n",
    "def encode(s, errors='strict'):\n",
]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "kind": {"enum": ["function", "class", "module"]},
        "args": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "line": {"type": "integer", "minimum": 1, "maximum": 9999},
        "public": {"type": "boolean"},
    },
    "required": ["name", "kind", "args", "line", "public"],
    "additionalProperties": False,
}
REGEX = r"(def|class) [a-z_]{1,16}\((self)?(, [a-z_]{1,8}){0,3}\):"


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name"))
    except Exception:  # noqa: BLE001
        return platform.processor() or "unknown CPU"


def run(model, prompts, seeds, max_new_tokens, grammar=None) -> dict:
    start = time.perf_counter()
    out = model.generate(prompts, max_new_tokens=max_new_tokens, seed=seeds, grammar=grammar)
    elapsed = time.perf_counter() - start
    tokens = sum(len(s) for s in out.sequences)
    passes = sum(out.decoder_passes)
    return {
        "tokens_per_forward": statistics.mean(out.tokens_per_forward),
        "tokens": tokens,
        "passes": passes,
        "seconds": elapsed,
        "texts": [model.tokenizer.decode(s) for s in out.sequences],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the shipped dgemma-tiny)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    model = dgemma.load(args.model) if args.model else dgemma.load()
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.prompts)]
    seeds = list(range(args.prompts))
    model.generate(prompts[:1], max_new_tokens=32, seed=0)  # warm-up
    rows = [("none", run(model, prompts, seeds, args.max_new_tokens))]
    for kind, spec in (("json_schema", SCHEMA), ("regex", REGEX)):
        rows.append((kind, run(model, prompts, seeds, args.max_new_tokens, model.compile_grammar(kind, spec))))
    base = rows[0][1]["tokens_per_forward"]
    print(
        f"CPU: {cpu_name()}; model: {model.path}; {args.prompts} prompts, seeds 0..{args.prompts - 1}, "
        f"max_new_tokens {args.max_new_tokens}, the checkpoint's sampler defaults"
    )
    print("| grammar | tokens per forward (mean) | vs none | tokens | decoder passes | seconds |")
    print("|---|---|---|---|---|---|")
    for name, r in rows:
        print(
            f"| {name} | {r['tokens_per_forward']:.2f} | {r['tokens_per_forward'] / base:.2f}x | {r['tokens']} | "
            f"{r['passes']} | {r['seconds']:.1f} |"
        )
    for name, r in rows[1:]:
        valid = sum(1 for t in r["texts"] if _valid(name, t))
        print(f"{name}: {valid}/{len(r['texts'])} answers complete and valid; first: {r['texts'][0]!r}")
    return 0


def _valid(kind: str, text: str) -> bool:
    import re

    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    try:
        import jsonschema

        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except Exception:  # noqa: BLE001
        return False


if __name__ == "__main__":
    sys.exit(main())
