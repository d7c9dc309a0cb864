"""Turbo denoising against exact denoising on dgemma-tiny's held-out prompts: quality and work.

    python scripts/turbo_quality.py [--model dgemma/assets/dgemma-tiny] [--prompts 24] [--seeds 5]
        [--max-new-tokens 64] [--settings default aggressive] [--threads 1] [--json out.json]
    python scripts/turbo_quality.py --prompts 4 --seeds 2 --max-new-tokens 32   # smoke run

An example, not a test: it reports what it measures, whatever that is.

- Prompts: the files the shipped model's training held out (`dgemma.train.data.held_out` over
  the `stdlib/<path>` names, fraction `--eval-fraction` 0.02, as scripts/infill_eval.py), taken
  round-robin: the first prompt of each file is its beginning, up to `--prompt-tokens` (128)
  tokens (in the file's tokenization) cut at the end of a line, before the whitespace token that
  holds its newline (the continuation starts with that token, as in the file); a file's next
  prompt, once every file gave one, is its next such chunk, from the start of the next line.
  Blank chunks are skipped, and so is a line too long to fit alone.
- Settings: "exact" (turbo off) always runs; `--settings` names the turbo ones: "default" (turbo
  with the engine's defaults), "aggressive" (turbo_dormant_entropy=1.0), "refresh4" (the defaults
  and turbo_refresh_every=4), or NAME=K,E,R[,D] (freeze passes, freeze entropy, refresh every,
  dormant entropy; an empty field keeps the engine's default, e.g. `f3=3,,`).
- Runs: for each seed s in range(`--seeds`), one `generate` call over all prompts per setting,
  every prompt with seed s, float32, interleaved so the timing is fair: exact, then exact with
  seed s + 1000 (the noise floor), then each turbo setting. One untimed warm-up call of each
  setting on two prompts comes first (one-time costs: kernel loading, first allocations).
- Metrics, per setting, pooled over seeds, with bootstrap 95% intervals over prompts (prompts
  resampled with replacement, 1000 resamples, seeded by `--bootstrap-seed`; a ratio is
  recomputed from the resampled sums; a difference is paired: both sides on the same resample):
  * agreement: committed-token agreement with exact at the same seed. For one pair of answers
    (token lists, cut after the first EOS), positions i < min(len) where both hold the same
    token, over max(len): a length difference counts as disagreement. Pooled: the sum of equal
    positions over the sum of max lengths. On the row "exact, other seed" (exact at seed s + 1000)
    it is the noise floor: exact against exact with another seed.
  * AR NLL: the model's own autoregressive negative log-likelihood of each answer given its
    prompt, nats per answer token (EOS included): one causal encoder pass over prompt + answer
    (a DenseKVCache, `net.encode`, `net.logits` over the answer's positions), as training's AR
    loss. ΔNLL: minus exact's, paired.
  * length: answer tokens (EOS included); early EOS: the share of answers whose last token is an
    EOS (stopped on their own, not at --max-new-tokens); repetition: the share of answers whose
    last 32 tokens (EOS dropped) hold a 4-gram that occurs at least 3 times (overlaps count).
  * tokens per forward: answer tokens over decoder passes; positions per token: canvas
    positions the decoder computed (`GenerationOutput.decoder_positions`; an exact pass computes
    canvas_length) over answer tokens; "x fewer": exact's positions per token over this one's.
  * tok/s: answer tokens over the wall seconds of this setting's calls (no interval).

The task scripts' `--turbo` flags and `--compare-turbo` tables (scripts/sudoku_infill.py,
scripts/infill_eval.py) share its helpers through scripts/turbo_compare.py: add_turbo_options, turbo_knobs,
compared, compare_seed, bootstrap, interval.
"""

from __future__ import annotations

import argparse
import bisect
import json
import platform
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from infill_eval import cpu_name, held_out_files  # scripts/ is on sys.path when this runs
from turbo_compare import NOISE, PRESETS, bootstrap, interval, setting

import dgemma
from dgemma.dense.kv_cache import DenseKVCache


def held_out_prompts(tok, count: int, prompt_tokens: int, fraction: float) -> list[tuple[str, str]]:
    """(file name, prompt text), round-robin over the held-out files (see the docstring)."""
    pools = []
    for name, text in held_out_files(fraction):
        _, offsets = tok.encode_with_offsets(text)
        starts = [s for s, _ in offsets]
        # a cut: a whitespace token holding a newline; the next chunk starts after its last newline
        ends = [(s, s + text[s:e].rfind("\n") + 1) for s, e in offsets if "\n" in text[s:e] and not text[s:e].strip()]
        cuts, after = [c for c, _ in ends] + [len(text)], [n for _, n in ends] + [len(text)]
        chunks, a = [], 0
        while a < len(text):
            first = bisect.bisect_left(starts, a)
            limit = starts[first + prompt_tokens] if first + prompt_tokens < len(starts) else len(text)
            i = bisect.bisect_right(cuts, limit) - 1
            if cuts[i] <= a:  # the line from `a` is longer than the limit alone: skip it
                i = bisect.bisect_right(cuts, a)
                a = after[i] if i < len(cuts) else len(text)
                continue
            if text[a : cuts[i]].strip():
                chunks.append(text[a : cuts[i]])
            a = after[i]
        pools.append((name, chunks[::-1]))
    prompts = []
    while len(prompts) < count and any(chunks for _, chunks in pools):
        for name, chunks in pools:
            if chunks and len(prompts) < count:
                prompts.append((name, chunks.pop()))
    return prompts


@torch.no_grad()
def answer_nll(net, prompts: list[list[int]], answers: list[list[int]], batch: int = 8) -> list[float]:
    """Summed AR negative log-likelihood (nats) of each answer given its prompt: one causal
    encoder pass over prompt + answer, the tied head's logits at the positions before each answer
    token (training's AR loss, summed instead of averaged)."""
    out = []
    for s in range(0, len(prompts), batch):
        rows = [p + a for p, a in zip(prompts[s : s + batch], answers[s : s + batch])]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), net.config.pad_token_id, dtype=torch.long)
        for j, r in enumerate(rows):
            ids[j, : len(r)] = torch.tensor(r)
        cache = DenseKVCache(net.config, len(rows), width, net.device, net.dtype)
        hidden = net.encode(ids.to(net.device), cache.plan_encoder(width, new_counts=[len(r) for r in rows]))
        for j, (p, a) in enumerate(zip(prompts[s : s + batch], answers[s : s + batch])):
            if not a:
                out.append(0.0)
                continue
            logits = net.logits(hidden[j, len(p) - 1 : len(p) - 1 + len(a)])
            target = torch.tensor(a, device=logits.device)
            out.append(float(-torch.log_softmax(logits, -1).gather(-1, target[:, None]).sum()))
    return out


def agreement(a: list[int], b: list[int]) -> tuple[int, int]:
    """(positions where both answers hold the same token, max length): see the docstring."""
    return sum(x == y for x, y in zip(a, b)), max(len(a), len(b))


def repetitive(answer: list[int], eos: set[int], tail: int = 32, n: int = 4, times: int = 3) -> bool:
    """The answer's last `tail` tokens (EOS dropped) hold an n-gram occurring `times` times or more."""
    t = answer[:-1] if answer and answer[-1] in eos else answer
    t = t[-tail:]
    counts: dict[tuple[int, ...], int] = {}
    for i in range(len(t) - n + 1):
        gram = tuple(t[i : i + n])
        counts[gram] = counts.get(gram, 0) + 1
    return any(c >= times for c in counts.values())


@dataclass
class Tally:
    """One setting's per-prompt sums over seeds (numerators and denominators of each metric)."""

    n: int
    seconds: float = 0.0
    sums: dict = field(default_factory=dict)
    sequences: list = field(default_factory=list)  # per seed, the answers

    def add(self, key: str, i: int, num: float, den: float = 1.0) -> None:
        a = self.sums.setdefault(key, (np.zeros(self.n), np.zeros(self.n)))
        a[0][i] += num
        a[1][i] += den


def freeze_ceiling(model, ids: list[list[int]], seeds: int, max_new_tokens: int, exact: Tally) -> dict:
    """The fewest positions a freeze rule could compute on exact's own acceptance schedule.

    Each prompt and seed is streamed again (exact, with drafts: the same tokens as the batched
    run); in each block of P passes, position p was first accepted at pass t_p (0-based; never
    accepted: P - 1). A rule that froze it one pass later, once its token was its input and its
    keys and values were computed from it (turbo's default needs that pass too: two accepted
    passes), computes it min(t_p + 2, P) times; one freezing at first acceptance, min(t_p + 1, P).
    Exact computes it P times. An optimistic bound: it assumes the schedule does not change when
    positions freeze, and that a position accepted once stays right."""
    totals = {"exact": 0, "fresh": 0, "stale": 0, "answers": 0, "identical": 0}
    for s in range(seeds):
        for i, prompt in enumerate(ids):
            blocks: dict[int, list[list[bool]]] = {}
            tokens: list[int] = []
            for event in model.stream(prompt, drafts=True, seed=s, max_new_tokens=max_new_tokens):
                if hasattr(event, "accepted") and hasattr(event, "step"):
                    blocks.setdefault(event.block, []).append(event.accepted)
                elif hasattr(event, "tokens"):
                    tokens += event.tokens
            totals["answers"] += 1
            totals["identical"] += tokens == exact.sequences[s][i]
            for passes in blocks.values():
                accepted = torch.tensor(passes)  # [P, C]
                p, c = accepted.shape
                first = torch.where(accepted.any(0), accepted.float().argmax(0), torch.full((c,), p - 1.0)).long()
                totals["exact"] += p * c
                totals["fresh"] += int((first + 2).clamp(max=p).sum())
                totals["stale"] += int((first + 1).clamp(max=p).sum())
    return totals


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint directory (default: the shipped dgemma-tiny)")
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument(
        "--settings",
        nargs="+",
        type=setting,
        default=[setting("default"), setting("aggressive")],
        help=f"turbo settings: {', '.join(PRESETS)} or NAME=K,E,R[,D] (exact always runs)",
    )
    p.add_argument("--prompt-tokens", type=int, default=128, help="a prompt is at most about this many tokens")
    p.add_argument("--eval-fraction", type=float, default=0.02, help="the training run's held-out fraction")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--bootstrap-seed", type=int, default=0)
    p.add_argument("--json", help="write the figures, the settings and every answer as JSON here")
    p.add_argument(
        "--ceiling",
        action="store_true",
        help="also the bound any freeze rule meets: exact's own acceptance schedule, streamed with drafts",
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = dgemma.load(args.model, dtype="float32")
    tok, eos = model.tokenizer, set(model.generation_config.eos_token_ids)
    chosen = dict(args.settings)
    runs = {"exact": {}, NOISE: {}, **chosen}
    prompts = held_out_prompts(tok, args.prompts, args.prompt_tokens, args.eval_fraction)
    if not prompts:
        sys.exit("no prompts: no held-out file was found")
    ids = [tok.encode(text) for _, text in prompts]
    n = len(ids)
    print(
        f"{n} prompts from {len({f for f, _ in prompts})} held-out files, {sum(map(len, ids)) / n:.0f} tokens on average; "
        f"settings: {', '.join(f'{k} {v}' for k, v in chosen.items())}",
        flush=True,
    )

    for knobs in runs.values():  # warm-up, untimed
        model.generate(ids[:2], max_new_tokens=args.max_new_tokens, seed=[10**6] * min(2, n), **knobs)
    tallies = {name: Tally(n) for name in runs}
    for s in range(args.seeds):
        for name, knobs in runs.items():
            seed = s + 1000 if name == NOISE else s
            t0 = time.perf_counter()
            out = model.generate(ids, max_new_tokens=args.max_new_tokens, seed=[seed] * n, **knobs)
            t = tallies[name]
            t.seconds += time.perf_counter() - t0
            t.sequences.append(out.sequences)
            for i, seq in enumerate(out.sequences):
                t.add("length", i, len(seq))
                t.add("early_eos", i, bool(seq) and seq[-1] in eos)
                t.add("repetition", i, repetitive(seq, eos))
                t.add("tokens_per_forward", i, len(seq), out.decoder_passes[i])
                t.add("positions_per_token", i, out.decoder_positions[i], len(seq))
            print(
                f"seed {s}, {name}: {time.perf_counter() - t0:.1f} s, {sum(map(len, out.sequences))} tokens", flush=True
            )
    exact = tallies["exact"]
    for name, t in tallies.items():
        for s, answers in enumerate(t.sequences):
            for i, (nll, seq) in enumerate(zip(answer_nll(model.net, ids, answers), answers)):
                t.add("nll", i, nll, len(seq))
                if name != "exact":
                    t.add("agreement", i, *agreement(seq, exact.sequences[s][i]))

    ceiling = freeze_ceiling(model, ids, args.seeds, args.max_new_tokens, exact) if args.ceiling else None

    rows = {}
    for name, t in tallies.items():
        ci = {key: bootstrap(*t.sums[key], seed=args.bootstrap_seed) for key in t.sums}
        if name != "exact":
            ci["delta_nll"] = bootstrap(*t.sums["nll"], seed=args.bootstrap_seed, base=exact.sums["nll"])
            ci["x_fewer_positions"] = bootstrap(
                *t.sums["positions_per_token"],
                seed=args.bootstrap_seed,
                base=exact.sums["positions_per_token"],
                ratio=True,
            )
        tokens = float(t.sums["length"][0].sum())
        rows[name] = {"knobs": runs[name], **ci, "tokens": tokens, "seconds": t.seconds, "tok_s": tokens / t.seconds}

    cmd = "python " + " ".join(["scripts/turbo_quality.py", *sys.argv[1:]])
    setup = (
        f"{n} prompts x {args.seeds} seeds, max_new_tokens {args.max_new_tokens}, float32; {cpu_name()}, "
        f"{torch.get_num_threads()} torch thread(s), torch {torch.__version__}, Python {platform.python_version()}"
    )
    print(f"\n`{cmd}`: {setup}\n")

    print(
        "| setting | agreement with exact | AR NLL/token | ΔNLL vs exact | length | early EOS | repetition "
        "| tokens/forward | positions/token | x fewer positions | tok/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        none = name == "exact"
        cells = [
            name + (" (noise floor)" if name == NOISE else ""),
            "—" if none else interval(r["agreement"], ".1%"),
            interval(r["nll"], ".3f"),
            "—" if none else interval(r["delta_nll"], "+.3f"),
            interval(r["length"], ".1f"),
            f"{r['early_eos']['value']:.0%}",
            f"{r['repetition']['value']:.0%}",
            f"{r['tokens_per_forward']['value']:.2f}",
            f"{r['positions_per_token']['value']:.1f}",
            "—" if none else interval(r["x_fewer_positions"], ".2f"),
            f"{r['tok_s']:.1f}",
        ]
        print("| " + " | ".join(cells) + " |")
    if ceiling is not None:
        print(
            f"\nCeiling (exact's own schedule, streamed with drafts; answers identical to exact's: "
            f"{ceiling['identical']}/{ceiling['answers']}): exact computed {ceiling['exact']:,} canvas positions; "
            f"freezing each position one pass after it was first accepted would compute {ceiling['fresh']:,} "
            f"({ceiling['exact'] / ceiling['fresh']:.2f}x fewer); at its first acceptance (keys and values from a pass "
            f"where its input was still noise) {ceiling['stale']:,} ({ceiling['exact'] / ceiling['stale']:.2f}x fewer)"
        )
    if args.json:
        record = {
            "ceiling": ceiling,
            "command": cmd,
            "setup": setup,
            "cpu": cpu_name(),
            "threads": torch.get_num_threads(),
            "rows": rows,
            "prompts": [{"file": f, "tokens": len(i)} for (f, _), i in zip(prompts, ids)],
            "answers": {name: t.sequences for name, t in tallies.items()},
        }
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
