"""Timed generation runs for `dgemma bench` and the scripts: dgemma's diffusion path, its AR mode
and the transformers reference on the same weights and prompts; random weights of a named size
and scheme built on the device that runs them (a checkpoint only for a peer that reads one); one
engine per model with a KV pool of the bench's own size; weight, KV and peak-memory figures;
medians per peer.

What a run reports (`RunResult`): wall seconds; `encoder_seconds`, the runner's encoder work
(prompt chunks and committed blocks) timed where the runner runs it (CUDA events on a GPU); decode
tokens/s as vLLM defines it: tokens committed after every row's first block over the time after
it (at 16 fixed steps, a canvas of 256 is 16 tokens a decoder step). CUDA graphs are captured by
an untimed warm-up run the first time an engine runs a batch size, never inside a timed run.

Fixed steps turn adaptive stopping off (FIXED_STEPS_CONFIDENCE), so every canvas takes exactly
`steps` decoder passes in every peer. The reference peer needs `transformers` (a test
dependency): `load_reference` gives None without it.
"""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .engine.events import Block, Finished
from .engine.kv import budget as kv_budget
from .model.presets import PRESETS

if TYPE_CHECKING:
    from .engine.engine import Engine

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
    tokens_after_first: int = 0  # tokens committed after every row's first block
    decode_start: float | None = None  # seconds until every row had committed its first block (None: ttft)

    @property
    def output_tps(self) -> float:
        return self.tokens / self.seconds

    @property
    def decode_tps(self) -> float:
        """vLLM's decode rate: tokens committed after every row's first block over the time after it."""
        start = self.ttft if self.decode_start is None else self.decode_start
        return self.tokens_after_first / max(self.seconds - start, 1e-9)

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
    """Accumulates the time spent inside a wrapped callable: on CUDA the device time between two
    events recorded around each call (no host sync, so the timed run keeps its overlap), read
    once at `seconds`; elsewhere wall time (the call has finished when it returns)."""

    def __init__(self, fn, device):
        self.fn, self.cuda = fn, torch.device(device).type == "cuda"
        self.calls, self._wall, self._events = 0, 0.0, []

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = self.fn(*args, **kwargs)
            end.record()
            self._events.append((start, end))
            return out
        start = time.perf_counter()
        out = self.fn(*args, **kwargs)
        self._wall += time.perf_counter() - start
        return out

    @property
    def seconds(self) -> float:
        if self._events:
            self._events[-1][1].synchronize()
        return self._wall + sum(a.elapsed_time(b) for a, b in self._events) / 1000


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


def bench_kv_memory(kv_config, dtype: torch.dtype, block_size: int, batch: int, tokens: int) -> int:
    """Bytes of a KV pool that holds `batch` requests of `tokens` positions at once (the bench's own
    need, not a share of the device): each request's global blocks, and as many sliding ones
    (`kv_budget.plan_blocks` gives both pools the same count at this size, or caps the sliding
    pool at twice what `max_active` requests hold at once, which is still enough)."""
    from .engine.kv.paged_cache import kv_bytes_per_token

    per_token = kv_bytes_per_token(kv_config, kv_budget.dtype_bytes(dtype))
    blocks = batch * -(-tokens // block_size)
    return blocks * block_size * sum(per_token.values())


@dataclass
class BenchEngine:
    """The engine a bench runs a model's diffusion peers on: built once and reused across runs,
    with the prefix cache off (every run encodes its prompt, as the other peers do), at most
    `batch` requests at once and a KV pool for `batch` requests of `tokens` positions. `warm`: the
    (batch, turbo) runs whose untimed warm-up has captured their CUDA graphs."""

    engine: Engine
    batch: int
    tokens: int  # positions one request may encode: its prompt and every block but the last
    warm: set = field(default_factory=set)

    @classmethod
    def build(cls, model, batch: int, prompt_len: int, new_tokens: int) -> BenchEngine:
        from .engine.engine import Engine
        from .engine.request import max_sequence_length

        net, c = model.engine_input_net, model.config.canvas_length
        tokens = max_sequence_length(prompt_len, new_tokens, c)
        options = replace(model.engine_options, prefix_cache=False, max_active=batch)
        memory = bench_kv_memory(net.kv_config, net.dtype, options.block_size or c, batch, tokens)
        return cls(Engine(net, replace(options, kv_cache_memory=memory)), batch, tokens)

    def check(self, prompts, new_tokens: int) -> None:
        """ValueError when a run would not fit at once (its requests would wait for each other)."""
        from .engine.request import max_sequence_length

        tokens = max(max_sequence_length(len(p), new_tokens, self.engine.runner.config.canvas_length) for p in prompts)
        if len(prompts) > self.batch or tokens > self.tokens:
            raise ValueError(
                f"this bench engine holds {self.batch} requests of {self.tokens} positions; "
                f"the run has {len(prompts)} of {tokens}"
            )

    def warm_up(self, prompts, cfg) -> None:
        """With CUDA graphs, the first run of each batch size (and turbo or not) first runs one
        canvas of the same requests untimed: its graphs are captured there, not in a timed run
        (one decoder step captures the default path's; turbo's canvas runs all its steps, whose
        active rows change from pass to pass)."""
        turbo = bool(getattr(cfg, "turbo", False))
        key = (len(prompts), turbo)
        if not self.engine.options.cuda_graphs or key in self.warm:
            return
        from .engine.request import Request

        short = cfg.with_overrides(
            max_new_tokens=self.engine.runner.config.canvas_length, **({} if turbo else {"max_denoising_steps": 1})
        )
        _drain(self.engine, [Request(list(p), short, seed) for seed, p in enumerate(prompts)])
        self.warm.add(key)


def _drain(engine, requests, on_step: Callable[[list], None] | None = None) -> list[Finished]:
    """Add `requests` and step the engine until they end; `on_step(events)` after each step.
    Whatever raises, the requests leave the engine (cancelled), so the next run starts clean."""
    for r in requests:
        engine.add(r)
    finished = []
    try:
        while engine.has_work:
            events = engine.step()
            finished += [ev for ev in events if isinstance(ev, Finished)]
            if on_step is not None:
                on_step(events)
    except BaseException:
        for r in requests:
            engine.cancel(r.request_id)
        engine.step()  # drops them
        raise
    return finished


def run_dgemma(
    model,
    prompts,
    new_tokens: int,
    steps: int,
    adaptive: bool,
    mode: str,
    progress: Callable[[int], None] | None = None,
    turbo: dict | None = None,
    engine: BenchEngine | None = None,
) -> RunResult:
    """One timed generation with dgemma (mode "diffusion" or "ar"); `progress(n)` hears of every
    n tokens committed (a bar that moves within a run, not only between runs). `turbo`: the
    diffusion peer with turbo denoising, these GenerationConfig knobs over turbo=True (peer
    "dgemma-turbo"; same prompts and seeds as "dgemma").

    The diffusion peer runs on `engine` (the model's `BenchEngine`, reused across runs; None: one
    built for this run), whose graphs a first untimed run captures. `encoder_seconds` is the
    runner's encoder work (every prompt chunk and committed block), timed around the runner's
    own encode step: the network it runs may be a copy of the model's (the Triton path's fused network)."""
    from .engine.request import Request

    device = model.device
    knobs = dict(max_new_tokens=new_tokens, eos_token_ids=())
    if not adaptive:
        knobs.update(max_denoising_steps=steps, confidence_threshold=FIXED_STEPS_CONFIDENCE)
    if turbo is not None and mode != "ar":
        knobs.update(turbo, turbo=True)
    cfg = model.generation_config.with_overrides(**knobs)
    if mode == "ar":
        return _run_ar(model, prompts, new_tokens, progress)
    if engine is None:
        engine = BenchEngine.build(model, len(prompts), max(len(p) for p in prompts), new_tokens)
    engine.check(prompts, new_tokens)
    engine.warm_up(prompts, cfg)
    runner = engine.engine.runner
    timer = _Timer(runner._encode, device)
    runner._encode = lambda works: timer(works) if works else timer.fn(works)
    requests = [Request(list(p), cfg, seed) for seed, p in enumerate(prompts)]
    clock = _RunClock(device, len(requests), progress)
    _reset_peak(device)
    try:
        clock.begin()
        finished = _drain(engine.engine, requests, clock.after_step)
        seconds = clock.end()
    finally:
        del runner._encode  # back to the class method
    return RunResult(
        peer="dgemma-turbo" if turbo is not None else "dgemma",
        seconds=seconds,
        ttft=clock.ttft if clock.ttft is not None else seconds,
        tokens=sum(len(f.tokens) for f in finished),
        decoder_passes=max(f.decoder_passes for f in finished),
        encoder_seconds=timer.seconds,
        peak_memory_mb=_peak_mb(device),
        batch=len(prompts),
        decoder_positions=sum(f.decoder_positions for f in finished),
        tokens_after_first=clock.committed - clock.before_decode,
        decode_start=clock.decode_start,
    )


class _RunClock:
    """When a run's first token came (`ttft`) and when every row had committed its first block
    (`decode_start`, with the tokens committed by then): read after engine steps, synchronising
    the device only at those two moments."""

    def __init__(self, device, rows: int, progress: Callable[[int], None] | None):
        self.device, self.rows, self.progress = device, rows, progress
        self.ttft = self.decode_start = None
        self.committed = self.before_decode = 0
        self.first_blocks: set[int] = set()

    def begin(self) -> None:
        _sync(self.device)
        self.start = time.perf_counter()

    def end(self) -> float:
        _sync(self.device)
        return time.perf_counter() - self.start

    def after_step(self, events: list) -> None:
        blocks = [ev for ev in events if isinstance(ev, Block)]
        for ev in blocks:
            self.committed += len(ev.tokens)
            if ev.block == 0:
                self.first_blocks.add(ev.row)
            if self.progress is not None:
                self.progress(len(ev.tokens))
        if blocks and self.ttft is None:
            self.ttft = self.end()
        if self.decode_start is None and len(self.first_blocks) == self.rows:
            self.decode_start, self.before_decode = self.end(), self.committed


def _run_ar(model, prompts, new_tokens: int, progress: Callable[[int], None] | None) -> RunResult:
    """One timed AR generation (greedy, one token per row per step: every step is an encoder
    pass, so `encoder_seconds` is 0 and ms_per_step the time a token takes), through
    Model.ar_events: on a GPU the captured device loop (engine/fused/ar.py)."""
    device = model.device
    clock = _RunClock(device, len(prompts), progress)
    _reset_peak(device)
    clock.begin()
    events = model.ar_events(prompts, new_tokens, 0.0, [0] * len(prompts), ())
    while True:
        try:
            ev = next(events)
        except StopIteration as stop:
            out = stop.value
            break
        clock.after_step([ev])  # a row's token at a time: rows commit block 0 (their first token) in step
    seconds = clock.end()
    return RunResult(
        peer="dgemma-ar",
        seconds=seconds,
        ttft=clock.ttft if clock.ttft is not None else seconds,
        tokens=sum(len(s) for s in out.sequences),
        decoder_passes=new_tokens,
        encoder_seconds=0.0,
        peak_memory_mb=_peak_mb(device),
        batch=len(prompts),
        tokens_after_first=clock.committed - clock.before_decode,
        decode_start=clock.decode_start,
    )


def load_reference(path: Path, device, dtype):
    """transformers' DiffusionGemmaForBlockDiffusion for the same checkpoint, or None if not installed."""
    try:
        from transformers import DiffusionGemmaForBlockDiffusion
        from transformers.utils import logging as hf_logging
    except ImportError:
        return None
    hf_logging.set_verbosity_error()  # the text-only checkpoint has no vision weights; that is expected
    return DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype=dtype).to(device).eval()


def run_reference(
    ref, prompts, new_tokens: int, steps: int, adaptive: bool, progress: Callable[[int], None] | None = None
) -> RunResult:
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
    result = RunResult(
        "transformers",
        seconds,
        ttft,
        tokens,
        passes,
        timer.seconds,
        _peak_mb(device),
        len(prompts),
        decoder_positions=passes * canvas * len(prompts),
    )  # every position of every pass
    result.tokens_after_first = tokens - len(prompts) * min(canvas, new_tokens)
    return result


def random_model(
    size: str, device, dtype: torch.dtype, scheme: str | None = None, group_size: int | None = None, seed: int = 0
):
    """A `Model` of random weights of a named size, built directly on `device` (`random_weights`)."""
    from .api import Model
    from .config import GenerationConfig
    from .model.checkpoint import make_config

    net = random_weights(make_config(**PRESETS[size]), device, dtype, scheme, group_size, seed)
    return Model(net, GenerationConfig(eos_token_ids=(1,), pad_token_id=0))


@torch.no_grad()
def random_weights(
    config,
    device,
    dtype: torch.dtype,
    scheme: str | None = None,
    group_size: int | None = None,
    seed: int = 0,
    std: float = 0.02,
):
    """A DiffusionGemma of random weights built where it runs: matrices normal(0, std) drawn on
    `device` in `dtype`, norms and scales 1; with `scheme`, the text layers' linears and experts
    drawn and quantised one matrix at a time (`quant.modules.random_quantized_model`). No float32
    copy, no host round trip, no file: the released size takes seconds on a GPU, and the meta
    device (shapes only) draws nothing. A peer that reads a checkpoint gets one from
    `write_checkpoint`."""
    from .model.diffusion_gemma import DiffusionGemma

    device = torch.device(device)
    if scheme is not None:
        from .quant.formats import DEFAULT_GROUP_SIZE
        from .quant.modules import random_quantized_model

        return random_quantized_model(config, scheme, group_size or DEFAULT_GROUP_SIZE, dtype, seed, std, device=device)
    with torch.device("meta"):
        net = DiffusionGemma(config)
    gen = torch.Generator(device=device).manual_seed(seed) if device.type != "meta" else None
    for module in net.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if p.dim() >= 2:
                value = torch.randn(p.shape, generator=gen, device=device, dtype=dtype).mul_(std)
            else:
                value = torch.ones(p.shape, device=device, dtype=dtype)
            module._parameters[name] = torch.nn.Parameter(value, requires_grad=False)
        for name, b in list(module.named_buffers(recurse=False)):
            module._buffers[name] = torch.ones(b.shape, device=device, dtype=dtype)
    return net.eval()


def check_room(size: str, device, dtype: torch.dtype, scheme: str | None = None, group_size: int | None = None) -> None:
    """ValueError, one line, when `device` has less free memory than random weights of `size` take
    (a CPU's MemAvailable, a GPU's free memory; the meta device holds nothing)."""
    from .memory_plan import weight_bytes
    from .model.checkpoint import make_config

    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        return
    config = make_config(**PRESETS[size])
    need = sum(weight_bytes(config, scheme, group_size, dtype).values())
    have = kv_budget.available_memory(device)
    if have is not None and need > have:
        what = f"{scheme} " if scheme else f"{str(dtype).removeprefix('torch.')} "
        raise ValueError(
            f"--size {size} has {config.num_parameters() / 1e9:.1f} B parameters: its random {what}weights take "
            f"~{need / 2**30:.0f} GiB and {device} has {have / 2**30:.0f} GiB available; use a smaller --size "
            f"(mid is the CPU benchmark) or --quantization, or a GPU for the real size"
        )


def write_checkpoint(model, directory: Path, dtype: torch.dtype) -> Path:
    """`model`'s weights as a checkpoint directory in `directory` (for a peer that loads files:
    the transformers reference, or ranks of a tensor-parallel run), with a byte tokenizer."""
    from .model.checkpoint import byte_tokenizer, save_checkpoint

    return Path(
        save_checkpoint(model.net, Path(directory) / "random", model.generation_config, byte_tokenizer(), dtype=dtype)
    )


def memory_figures(model, engine: BenchEngine | None, results: list[RunResult] = ()) -> dict:
    """What a user needs to run the bench's batch: the weights by part (with the bench engine's
    packed copies of them), the engine's KV pool, the peak and the rest (the peak minus those
    two: activations, step buffers, graph pools). The peak is the device's allocated peak over the
    timed runs on a GPU, the process's peak RSS elsewhere (there: every peer's weights, the
    interpreter and its libraries too, and untouched KV pages are not resident). No engine (no
    diffusion peer ran): no KV pool."""
    from .quant.modules import weight_bytes

    device = torch.device(model.device)
    parts = weight_bytes(model.net)
    parts["packed copies"] = engine_copies_bytes(model.net, engine.engine.runner.net if engine else model.engine_net)
    cache = engine.engine.runner.cache if engine else None
    kv = sum(t.numel() * t.element_size() for t in cache.keys + cache.values) if cache else 0
    now = resident_bytes()
    rss_peak = max(
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, now or 0
    )  # Linux reports KiB, updated lazily
    if device.type == "cuda":
        peak = int(
            max((r.peak_memory_mb for r in results), default=torch.cuda.max_memory_allocated(device) / 2**20) * 2**20
        )
    else:
        peak = rss_peak
    return {
        "weights": parts,
        "kv_reserved": kv,
        "peak": peak,
        "peak_kind": "allocated on the GPU" if device.type == "cuda" else "RSS",
        "rest": peak - sum(parts.values()) - kv,
        "peak_rss": rss_peak,
        "rss_now": now,
    }


def memory_report(figures: dict) -> str:
    gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
    parts = figures["weights"]
    by_part = ", ".join(f"{k} {gib(v)}" for k, v in parts.items())
    now = figures["rss_now"]
    return (
        f"weights: {gib(sum(parts.values()))} ({by_part}); KV pool {gib(figures['kv_reserved'])}; "
        f"the rest {gib(figures['rest'])} (peak {figures['peak_kind']} {gib(figures['peak'])} minus weights and KV pool)"
        + (f"; RSS after the runs {gib(now)}" if now is not None else "")
    )


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
        med = lambda f, runs=runs: statistics.median(f(r) for r in runs)  # noqa: E731
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
