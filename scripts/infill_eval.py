"""Infill one masked line of held-out standard-library code, against the same model's AR mode.

    python scripts/infill_eval.py [--cases 300] [--seed 0] [--threads 1]
    python scripts/infill_eval.py --cases 20          # smoke run, about a minute

Cases come from the files the shipped model's training held out (`dgemma.train.data.held_out`
on the `stdlib/<path>` names, fraction 0.02: the 30 files of MODEL_CARD.md), taken round-robin
over the files (one random line of each in turn, so the big test files do not dominate). A case
hides one non-blank line: in the file's own tokenization, the span is the whitespace token that
holds the newline before the line (and any blank lines and indentation it carries) through the
line's last non-blank token, at most `--max-span` tokens; the prefix is up to `--prefix-tokens`
tokens before it (the model trained on 256-token windows, so prompt + canvas stay inside one),
the suffix is the text after it. Cutting at the file's token boundaries keeps the tokenization of
prefix, span and suffix, each encoded alone, equal to the file's (cases where it is not are skipped).

Methods, on the same cases with the same seeds (case i: seed `--seed` + i):
  (a) `model.infill(prefix, suffix, span_length=n)`, n = the span's true token count (oracle);
  (b) `model.infill(prefix, suffix)`: the length chosen by the model among infill.DEFAULT_LENGTHS;
  (c) `model.generate(prefix, mode="ar")`, greedy, `--max-span` + 8 tokens, prefix only;
  (d) `model.generate(prefix)`: diffusion continuing the prefix (one canvas), no suffix.
Every output is cut to its first line (its leading whitespace, then up to the first newline after
non-blank text). Exact: equal to the span after stripping trailing whitespace; stripped: equal
after stripping both ends (ignores indentation and blank lines); edit: Levenshtein distance over
max(len) of the two (trailing whitespace stripped), averaged. Infill makes one call per case (b:
9 canvases per call), `--workers` calls at a time on threads; with more than one the engine runs
batched decoder passes (`batch_invariant=False`, the GPU default) instead of the CPU default of
one request per pass, about twice as fast here, with the same texts on the cases checked (CPU
rounding may differ in the last bit with the batch, so rarely a token could). AR and diffusion
run `--batch` prompts per call.
"""

from __future__ import annotations

import argparse
import bisect
import json
import platform
import random
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

import dgemma
from dgemma.engine.constraints.infill import DEFAULT_LENGTHS
from dgemma.train.data import held_out, stdlib_files, stdlib_root


@dataclass
class Case:
    name: str
    line: int  # 1-based line number in the file
    prefix: str
    span: str
    suffix: str
    n: int  # the span's tokens


def levenshtein(a: str, b: str) -> int:
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def first_line(text: str) -> str:
    """Leading whitespace (newlines, indentation), then the text up to the next newline."""
    return re.match(r"\s*[^\n]*", text).group(0)


def held_out_files(fraction: float) -> list[tuple[str, str]]:
    root = stdlib_root()
    named = [(f"stdlib/{p.relative_to(root).as_posix()}", p) for p in stdlib_files(root)]
    return [(name, p.read_text(encoding="utf-8", errors="replace")) for name, p in named if held_out(name, fraction)]


def file_cases(tok, name: str, text: str, max_span: int, prefix_tokens: int) -> list[Case]:
    """Every line of one file that makes a case (see the module docstring)."""
    ids, offsets = tok.encode_with_offsets(text)
    starts = [s for s, _ in offsets]
    out, pos = [], 0
    for number, line in enumerate(text.split("\n"), 1):
        line_start, pos = pos, pos + len(line) + 1
        if not line.strip() or line_start == 0:
            continue
        a = bisect.bisect_right(starts, line_start - 1) - 1  # the token holding the newline before the line
        end = line_start + len(line.rstrip())
        b = bisect.bisect_left(starts, end)  # the first token after the line's text
        if (
            a < 1
            or not 1 <= b - a <= max_span
            or offsets[b - 1][1] != end
            or not text[offsets[a][0] : offsets[a][1]].isspace()
        ):
            continue
        first = max(0, a - prefix_tokens)
        prefix = text[offsets[first][0] : offsets[a][0]]
        span = text[offsets[a][0] : end]
        suffix = text[end : offsets[b + 64][0]] if b + 64 < len(ids) else text[end:]
        alone = [tok.encode(part, add_special_tokens=False) for part in (prefix, span, suffix)]
        if alone[0][-8:] != ids[max(0, a - 8) : a] or alone[1] != ids[a:b] or alone[2][:32] != ids[b : b + 32]:
            continue  # prefix / span / suffix tokenized alone differ from the file at a cut
        out.append(Case(name, number, prefix, span, suffix, b - a))
    return out


def build_cases(
    tok, count: int, seed: int, max_span: int, prefix_tokens: int, fraction: float
) -> tuple[list[Case], int]:
    rng = random.Random(seed)
    pools = []
    for name, text in held_out_files(fraction):
        pool = file_cases(tok, name, text, max_span, prefix_tokens)
        rng.shuffle(pool)
        pools.append(pool)
    files = len(pools)
    cases = []
    while len(cases) < count and any(pools):
        for pool in pools:
            if pool and len(cases) < count:
                cases.append(pool.pop())
    return cases, files


def score(outputs: list[str], cases: list[Case]) -> dict:
    exact = stripped = dist = 0.0
    for out, case in zip(outputs, cases):
        hyp, ref = first_line(out).rstrip(), case.span.rstrip()
        exact += hyp == ref
        stripped += hyp.strip() == ref.strip()
        dist += levenshtein(hyp, ref) / max(len(hyp), len(ref), 1)
    k = len(cases)
    return {"exact": exact / k, "stripped": stripped / k, "edit": dist / k}


def batched(model, cases: list[Case], seed: int, batch: int, **kwargs) -> list[str]:
    tok, out = model.tokenizer, []
    for s in range(0, len(cases), batch):
        group = cases[s : s + batch]
        gen = model.generate(
            [tok.encode(c.prefix) for c in group], seed=[seed + s + i for i in range(len(group))], **kwargs
        )
        out += [tok.decode(seq) for seq in gen.sequences]
    return out


def cpu_name() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def compare_turbo(model, cases: list[Case], args) -> None:
    """--compare-turbo: method (a) exact and with turbo on the same cases and seeds, side by side."""
    from turbo_compare import bootstrap, compare_seed, compared, interval

    from dgemma.engine.events import collect

    settings, k, tok = compared(args), len(cases), model.tokenizer
    sums = {
        name: {key: (np.zeros(k), np.zeros(k)) for key in ("exact", "edit", "same", "positions")} for name in settings
    }
    seconds, texts = dict.fromkeys(settings, 0.0), {}

    def add(name: str, key: str, i: int, num: float, den: float = 1.0) -> None:
        sums[name][key][0][i] += num
        sums[name][key][1][i] += den

    for r in range(args.compare_seeds):
        for name, knobs in settings.items():

            def one(i: int, r: int = r, name: str = name, knobs: dict = knobs):  # this iteration's values
                c = cases[i]
                gen = collect(
                    model.infill_stream(
                        c.prefix,
                        c.suffix,
                        span_length=c.n,
                        seed=compare_seed(args.seed, i, r, name),
                        drafts=False,
                        **knobs,
                    )
                )
                return tok.decode(gen.sequences[0][: c.n]), gen.decoder_positions[0]

            t0 = time.perf_counter()
            with ThreadPoolExecutor(args.workers) as pool:
                res = list(pool.map(one, range(k)))
            seconds[name] += time.perf_counter() - t0
            for i, ((text, positions), c) in enumerate(zip(res, cases)):
                texts[name, r, i] = text
                hyp, ref = first_line(text).rstrip(), c.span.rstrip()
                add(name, "exact", i, hyp == ref)
                add(name, "edit", i, levenshtein(hyp, ref) / max(len(hyp), len(ref), 1))
                add(name, "same", i, text == texts["exact", r, i])
                add(name, "positions", i, positions, c.n)
            print(f"seed repeat {r}, {name}: {seconds[name]:.0f} s so far", flush=True)
    cmd = "python " + " ".join(["scripts/infill_eval.py", *sys.argv[1:]])
    print(
        f"\n`{cmd}`: method (a), {k} cases x {args.compare_seeds} seeds, {cpu_name()}, {torch.get_num_threads()} torch "
        f"thread(s), {args.workers} worker(s)\n"
    )
    print(
        "| setting | exact | mean edit distance | same span as exact | positions per span token | x fewer positions | cases/s |"
    )
    print("|---|---|---|---|---|---|---|")
    rows = []
    for name, knobs in settings.items():
        m, e = sums[name], sums["exact"]
        fewer = bootstrap(*m["positions"], base=e["positions"], ratio=True)
        row = {
            "setting": name,
            "knobs": knobs,
            **{key: bootstrap(*m[key]) for key in m},
            "x_fewer_positions": fewer,
            "cases_per_s": k * args.compare_seeds / seconds[name],
        }
        rows.append(row)
        cells = [
            name,
            interval(row["exact"], ".1%"),
            interval(row["edit"], ".3f"),
            interval(row["same"], ".1%"),
            f"{row['positions']['value']:.1f}",
            interval(fewer, ".2f"),
            f"{row['cases_per_s']:.2f}",
        ]
        print("| " + " | ".join(cells) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": cmd, "cpu": cpu_name(), "rows": rows}, f, indent=1)


def main() -> None:
    from turbo_compare import add_turbo_options, turbo_knobs

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint directory (default: the shipped dgemma-tiny)")
    p.add_argument("--cases", type=int, default=300)
    p.add_argument("--seed", type=int, default=0, help="picks the cases; case i samples with seed + i")
    p.add_argument("--max-span", type=int, default=16, help="most tokens a hidden line may have")
    p.add_argument("--prefix-tokens", type=int, default=192, help="the prefix is at most this many tokens")
    p.add_argument("--eval-fraction", type=float, default=0.02, help="the training run's held-out fraction")
    p.add_argument("--batch", type=int, default=16, help="prompts per call of the AR and diffusion baselines")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--workers", type=int, default=8, help="concurrent infill calls (1: one at a time, batch-invariant)")
    p.add_argument("--no-diffusion", action="store_true", help="skip (d)")
    p.add_argument("--out", help="write the figures and every case's outputs as JSON here")
    add_turbo_options(p)
    args = p.parse_args()
    knobs = turbo_knobs(args)
    torch.set_num_threads(args.threads)
    model = dgemma.load(args.model)
    tok = model.tokenizer
    cases, files = build_cases(tok, args.cases, args.seed, args.max_span, args.prefix_tokens, args.eval_fraction)
    if not cases:
        sys.exit("no cases: no held-out file has a line that fits")
    print(
        f"{len(cases)} cases from {len({c.name for c in cases})} of {files} held-out files; "
        f"span tokens: mean {sum(c.n for c in cases) / len(cases):.1f}, max {max(c.n for c in cases)}",
        flush=True,
    )

    if args.workers > 1:  # concurrent calls share the engine's decoder passes (see the docstring)
        model.configure_engine(batch_invariant=False)
    if args.compare_turbo:
        return compare_turbo(model, cases, args)

    def infill(span_length):
        def one(i: int):
            return model.infill(
                cases[i].prefix, cases[i].suffix, span_length=span_length(cases[i]), seed=args.seed + i, **knobs
            )

        with ThreadPoolExecutor(args.workers) as pool:
            res = list(pool.map(one, range(len(cases))))
        return [r.text for r in res], res

    methods = [
        ("(a) infill, oracle span length", "yes", lambda: infill(lambda c: c.n)),
        ("(b) infill, length chosen by the model", "yes", lambda: infill(lambda c: None)),
        (
            "(c) AR (greedy), prefix only",
            "no",
            lambda: (batched(model, cases, args.seed, args.batch, mode="ar", max_new_tokens=args.max_span + 8), None),
        ),
        (
            "(d) diffusion, prefix only (one canvas)",
            "no",
            lambda: (
                batched(model, cases, args.seed, args.batch, max_new_tokens=model.config.canvas_length, **knobs),
                None,
            ),
        ),
    ]
    if args.no_diffusion:
        methods.pop()
    rows, records = [], [{"file": c.name, "line": c.line, "span": c.span, "n": c.n} for c in cases]
    for label, sees, run in methods:
        t0 = time.perf_counter()
        outputs, results = run()
        seconds = time.perf_counter() - t0
        row = {"method": label, "suffix": sees, **score(outputs, cases), "cases_per_s": len(cases) / seconds}
        if results is not None and label.startswith("(b)"):
            row["oracle_length_chosen"] = sum(r.span_length == c.n for r, c in zip(results, cases)) / len(cases)
            row["chosen_lengths"] = {n: sum(r.span_length == n for r in results) for n in DEFAULT_LENGTHS}
            ranges = sorted(max(r.scores.values()) - min(r.scores.values()) for r in results)
            row["median_score_range"] = ranges[len(ranges) // 2]  # best minus worst candidate, nats per token
            for record, r in zip(records, results):
                record["(b) scores"] = r.scores
        rows.append(row)
        for record, out in zip(records, outputs):
            record[label[:3]] = out
        print(json.dumps(row), flush=True)

    cmd = "python " + " ".join(["scripts/infill_eval.py", *sys.argv[1:]])
    print(
        f"\n`{cmd}`: {len(cases)} cases, {cpu_name()}, {torch.get_num_threads()} torch thread(s), {args.workers} worker(s), "
        f"turbo {knobs or 'off'}, "
        f"torch {torch.__version__}, Python {platform.python_version()}\n"
    )
    print("| method | sees the suffix | exact | exact, stripped | mean edit distance | cases/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        cells = [
            r["method"],
            r["suffix"],
            f"{r['exact']:.1%}",
            f"{r['stripped']:.1%}",
            f"{r['edit']:.3f}",
            f"{r['cases_per_s']:.2f}",
        ]
        print("| " + " | ".join(cells) + " |")
    for r in rows:
        if "chosen_lengths" in r:
            print(
                f"\n(b) chose the oracle length in {r['oracle_length_chosen']:.1%} of cases; lengths chosen: "
                f"{r['chosen_lengths']}; median gap between the best and worst candidate's score: "
                f"{r['median_score_range']:.2e} nats per token"
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": cmd, "cpu": cpu_name(), "rows": rows, "cases": records}, f, indent=1)


if __name__ == "__main__":
    main()
