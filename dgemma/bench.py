"""`dgemma bench`: dgemma's diffusion path, its AR mode and the transformers reference, side by side.

Peers run interleaved in one process (default, ar, reference, default, ar, ...) on the same
weights and prompt, so that machine noise hits all of them alike; the table reports medians and
the ratios between peers. Fixed steps (the default) turn adaptive stopping off, so every canvas
takes exactly `--steps` decoder passes in every peer.

The reference peer needs `transformers` (a test dependency); it is skipped when not installed.
"""

from __future__ import annotations

import json
import resource
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from .engine.events import Finished
from .engine.options import available_memory
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


def run_dgemma(model, prompts, new_tokens: int, steps: int, adaptive: bool, mode: str) -> RunResult:
    """One timed generation with dgemma (mode "diffusion" or "ar").

    The diffusion peer runs a fresh engine without the prefix cache: every run encodes its
    prompt, as the other peers do (with the cache, runs after the first would skip it)."""
    from .engine.ar import ar_events
    from .engine.client import EngineClient
    from .engine.engine import Engine, Request

    device = model.device
    knobs = dict(max_new_tokens=new_tokens, eos_token_ids=())
    if not adaptive:
        knobs.update(max_denoising_steps=steps, confidence_threshold=FIXED_STEPS_CONFIDENCE)
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
        _sync(device)
        seconds = time.perf_counter() - start
    finally:
        del net.encode  # back to the class method
    if mode == "ar":
        tokens, passes = sum(len(s) for s in out.sequences), new_tokens
    else:
        tokens, passes = sum(len(f.tokens) for f in finished), max(f.decoder_passes for f in finished)
    result = RunResult(
        peer="dgemma-ar" if mode == "ar" else "dgemma",
        seconds=seconds,
        ttft=first or seconds,
        tokens=tokens,
        decoder_passes=passes,
        encoder_seconds=timer.total if mode != "ar" else 0.0,  # every AR step is an encoder pass
        peak_memory_mb=_peak_mb(device),
        batch=len(prompts),
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


def run_reference(ref, prompts, new_tokens: int, steps: int, adaptive: bool) -> RunResult:
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
    result = RunResult("transformers", seconds, ttft, tokens, passes, timer.total, _peak_mb(device), len(prompts))
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
    need, have = 4 * params, available_memory(torch.device("cpu"))  # built in float32 before any cast
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
    base = {r["peer"]: r["output_tok_s"] for r in rows}
    for row in rows:
        for peer in ("transformers", "dgemma-ar"):
            if peer in base and row["peer"] != peer:
                row[f"x_vs_{peer}"] = row["output_tok_s"] / base[peer]
    return rows


def print_table(rows: list[dict], header: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=header)
    cols = ["peer", "output_tok_s", "decode_tok_s", "ttft_s", "ms_per_step", "tokens_per_forward", "peak_mem_mb"]
    extra = sorted({k for r in rows for k in r if k.startswith("x_vs_")})
    for c in cols + extra:
        table.add_column(c, justify="right" if c != "peer" else "left")
    for r in rows:
        table.add_row(*[f"{r[c]:.2f}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in cols + extra])
    Console(width=200).print(table)


def cmd_bench(args) -> int:
    from tqdm import tqdm

    from .api import load, resolve_device, resolve_dtype
    from .kernels import cpu as cpu_kernels

    torch.manual_seed(0)
    device, dtype = resolve_device(args.device), resolve_dtype(args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        peers = [p.strip() for p in args.peers.split(",") if p.strip()]
        unknown = set(peers) - {"default", "ar", "reference"}
        if unknown:
            raise ValueError(f"unknown peers {sorted(unknown)}; choose from default, ar, reference")
        if args.quantization is not None and "reference" in peers:
            print("transformers runs full-precision weights only: skipping the reference peer with --quantization")
            peers.remove("reference")
        if args.quantization is not None and not args.model:
            path, model = None, quantized_synthetic_model(args.size, args.quantization, args.group_size, dtype)
        else:
            path = Path(args.model) if args.model else synthetic_checkpoint(args.size, Path(tmp), dtype=dtype)
            model = load(path, device=device, dtype=dtype, quantization=args.quantization, group_size=args.group_size)
        ref = load_reference(path, device, dtype) if "reference" in peers else None
        if "reference" in peers and ref is None:
            print("transformers is not installed: skipping the reference peer")
            peers.remove("reference")
        vocab = model.config.vocab_size
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(10, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.batch)]

        def once(peer):
            if peer == "reference":
                return run_reference(ref, prompts, args.new_tokens, args.steps, args.adaptive)
            return run_dgemma(model, prompts, args.new_tokens, args.steps, args.adaptive, "ar" if peer == "ar" else "diffusion")

        if args.warmup:  # first calls pay for allocation and kernel selection
            for peer in peers:
                once(peer)
        results = []
        with tqdm(total=args.runs * len(peers), desc="bench", unit="run") as bar:
            for _ in range(args.runs):
                for peer in peers:
                    bar.set_postfix_str(peer)
                    results.append(once(peer))
                    bar.update()
    rows = summarize(results)
    memory = memory_figures(model)
    header = (
        f"{args.model or args.size} | {device} {args.dtype} | batch {args.batch} | prompt {args.prompt_len} | "
        f"{args.new_tokens} new | {'adaptive' if args.adaptive else f'{args.steps} fixed'} steps | "
        f"canvas {model.config.canvas_length} | threads {torch.get_num_threads()} | "
        f"kernels: {cpu_kernels.describe(model.engine_net)}"
    )
    if args.json:
        print(json.dumps({"setup": header, "memory": memory_report(memory), "memory_bytes": memory, "rows": rows, "runs": [asdict(r) for r in results]}, indent=2))
    else:
        print(memory_report(memory))
        print_table(rows, header)
    return 0


def add_cli(sub) -> None:
    p = sub.add_parser("bench", help="time dgemma against its AR mode and the transformers reference")
    p.add_argument("--model", "-m", help="checkpoint directory (default: random weights of --size)")
    p.add_argument("--size", choices=list(PRESETS), default="tiny", help="synthetic model size (random weights)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--quantization", choices=["fp8", "int8", "int4", "nvfp4"], default=None,
                   help="quantised weights (random --size models are built directly quantised)")
    p.add_argument("--group-size", type=int, default=None, help="inputs per scale for int4 (default: 64)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=768)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=16, help="fixed denoising steps per canvas")
    p.add_argument("--adaptive", action="store_true", help="adaptive stopping instead of fixed steps")
    p.add_argument("--peers", default="default,ar,reference", help="comma list of default, ar, reference")
    p.add_argument("--runs", type=int, default=3, help="timed runs per peer (interleaved)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_bench)
