"""A Sudoku-like check of seeded canvases: fine-tune dgemma-tiny on 4x4 grids, then solve
held-out puzzles in one canvas whose given digits are fixed and whose blank cells denoise.

    python scripts/sudoku_infill.py [--steps 300] [--puzzles 192] [--seed 0]

An example, not a test: it reports what it measures, whatever that is.

- Grids: all 288 solved 4x4 Sudoku grids (digits 1-4; each row, column and 2x2 box holds each
  digit once). `--held-out-grids` of them (chosen by `--seed`) are never trained on; the
  puzzles are made from those, so solving one is not recalling a training grid.
- Layout: `# 4x4 sudoku\\n` is the prompt; the grid is four rows ` a b c d\\n`, 20 tokens
  (`' 1'`..`' 4'` are single tokens, the newline another), then EOS and pad: one 32-token canvas,
  cell (r, c) at canvas position 5r + c.
- Fine-tuning: full (not LoRA), the published objective, on `{"prompt", "completion"}` records
  of the training grids (loss on the grid and EOS), written to a temporary directory.
- Puzzles: cells blanked one at a time in random order while the solution stays unique, up to a
  number of blanks drawn from `--blanks` (a range). Solving: `model.generate` with
  `constraints=[FirstCanvas(CanvasConstraints.build(32, vocab, fixed=...))]`: the givens, the
  newlines, EOS and pad fixed; the blanks start as noise and denoise seeing the givens on both
  sides. Variant "digits only" also passes `allowed={blank: the four digit tokens}`.
- Scores: the share of blank cells equal to the solution, and of grids that are valid Sudoku
  grids (with unique solutions, the same as solved). A uniform random digit per blank gets
  25% of cells.
- `--turbo` (and `--turbo-freeze-passes/--turbo-freeze-entropy/--turbo-refresh-every/--turbo-dormant-entropy`) solves
  with turbo denoising (engine/turbo.py). `--compare-turbo`, after fine-tuning once, solves the
  held-out puzzles (both variants) with the fine-tuned model exact, exact with other seeds (the
  noise floor), turbo at its default, aggressive (noise positions rest above entropy 1.0) and the
  --turbo flags' own if given, `--compare-seeds` seeds each (puzzle i, repeat r: seed + i +
  10**6 r, + 500000 on the noise row), interleaved per repeat: cells and grids with bootstrap 95%
  intervals over puzzles (scripts/turbo_quality.py), the share of grids equal to exact's at the
  same seed, and decoder positions computed per committed canvas token.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from infill_eval import cpu_name  # scripts/ is on sys.path when this runs
from turbo_compare import add_turbo_options, bootstrap, compare_seed, compared, interval, turbo_knobs

import dgemma
from dgemma.engine.constraints import CanvasConstraints, FirstCanvas
from dgemma.engine.events import GenerationOutput
from dgemma.loading import default_model_dir
from dgemma.train.trainer import TrainArgs, train

PROMPT = "# 4x4 sudoku\n"
Grid = tuple[int, ...]  # 16 digits, row by row; 0 = blank


def units() -> list[list[int]]:
    rows = [[4 * r + c for c in range(4)] for r in range(4)]
    cols = [[4 * r + c for r in range(4)] for c in range(4)]
    boxes = [[4 * (br + r) + bc + c for r in range(2) for c in range(2)] for br in (0, 2) for bc in (0, 2)]
    return rows + cols + boxes


UNITS = units()


def valid(grid: Grid) -> bool:
    return all(sorted(grid[i] for i in unit) == [1, 2, 3, 4] for unit in UNITS)


def all_grids() -> list[Grid]:
    rows = list(itertools.permutations((1, 2, 3, 4)))
    return [g for g in (sum(rs, ()) for rs in itertools.product(rows, repeat=4)) if valid(g)]


def solutions(puzzle: Grid, grids: list[Grid]) -> int:
    return sum(all(p in (0, g) for p, g in zip(puzzle, grid)) for grid in grids)


def make_puzzle(grid: Grid, blanks: int, grids: list[Grid], rng: random.Random) -> Grid:
    """Blank cells of `grid` in random order, keeping the solution unique, up to `blanks` of them."""
    puzzle = list(grid)
    for cell in rng.sample(range(16), 16):
        if puzzle.count(0) == blanks:
            break
        puzzle[cell] = 0
        if solutions(tuple(puzzle), grids) > 1:
            puzzle[cell] = grid[cell]
    return tuple(puzzle)


def grid_text(grid: Grid) -> str:
    return "".join(" " + " ".join(str(d) for d in grid[4 * r : 4 * r + 4]) + "\n" for r in range(4))


def position(cell: int) -> int:
    return 5 * (cell // 4) + cell % 4


def digit_tokens(tok) -> dict[int, int]:
    """digit -> its token id, after checking the layout tokenizes as the docstring says."""
    digits = {}
    for d in range(1, 5):
        (digits[d],) = tok.encode(f" {d}", add_special_tokens=False)
    ids = tok.encode(grid_text((1, 2, 3, 4, 3, 4, 1, 2, 2, 1, 4, 3, 4, 3, 2, 1)), add_special_tokens=False)
    (newline,) = tok.encode("\n", add_special_tokens=False)
    assert len(ids) == 20 and ids[4::5] == [newline] * 4 and set(ids) - {newline} == set(digits.values()), ids
    return digits


def finetune(grids: list[Grid], args, tmp: Path) -> Path:
    data = tmp / "grids.jsonl"
    with data.open("w") as f:
        for g in grids:
            f.write(json.dumps({"prompt": PROMPT, "completion": grid_text(g)}) + "\n")
    targs = TrainArgs(
        out=str(tmp / "run"),
        data=[str(data)],
        model=str(args.model),
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=64,
        lr=args.lr,
        warmup=20,
        eval_fraction=0.0,
        eval_every=10**9,
        save_every=10**9,
        save_minutes=10**9,
        log_every=50,
        seed=args.seed,
        threads=args.threads,
    )
    t0 = time.perf_counter()
    result = train(targs)
    last = result.last_losses
    print(
        f"fine-tuned {args.steps} steps in {time.perf_counter() - t0:.0f} s; last loss {last.get('loss', float('nan')):.3f} "
        f"(diffusion {last.get('diffusion', float('nan')):.3f})",
        flush=True,
    )
    return result.out


def solve(
    model,
    puzzles: list[Grid],
    digits: dict[int, int],
    only_digits: bool,
    seed: int,
    seeds: list[int] | None = None,
    **knobs,
) -> tuple[list[Grid], GenerationOutput]:
    """(answers, generate's output); puzzle i samples with seed + i, or seeds[i]; `knobs`: turbo's."""
    tok, c, vocab = model.tokenizer, model.config.canvas_length, model.config.vocab_size
    (newline,) = tok.encode("\n", add_special_tokens=False)
    eos, pad = model.generation_config.eos_token_ids[0], model.generation_config.pad_token_id
    layout = {5 * r + 4: newline for r in range(4)} | {20: eos} | {i: pad for i in range(21, c)}
    constraints = []
    for p in puzzles:
        fixed = layout | {position(i): digits[d] for i, d in enumerate(p) if d}
        allowed = {position(i): list(digits.values()) for i, d in enumerate(p) if not d} if only_digits else None
        constraints.append(FirstCanvas(CanvasConstraints.build(c, vocab, fixed=fixed, allowed=allowed)))
    prompt = tok.encode(PROMPT)
    out = model.generate(
        [prompt] * len(puzzles),
        max_new_tokens=c,
        eos_token_ids=[],
        constraints=constraints,
        seed=seeds or [seed + i for i in range(len(puzzles))],
        **knobs,
    )
    digit_of = {t: d for d, t in digits.items()}
    return [tuple(digit_of.get(seq[position(i)], 0) for i in range(16)) for seq in out.sequences], out


def score(puzzles: list[Grid], answers: list[Grid], truth: list[Grid]) -> dict:
    blanks = sum(p.count(0) for p in puzzles)
    right = sum(a[i] == t[i] for p, a, t in zip(puzzles, answers, truth) for i in range(16) if not p[i])
    by_blanks = {}  # blanks -> [grids valid, puzzles]
    for p, a in zip(puzzles, answers):
        tally = by_blanks.setdefault(p.count(0), [0, 0])
        tally[0] += valid(a)
        tally[1] += 1
    return {
        "cells": right / blanks,
        "grids": sum(valid(a) for a in answers) / len(answers),
        "blank_cells": blanks,
        "grids_by_blanks": {k: f"{v}/{n}" for k, (v, n) in sorted(by_blanks.items())},
    }


def compare_turbo(model, truth: list[Grid], puzzles: list[Grid], digits: dict[int, int], args) -> None:
    """--compare-turbo: the fine-tuned model's held-out puzzles solved exact and with turbo, side by side."""
    settings, k = compared(args), len(puzzles)
    cmd = "python " + " ".join(["scripts/sudoku_infill.py", *sys.argv[1:]])
    print(f"\n`{cmd}`: {cpu_name()}, {torch.get_num_threads()} torch thread(s)", flush=True)
    for only_digits in (False, True):
        sums = {
            name: {key: (np.zeros(k), np.zeros(k)) for key in ("cells", "grids", "same", "positions")}
            for name in settings
        }
        seconds, exact = dict.fromkeys(settings, 0.0), {}
        for r in range(args.compare_seeds):
            for name, knobs in settings.items():
                t0 = time.perf_counter()
                seeds = [compare_seed(args.seed, i, r, name) for i in range(k)]
                answers, out = solve(model, puzzles, digits, only_digits, args.seed, seeds=seeds, **knobs)
                seconds[name] += time.perf_counter() - t0
                exact.setdefault(r, answers)
                for i, (p, a, t) in enumerate(zip(puzzles, answers, truth)):
                    m = sums[name]
                    for key, num, den in (
                        ("cells", sum(a[j] == t[j] for j in range(16) if not p[j]), p.count(0)),
                        ("grids", valid(a), 1),
                        ("same", a == exact[r][i], 1),
                        ("positions", out.decoder_positions[i], len(out.sequences[i])),
                    ):
                        m[key][0][i] += num
                        m[key][1][i] += den
        print(
            f"\n--compare-turbo, fine-tuned, held-out grids, blank cells may hold {'digits only' if only_digits else 'any token'}: "
            f"{k} puzzles x {args.compare_seeds} seeds\n"
        )
        print(
            "| setting | cells right | grids valid | same grid as exact | positions per token | x fewer positions | seconds |"
        )
        print("|---|---|---|---|---|---|---|")
        for name in settings:
            m, e = sums[name], sums["exact"]
            fewer = bootstrap(*m["positions"], base=e["positions"], ratio=True)
            cells = [
                name,
                interval(bootstrap(*m["cells"]), ".1%"),
                interval(bootstrap(*m["grids"]), ".1%"),
                interval(bootstrap(*m["same"]), ".1%"),
                f"{bootstrap(*m['positions'])['value']:.1f}",
                interval(fewer, ".2f"),
                f"{seconds[name]:.1f}",
            ]
            print("| " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(default_model_dir()), help="checkpoint to fine-tune (default: dgemma-tiny)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--held-out-grids", type=int, default=48)
    p.add_argument("--puzzles", type=int, default=192, help="puzzles from held-out grids (as many from training grids)")
    p.add_argument("--blanks", default="4-10", help="blank cells per puzzle: a range MIN-MAX")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    add_turbo_options(p)
    args = p.parse_args()
    knobs = turbo_knobs(args)
    torch.set_num_threads(args.threads)
    lo, hi = (int(v) for v in args.blanks.split("-"))
    rng = random.Random(args.seed)
    grids = all_grids()
    assert len(grids) == 288
    rng.shuffle(grids)
    held, trained = grids[: args.held_out_grids], grids[args.held_out_grids :]
    sets = {}
    for name, pool in (("held-out grids", held), ("training grids", trained)):
        truth = [rng.choice(pool) for _ in range(args.puzzles)]
        sets[name] = (truth, [make_puzzle(g, rng.randint(lo, hi), grids, rng) for g in truth])
    base = dgemma.load(args.model)
    digits = digit_tokens(base.tokenizer)
    mean_blanks = sum(p.count(0) for p in sets["held-out grids"][1]) / args.puzzles
    print(
        f"{len(trained)} training grids, {len(held)} held-out; {args.puzzles} puzzles per set, "
        f"{mean_blanks:.1f} blanks on average",
        flush=True,
    )

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tuned = dgemma.load(finetune(trained, args, Path(tmp)))
        if args.compare_turbo:
            tuned.configure_engine(batch_invariant=False)
            return compare_turbo(tuned, *sets["held-out grids"], digits, args)
        for label, model in (("dgemma-tiny, not fine-tuned", base), ("fine-tuned", tuned)):
            model.configure_engine(batch_invariant=False)  # one batched pass per step: faster, same rules
            for only_digits in (False, True):
                for name, (truth, puzzles) in sets.items():
                    if label.startswith("dgemma") and name == "training grids":
                        continue
                    t0 = time.perf_counter()
                    answers, _ = solve(model, puzzles, digits, only_digits, args.seed, **knobs)
                    row = {
                        "model": label,
                        "blanks": "digits only" if only_digits else "any token",
                        "puzzles": name,
                        **score(puzzles, answers, truth),
                        "seconds": time.perf_counter() - t0,
                    }
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    cmd = "python " + " ".join(["scripts/sudoku_infill.py", *sys.argv[1:]])
    print(f"\n`{cmd}`: {cpu_name()}, {torch.get_num_threads()} torch thread(s), turbo {knobs or 'off'}\n")
    print("| model | blank cells may hold | puzzles from | cells right | grids valid |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['blanks']} | {r['puzzles']} | {r['cells']:.1%} | {r['grids']:.1%} |")
    for r in rows:
        if r["model"] == "fine-tuned" and r["puzzles"] == "held-out grids":
            print(
                f"\ngrids valid by number of blanks (fine-tuned, {r['blanks']}, held-out grids): {r['grids_by_blanks']}"
            )


if __name__ == "__main__":
    main()
