"""How deep and how big a grammar llguidance compiles before it crashes, per thread stack size.

    python scripts/grammar_limits.py [--model DIR] [--stacks 64,main] [--only CASE,...] [--json]

llguidance compiles grammars with recursive native code: past some depth it overflows the stack
of the thread it runs on (a segfault, no Python exception). This script measures, for each kind
of grammar the server takes, the largest size that compiles (and answers a first token mask)
without crashing, on a thread with a big stack (64 MiB: the server's compile and engine threads,
dgemma/serve/threads.py) and on the main thread (8 MiB by default, `ulimit -s`) for comparison.
Each attempt runs in a child process, so a crash kills the attempt, not the script. Sizes grow
by doubling until an attempt fails, then bisect; an attempt that llguidance refuses cleanly (an
error, not a crash) is noted and the search for a crash goes on past it. Columns:

    accepted   largest size compiled without error
    refused    smallest size llguidance refused with an error (no crash), if any
    crash      smallest size that crashed (a signal), or ">N": none up to the largest tried
    safe       largest size that did not crash (nor time out)
    time, rss  compile + first mask seconds, and the child's peak memory, at `accepted`

dgemma/serve/structured/limits.py sets the server's limits from these (a quarter of the crash
points, or lower where compile time is the bound); docs/server.md has the table.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import resource
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "dgemma" / "assets" / "dgemma-tiny"


def pure_module(name: str):
    """A pure module of dgemma.serve, imported without dgemma/__init__.py (which loads torch:
    seconds per child)."""
    for pkg, path in (("dgemma", ROOT / "dgemma"), ("dgemma.serve", ROOT / "dgemma" / "serve")):
        if pkg not in sys.modules:
            module = types.ModuleType(pkg)
            module.__path__ = [str(path)]
            sys.modules[pkg] = module
    return importlib.import_module(name)


# ------------------------------------------------------------------------------------ the cases
def lark_chain(n: int) -> tuple[str, str]:
    """n rules, each referring to the next: reference depth n."""
    return "lark", "start: r0\n" + "".join(f'r{i}: "a" r{i + 1}\n' for i in range(n)) + f'r{n}: "b"\n'


def lark_terminals(n: int) -> tuple[str, str]:
    """n terminals, each made of the next: a chain the lexer inlines into one regex."""
    return "lark", "start: T0\n" + "".join(f'T{i}: "a" T{i + 1}\n' for i in range(n)) + f'T{n}: "b"\n'


def lark_tree(n: int) -> tuple[str, str]:
    """n rules in a binary tree (reference depth log2 n), 32-byte literals: size, not depth."""
    rules = []
    for i in range(n):
        kids = [k for k in (2 * i + 1, 2 * i + 2) if k < n]
        alts = [f'"{i:032d}"'] + [f'"-" r{k}' for k in kids]
        rules.append(f"r{i}: " + " | ".join(alts))
    return "lark", "start: r0\n" + "\n".join(rules) + "\n"


def lark_literal(n: int) -> tuple[str, str]:
    """One string literal of n bytes (text size, not depth)."""
    return "lark", 'start: "' + "ab" * (n // 2) + "a" * (n % 2) + '"\n'


def lark_groups(n: int) -> tuple[str, str]:
    return "lark", "start: " + "(" * n + '"a"' + ")" * n + "\n"


def regex_groups(n: int) -> tuple[str, str]:
    return "regex", "(" * n + "a" + ")" * n


def choices(n: int) -> tuple[str, str]:
    """guided_choice with n entries, as serve/structured/formats.py writes it."""
    return "regex", "|".join(f"(?:{re.escape(f'choice-{i}')})" for i in range(n))


def json_depth(n: int) -> tuple[str, dict]:
    schema: dict = {"type": "string"}
    for _ in range(n):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return "json", schema


def json_properties(n: int) -> tuple[str, dict]:
    return "json", {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}


def json_refs(n: int) -> tuple[str, dict]:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return "json", {"$defs": defs, "$ref": "#/$defs/d0"}


def json_arrays(n: int) -> tuple[str, dict]:
    schema: dict = {"type": "integer"}
    for _ in range(n):
        schema = {"type": "array", "items": schema}
    return "json", schema


def _tool(params: dict) -> tuple[str, str]:
    tools = pure_module("dgemma.serve.tools")
    tool_grammar = pure_module("dgemma.serve.tools.grammar")
    spec = tools.ToolSpec([{"type": "function", "function": {"name": "f", "parameters": params}}], "function", "f")
    return "lark", tool_grammar.tool_call_grammar(spec, tool_grammar.lark_string)


def tool_properties(n: int) -> tuple[str, str]:
    """A forced call of a function with n integer parameters, every other one required."""
    props = {f"p{i}": {"type": "integer"} for i in range(n)}
    return _tool({"type": "object", "properties": props, "required": [f"p{i}" for i in range(0, n, 2)]})


def tool_depth(n: int) -> tuple[str, str]:
    """A forced call whose one parameter is an object nested n deep."""
    schema: dict = {"type": "string", "maxLength": 4}
    for _ in range(n):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return _tool({"type": "object", "properties": {"a": schema}, "required": ["a"]})


CASES = {
    "lark_chain": (lark_chain, 1 << 17, "Lark rules, each referring to the next"),
    "lark_terminals": (lark_terminals, 1 << 17, "Lark terminals, each made of the next"),
    "lark_tree": (lark_tree, 1 << 17, "Lark rules in a binary tree (32-byte literals)"),
    "lark_literal": (lark_literal, 1 << 24, "one Lark string literal, bytes"),
    "lark_groups": (lark_groups, 1 << 16, "nested Lark groups ((...))"),
    "regex_groups": (regex_groups, 1 << 16, "nested regex groups ((a))"),
    "choices": (choices, 1 << 17, "guided_choice entries"),
    "json_depth": (json_depth, 1 << 14, "JSON schema objects nested"),
    "json_properties": (json_properties, 1 << 17, "JSON schema properties"),
    "json_refs": (json_refs, 1 << 17, "JSON schema $ref chain"),
    "json_arrays": (json_arrays, 1 << 14, "JSON schema arrays nested"),
    "tool_properties": (tool_properties, 1 << 16, "forced tool call: parameters"),
    "tool_depth": (tool_depth, 1 << 14, "forced tool call: objects nested"),
}


# ------------------------------------------------------------------------------------ one attempt (child)
def child(case: str, n: int, stack: str, model: str) -> None:
    """Compile one grammar and answer its first mask; print one JSON line."""
    import llguidance

    tokenizer = llguidance.LLTokenizer(Path(model, "tokenizer.json").read_text())
    out: dict = {}

    def attempt() -> None:
        start = time.perf_counter()
        try:
            kind, spec = CASES[case][0](n)
            grammar = {
                "lark": llguidance.LLMatcher.grammar_from_lark,
                "regex": llguidance.LLMatcher.grammar_from_regex,
                "json": lambda s: llguidance.LLMatcher.grammar_from_json_schema(
                    s, defaults={"whitespace_flexible": False}
                ),
            }[kind](spec)
            out["bytes"] = len(grammar if kind != "json" else json.dumps(spec))
            written = time.perf_counter()
            matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
            if not matcher.is_error():
                matcher.compute_bitmask()
            out["error"] = " ".join(matcher.get_error().split())[:160]
            out["write_s"] = written - start
        except Exception as e:  # noqa: BLE001 - a clean refusal from the Python side (RecursionError, ...)
            out["error"] = f"{type(e).__name__}: {e}"[:160]
        out["seconds"] = time.perf_counter() - start

    if stack == "main":
        attempt()
    else:
        threading.stack_size(int(stack) << 20)
        thread = threading.Thread(target=attempt)
        thread.start()
        thread.join()
    out["rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(out), flush=True)


# ------------------------------------------------------------------------------------ the search (parent)
def run_attempt(case: str, n: int, stack: str, model: str, timeout: float) -> dict:
    argv = [sys.executable, __file__, "--child", case, str(n), stack, "--model", model]
    try:
        run = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"outcome": "timeout", "n": n}
    if run.returncode != 0:
        return {"outcome": "crash", "n": n, "signal": -run.returncode if run.returncode < 0 else run.returncode}
    result = json.loads(run.stdout.strip().splitlines()[-1])
    return {"outcome": "error" if result["error"] else "ok", "n": n, **result}


def search(case: str, stack: str, model: str, timeout: float, limit: int, slow: float, log) -> dict:
    """The accepted / refused / crash boundaries of one case at one stack size."""
    seen: dict[int, dict] = {}

    def at(n: int) -> dict:
        if n not in seen:
            seen[n] = run_attempt(case, n, stack, model, timeout)
            r = seen[n]
            log(f"  {case} stack={stack} n={n}: {r['outcome']} {r.get('seconds', 0):.3f}s {r.get('error', '')[:70]}")
        return seen[n]

    def bisect(good: int, bad: int, is_good) -> int:
        while bad - good > max(1, good // 64):  # to within 1.6%
            mid = (good + bad) // 2
            good, bad = (mid, bad) if is_good(at(mid)) else (good, mid)
        return good

    # grow until an attempt is not clean (or is slow)
    n, last_ok = 1, 0
    while n <= limit:
        r = at(n)
        if r["outcome"] != "ok" or r["seconds"] > slow:
            break
        last_ok, n = n, n * 2
    first_bad = n if n <= limit else None
    accepted = (
        last_ok
        if first_bad is None
        else bisect(last_ok, first_bad, lambda r: r["outcome"] == "ok" and r["seconds"] <= slow)
    )
    # past a clean refusal or a slow compile: look for a crash further on
    n, last_safe = first_bad, accepted
    while n is not None and n <= limit and at(n)["outcome"] in ("ok", "error") and at(n).get("seconds", 0) <= 4 * slow:
        last_safe, n = n, n * 2
    crash = None
    if n is not None and n <= limit and at(n)["outcome"] in ("crash", "timeout"):
        last_safe = bisect(last_safe, n, lambda r: r["outcome"] in ("ok", "error"))
        crash = min(k for k, r in seen.items() if k > last_safe and r["outcome"] in ("crash", "timeout"))
    refused = min((k for k, r in seen.items() if r["outcome"] == "error"), default=None)
    best = seen.get(accepted, {})
    return {
        "case": case,
        "stack": stack,
        "accepted": accepted,
        "refused": refused,
        "crash": crash,
        "crash_kind": seen[crash]["outcome"] if crash else None,
        "safe": last_safe,
        "tried_up_to": max(seen),
        "seconds": best.get("seconds"),
        "rss_mib": best.get("rss_mib"),
        "bytes": best.get("bytes"),
        "refusal": seen[refused]["error"][:80] if refused else None,
        "stopped": "slow" if first_bad is not None and seen[first_bad]["outcome"] == "ok" else None,
    }


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        return next(ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name"))
    except Exception:  # noqa: BLE001
        return "unknown CPU"


def table(rows: list[dict]) -> str:
    head = "| case | stack | accepted | refused at | crash at | safe | time at accepted | peak RSS |"
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        crash = (
            f"{r['crash']:,}" + (" (timeout)" if r["crash_kind"] == "timeout" else "")
            if r["crash"]
            else f">{r['tried_up_to']:,}"
        )
        accepted = f"{r['accepted']:,}" + (" (slow past)" if r["stopped"] else "")
        lines.append(
            f"| {CASES[r['case']][2]} | {'8 MiB main' if r['stack'] == 'main' else r['stack'] + ' MiB thread'} | "
            f"{accepted} | {'' if r['refused'] is None else format(r['refused'], ',')} | {crash} | {r['safe']:,} | "
            f"{(r['seconds'] or 0):.3f} s | {(r['rss_mib'] or 0):.0f} MiB |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="checkpoint directory (its tokenizer.json)")
    parser.add_argument(
        "--stacks", default="64,main", help="thread stack sizes in MiB, and/or 'main' (the main thread)"
    )
    parser.add_argument("--only", default=",".join(CASES), help="cases, comma-separated: " + ", ".join(CASES))
    parser.add_argument("--max", type=int, default=0, help="largest size tried (default: per case)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per attempt (past it: a timeout)")
    parser.add_argument("--slow", type=float, default=2.0, help="compile seconds past which sizes stop growing")
    parser.add_argument("--json", action="store_true", help="the rows as JSON too")
    parser.add_argument("--quiet", action="store_true", help="no line per attempt")
    parser.add_argument("--child", nargs=3, metavar=("CASE", "N", "STACK"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), args.child[2], args.model)
        return 0
    cases = [c for c in args.only.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"unknown case {unknown[0]!r}; one of {', '.join(CASES)}")
    import llguidance  # noqa: F401 - fail early, not in every child

    log = (lambda *_: None) if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    rows = []
    for case in cases:
        for stack in args.stacks.split(","):
            rows.append(search(case, stack, args.model, args.timeout, args.max or CASES[case][1], args.slow, log))
    from importlib.metadata import version

    print(
        f"CPU: {cpu_name()}; llguidance {version('llguidance')}; Python {sys.version.split()[0]}; "
        f"command: python scripts/grammar_limits.py {' '.join(sys.argv[1:])}".rstrip()
    )
    print(table(rows))
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
