"""Timed generation runs for `dgemma bench` and the scripts: dgemma's diffusion path, its AR mode
and the transformers reference on the same weights and prompts; random checkpoints of a named
size to run them on; weight, KV and resident-memory figures; medians per peer.

Fixed steps turn adaptive stopping off (FIXED_STEPS_CONFIDENCE), so every canvas takes exactly
`steps` decoder passes in every peer. The reference peer needs `transformers` (a test
dependency): `load_reference` gives None without it.
"""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .engine.events import Block, Finished
from .engine.kv import budget as kv_budget
from .model.presets import PRESETS

FIXED_STEPS_CONFIDENCE = 1e-30  # no canvas is ever this confident: every canvas takes exactly --steps passes


@dataclass
class RunResult:
    peer: str
    seconds: float
    ttft: float
    tokens: int
    decoder_passes: int
    encoder_seconds: float
    peak_memory_mb: float
    batch: int = 1
    decoder_positions: int = 0  # canvas positions the decoder computed, all rows (0: no decoder, the AR peer)

    @property
    def output_tps(self) -> float:
        return self.tokens / self.seconds

    @property
    def decode_tps(self) -> float:
        """Tokens after the first committed block over the time after it."""
        return self.tokens_after_first / max(self.seconds - self.ttft, 1e-9)

    tokens_after_first: int = 0

    @property
    def ms_per_step(self) -> float:
        """Decoder-step time: wall time minus encoder passes (prefill, commits), per decoder pass."""
        return 1000 * (self.seconds - self.encoder_seconds) / max(self.decoder_passes, 1)

    @property
    def tokens_per_forward(self) -> float:
        """Per sequence: tokens each row generated per decoder pass."""
        return self.tokens / self.batch / max(self.decoder_passes, 1)

    @property
    def positions_per_token(self) -> float | None:
        """Canvas positions the decoder computed per committed token (turbo's saving: canvas_length
        / tokens_per_forward without it); None for a peer without a decoder."""
        return self.decoder_positions / self.tokens if self.decoder_positions and self.tokens else None


class _Timer:
    """Accumulates wall time spent inside a wrapped callable (synchronising CUDA)."""

    def __init__(self, fn, device):
        self.fn, self.device, self.total, self.calls = fn, device, 0.0, 0

    def __call__(self, *args, **kwargs):
        _sync(self.device)
        start = time.perf_counter()
        out = self.fn(*args, **kwargs)
        _sync(self.device)
        self.total += time.perf_counter() - start
        self.calls += 1
        return out


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _reset_peak(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _peak_mb(device) -> float:
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # process peak RSS (Linux: KiB)


def run_dgemma(model, prompts, new_tokens: int, steps: int, adaptive: bool, mode: str,
               progress: Callable[[int], None] | None = None, turbo: dict | None = None) -> RunResult:
    """One timed generation with dgemma (mode "diffusion" or "ar"); `progress(n)` hears of every
    n tokens committed (a bar that moves within a run, not only between runs). `turbo`: the
    diffusion peer with turbo denoising, these GenerationConfig knobs over turbo=True (peer
    "dgemma-turbo"; same prompts and seeds as "dgemma").

    The diffusion peer runs a fresh engine without the prefix cache: every run encodes its
    prompt, as the other peers do (with the cache, runs after the first would skip it)."""
    from .dense.ar import ar_events
    from .engine.client import EngineClient
    from .engine.engine import Engine, Request

    device = model.device
    knobs = dict(max_new_tokens=new_tokens, eos_token_ids=())
    if not adaptive:
        knobs.update(max_denoising_steps=steps, confidence_threshold=FIXED_STEPS_CONFIDENCE)
    if turbo is not None and mode != "ar":
        knobs.update(turbo, turbo=True)
    cfg = model.generation_config.with_overrides(**knobs)
    net = model.engine_net
    if mode != "ar":
        client = EngineClient(Engine(net, replace(model.engine_options, prefix_cache=False)))
    timer = _Timer(net.encode, device)
    net.encode = timer
    _reset_peak(device)
    try:
        _sync(device)
        start = time.perf_counter()
        if mode == "ar":
            events = ar_events(net, prompts, new_tokens, 0.0, [0] * len(prompts), ())
        else:
            events = client.run([Request(list(p), cfg, seed) for seed, p in enumerate(prompts)])
        first, first_tokens, finished = None, 0, []
        while True:
            try:
                ev = next(events)
            except StopIteration as stop:
                out = stop.value
                break
            if isinstance(ev, Finished):
                finished.append(ev)
            elif first is None and getattr(ev, "tokens", None):
                _sync(device)
                first, first_tokens = time.perf_counter() - start, len(ev.tokens)
            if progress is not None and isinstance(ev, Block):
                progress(len(ev.tokens))
        _sync(device)
        seconds = time.perf_counter() - start
    finally:
        del net.encode  # back to the class method
    positions = 0
    if mode == "ar":
        tokens, passes = sum(len(s) for s in out.sequences), new_tokens
    else:
        tokens, passes = sum(len(f.tokens) for f in finished), max(f.decoder_passes for f in finished)
        positions = sum(f.decoder_positions for f in finished)
    result = RunResult(
        peer="dgemma-ar" if mode == "ar" else "dgemma-turbo" if turbo is not None else "dgemma",
        seconds=seconds,
        ttft=first or seconds,
        tokens=tokens,
        decoder_passes=passes,
        encoder_seconds=timer.total if mode != "ar" else 0.0,  # every AR step is an encoder pass
        peak_memory_mb=_peak_mb(device),
        batch=len(prompts),
        decoder_positions=positions,
    )
    result.tokens_after_first = tokens - first_tokens * (len(prompts) if mode != "ar" else 1)
    return result


def load_reference(path: Path, device, dtype):
    """transformers' DiffusionGemmaForBlockDiffusion for the same checkpoint, or None if not installed."""
    try:
        from transformers import DiffusionGemmaForBlockDiffusion
        from transformers.utils import logging as hf_logging
    except ImportError:
        return None
    hf_logging.set_verbosity_error()  # the text-only checkpoint has no vision weights; that is expected
    return DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype=dtype).to(device).eval()


def run_reference(ref, prompts, new_tokens: int, steps: int, adaptive: bool,
                  progress: Callable[[int], None] | None = None) -> RunResult:
    """One timed generation with transformers' generate; `progress(n)` as in run_dgemma."""
    device = next(ref.parameters()).device
    ids = torch.tensor(prompts, device=device)
    knobs = dict(max_new_tokens=new_tokens, eos_token_id=-1)
    if not adaptive:
        knobs.update(max_denoising_steps=steps, confidence_threshold=FIXED_STEPS_CONFIDENCE)
    encoder = ref.model.encoder
    timer = _Timer(encoder.forward, device)
    encoder.forward = timer

    class FirstBlock:  # a streamer that notes when the first canvas is committed
        def __init__(self):
            self.calls, self.first = 0, None

        def put(self, value):
            self.calls += 1
            if self.calls == 2 and self.first is None:  # call 1 is the prompt
                _sync(device)
                self.first = time.perf_counter()
            if self.calls > 1 and progress is not None:
                progress(value.numel())

        def end(self):
            pass

    streamer = FirstBlock()
    _reset_peak(device)
    try:
        with torch.no_grad():
            _sync(device)
            start = time.perf_counter()
            out = ref.generate(ids, streamer=streamer, **knobs)
            _sync(device)
            seconds = time.perf_counter() - start
    finally:
        del encoder.forward
    canvas = ref.config.canvas_length
    tokens = len(prompts) * new_tokens
    passes = int(round(float((out.sequences.shape[1] - ids.shape[1]) / out.tokens_per_forward[0])))
    ttft = (streamer.first - start) if streamer.first else seconds
    result = RunResult("transformers", seconds, ttft, tokens, passes, timer.total, _peak_mb(device), len(prompts),
                       decoder_positions=passes * canvas * len(prompts))  # every position of every pass
    result.tokens_after_first = tokens - len(prompts) * min(canvas, new_tokens)
    return result


def synthetic_checkpoint(size: str, directory: Path, seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    """Random weights of a named size, written in `dtype` as a checkpoint (so every peer loads the
    same file, stored as the released model is for bf16).

    Built in a child process: the random weights are drawn in float32, and in this process they
    would set its peak RSS (twice a bf16 model's bytes) above what loading and running take."""
    import multiprocessing

    from .model.checkpoint import make_config

    config = make_config(**PRESETS[size])
    params = config.num_parameters()
    need, have = 4 * params, kv_budget.available_memory(torch.device("cpu"))  # built in float32 before any cast
    if have is not None and need > have:
        raise ValueError(
            f"--size {size} has {params / 1e9:.1f} B parameters: building its random weights needs ~{need / 2**30:.0f} GiB "
            f"of memory and this machine has {have / 2**30:.0f} GiB available; use a smaller --size "
            f"(mid is the CPU benchmark), or scripts/gpu_check.py on a GPU for the real size"
        )
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return Path(pool.apply(_write_random_checkpoint, (size, str(directory), seed, dtype)))


def _write_random_checkpoint(size: str, directory: str, seed: int, dtype: torch.dtype) -> str:
    from .model.checkpoint import byte_tokenizer, make_config, random_model, save_checkpoint

    model = random_model(make_config(**PRESETS[size]), seed=seed, std=0.02, dtype=dtype)
    return str(save_checkpoint(model, Path(directory) / size, tokenizer=byte_tokenizer()))


def quantized_synthetic_model(size: str, scheme: str, group_size: int | None, dtype: torch.dtype):
    """Random weights of a named size built directly quantised (no full-precision copy, no file)."""
    from .api import Model
    from .config import GenerationConfig
    from .model.checkpoint import make_config
    from .quant.formats import DEFAULT_GROUP_SIZE
    from .quant.modules import random_quantized_model

    config = make_config(**PRESETS[size])
    net = random_quantized_model(config, scheme, group_size or DEFAULT_GROUP_SIZE, dtype)
    return Model(net, GenerationConfig(eos_token_ids=(1,), pad_token_id=0))


def memory_figures(model) -> dict:
    """Weight bytes by part, the KV pool's reserved bytes and the process's resident bytes (peak, now)."""
    from .quant.modules import weight_bytes

    parts = weight_bytes(model.net)
    parts["packed copies"] = engine_copies_bytes(model.net, model.engine_net)
    cache = model.engine.runner.cache
    now = resident_bytes()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB, updated lazily
    return {
        "weights": parts,
        "kv_reserved": sum(t.numel() * t.element_size() for t in cache.keys + cache.values),
        "peak_rss": max(peak, now or 0),
        "rss_now": now,
    }


def memory_report(figures: dict) -> str:
    gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
    parts = figures["weights"]
    by_part = ", ".join(f"{k} {gib(v)}" for k, v in parts.items())
    now = figures["rss_now"]
    return (f"weights: {gib(sum(parts.values()))} ({by_part}); KV pool reserved {gib(figures['kv_reserved'])} "
            f"(untouched pages are not resident); peak RSS {gib(figures['peak_rss'])}"
            + (f"; RSS after the runs {gib(now)}" if now is not None else ""))


def engine_copies_bytes(net, engine_net) -> int:
    """Bytes of the tensors the engine's copy of the network holds beside the model's own weights
    (oneDNN-packed or AMX-repacked weights; 0 where it only shares them: quantised, widened)."""
    def key(t: torch.Tensor) -> int:
        try:
            return t.data_ptr()
        except RuntimeError:  # oneDNN's opaque packed tensors have no plain storage
            return id(t)

    seen = {key(t) for t in list(net.parameters()) + list(net.buffers())}
    total = 0
    for module in engine_net.modules():
        for value in vars(module).values():
            for t in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(t, torch.Tensor) and key(t) not in seen:
                    seen.add(key(t))
                    total += t.numel() * t.element_size()
    return total


def resident_bytes() -> int | None:
    """The process's resident memory now (Linux), or None where /proc does not say."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        return None


def summarize(results: list[RunResult]) -> list[dict]:
    rows = []
    for peer in dict.fromkeys(r.peer for r in results):
        runs = [r for r in results if r.peer == peer]
        med = lambda f: statistics.median(f(r) for r in runs)  # noqa: E731
        rows.append(
            {
                "peer": peer,
                "runs": len(runs),
                "output_tok_s": med(lambda r: r.output_tps),
                "decode_tok_s": med(lambda r: r.decode_tps),
                "ttft_s": med(lambda r: r.ttft),
                "ms_per_step": med(lambda r: r.ms_per_step),
                "tokens_per_forward": med(lambda r: r.tokens_per_forward),
                "peak_mem_mb": max(r.peak_memory_mb for r in runs),
            }
        )
        if all(r.positions_per_token is not None for r in runs):
            rows[-1]["positions_per_token"] = med(lambda r: r.positions_per_token)
    base = {r["peer"]: r["output_tok_s"] for r in rows}
    for row in rows:
        for peer in ("transformers", "dgemma-ar"):
            if peer in base and row["peer"] != peer:
                row[f"x_vs_{peer}"] = row["output_tok_s"] / base[peer]
        if row["peer"] == "dgemma-turbo" and "dgemma" in base:  # turbo's speed-up over the exact path
            row["x_vs_dgemma"] = row["output_tok_s"] / base["dgemma"]
    return rows
