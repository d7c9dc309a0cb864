"""The table of knobs: each `GenerationConfig` field (config.py), with the bounds a request may send, its
help, and its name on each interface, or why it is deliberately not there.

The interfaces: the command line (a flag of `dgemma run` and `dgemma chat`; serve and bench take the turbo
ones), the OpenAI routes (a request field), the ollama routes (an `options` key) and the Python API (a
keyword of `Model.generate`, whose signature stays written out and typed). cli/common.py builds its sampler
flags from this table, serve/openai/protocol.py its knob fields' bounds and the request -> GenerationConfig
translation, serve/ollama/protocol.py its knob options; tests/test_knobs.py checks that each interface
reaches the fields the table says, and that a field one interface lacks is listed here with the reason.
GenerationConfig.validate stays the rule every value must pass (generation_config.json's too); the bounds
here are what a request may send, tighter where a number a client sends must stay cheap.
docs/architecture.md, "The knob table", says what to touch to add one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

INTERFACES = ("cli", "openai", "ollama", "api")


def _ignoring_eos(ignore: bool) -> tuple[int, ...] | None:
    """`ignore_eos` as the eos_token_ids it asks for: none (run past EOS), or None (the default's)."""
    return () if ignore else None


@dataclass(frozen=True)
class Knob:
    """One GenerationConfig field and how each interface reaches it (None: it does not; `absent` says why)."""

    name: str  # the GenerationConfig field
    kind: type  # int, float or bool: what a flag, a request field and an option carry
    help: str  # the flag's help (docs/server.md's "Request fields" says it for the server)
    lo: float | None = None  # a request's value: at least this,
    hi: float | None = None  # at most this,
    above: float | None = None  # and greater than this
    flag: str | None = None  # the command line's flag
    openai: str | None = None  # the OpenAI routes' request field
    ollama: str | None = None  # the ollama routes' option (one of ollama's own keeps its meaning: num_predict)
    api: bool = True  # a keyword of Model.generate (and stream, infill, edit)
    turbo: bool = False  # turbo denoising's: `dgemma serve` and `dgemma bench` take it too; knobs need --turbo
    default: str = "generation_config.json"  # where a value nobody sets comes from (the flag's help says it)
    absent: tuple[tuple[str, str], ...] = ()  # (interface, why): where it is deliberately not reachable
    translate: Callable[[Any], Any] | None = None  # a request value -> the field's value (None: the same)

    def reached_from(self, interface: str) -> bool:
        """Whether the table says `interface` sets this field."""
        return bool({"cli": self.flag, "openai": self.openai, "ollama": self.ollama, "api": self.api}[interface])

    def why_absent(self, interface: str) -> str | None:
        return dict(self.absent).get(interface)

    def config_value(self, sent: Any) -> Any:
        """The field's value for what a request sent in its field (None: the default holds)."""
        return sent if self.translate is None or sent is None else self.translate(sent)


KNOBS: tuple[Knob, ...] = (
    Knob(
        "max_new_tokens",
        int,
        "tokens to generate at most",
        lo=1,
        hi=1_000_000,
        flag="--max-new-tokens",
        openai="max_tokens",  # chat also max_completion_tokens; the service fits it to the context
        ollama="num_predict",  # 0 or less: as much as the context allows (ollama's "no limit")
    ),
    Knob(
        "max_denoising_steps",
        int,
        "denoising steps per canvas at most",
        lo=1,
        hi=4096,  # and at most the server's --max-denoising-steps
        flag="--steps",
        openai="max_denoising_steps",
        ollama="max_denoising_steps",
    ),
    Knob(
        "entropy_bound",
        float,
        "entropy budget for accepting tokens per step",
        hi=1e6,
        above=0,
        flag="--entropy-bound",
        openai="entropy_bound",
        ollama="entropy_bound",
    ),
    Knob(
        "t_min",
        float,
        "temperature at the last step",
        lo=0,
        hi=100,
        flag="--t-min",
        openai="t_min",
        ollama="t_min",
    ),
    Knob(
        "t_max",
        float,
        "temperature at the first step",
        lo=0,
        hi=100,
        flag="--t-max",
        openai="t_max",
        ollama="t_max",
    ),
    Knob(
        "stability_threshold",
        int,
        "steps the argmax must hold before stopping",
        lo=0,
        hi=4096,
        flag="--stability-threshold",
        openai="stability_threshold",
        ollama="stability_threshold",
    ),
    Knob(
        "confidence_threshold",
        float,
        "mean entropy below which a canvas may stop",
        hi=1e6,
        above=0,
        flag="--confidence-threshold",
        openai="confidence_threshold",
        ollama="confidence_threshold",
    ),
    Knob(
        "eos_token_ids",
        bool,
        "ignore EOS: generate past it, to max_new_tokens (benchmarks)",
        openai="ignore_eos",  # on the server only "none" (true): a client does not know the token ids
        ollama="ignore_eos",
        translate=_ignoring_eos,
        default="generation_config.json, else config.json's eos_token_id",
        absent=(
            (
                "cli",
                "`dgemma run` prints an answer, which ends at EOS; `dgemma chat`'s `/set eos off` runs past it, and "
                "`dgemma bench` sets it itself",
            ),
        ),
    ),
    Knob(
        "pad_token_id",
        int,
        "the token after EOS",
        api=False,
        default="generation_config.json, else config.json's pad_token_id",
        absent=tuple(
            (
                where,
                "the checkpoint's own token (what fills a canvas past EOS, what a grammar may end on): a property "
                "of its vocabulary, not a sampling choice",
            )
            for where in INTERFACES
        ),
    ),
    Knob(
        "turbo",
        bool,
        "turbo denoising: canvas positions that have converged stop being recomputed "
        "(approximate, fewer positions per pass; docs/performance.md)",
        flag="--turbo",
        openai="turbo",
        ollama="turbo",
        turbo=True,
        default="generation_config.json, else off",
    ),
    Knob(
        "turbo_freeze_passes",
        int,
        "with turbo: passes in a row a position's token must be accepted unchanged before it freezes",
        lo=1,
        hi=4096,
        flag="--turbo-freeze-passes",
        openai="turbo_freeze_passes",
        ollama="turbo_freeze_passes",
        turbo=True,
    ),
    Knob(
        "turbo_freeze_entropy",
        float,
        "with turbo: the entropy (nats) a position may have at most to freeze",
        lo=0,
        hi=1e6,
        flag="--turbo-freeze-entropy",
        openai="turbo_freeze_entropy",
        ollama="turbo_freeze_entropy",
        turbo=True,
    ),
    Knob(
        "turbo_refresh_every",
        int,
        "with turbo: recompute every position's keys and values each N passes (0: never)",
        lo=0,
        hi=4096,
        flag="--turbo-refresh-every",
        openai="turbo_refresh_every",
        ollama="turbo_refresh_every",
        turbo=True,
    ),
    Knob(
        "turbo_dormant_entropy",
        float,
        "with turbo: a position still noise whose entropy (nats) is above this is computed every other pass "
        "(0: every pass)",
        lo=0,
        hi=1e6,
        flag="--turbo-dormant-entropy",
        openai="turbo_dormant_entropy",
        ollama="turbo_dormant_entropy",
        turbo=True,
    ),
)


def knob(name: str) -> Knob:
    """The table's row for the GenerationConfig field `name`."""
    return next(k for k in KNOBS if k.name == name)
