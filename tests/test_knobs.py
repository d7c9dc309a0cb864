"""The knob table (dgemma/knobs.py) against the interfaces themselves, checked without a model.

Every GenerationConfig field has a row. What each interface reaches is found by asking the interface,
not the table: the command line by its parsers' flags, the OpenAI routes by running a request through the
server's translation (`Service.generation_config`, with defaults that record what they are given), the
ollama routes by translating an `options` map into that request first, the Python API by
`Model.generate`'s signature. Each must reach exactly the fields the table says, by the names it says;
a field an interface does not reach must be listed in the table as deliberately so, with the reason.
The gap check also runs on a made-up table with deliberate mistakes, to show that it fails where it
should.
"""

import argparse
import inspect
import typing
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from dgemma.api import Model
from dgemma.cli import build_parser
from dgemma.config import GENERATION_FIELDS
from dgemma.inputs.model_inputs import ModelInputs
from dgemma.knobs import INTERFACES, KNOBS, Knob
from dgemma.serve.errors import ApiError
from dgemma.serve.ollama.protocol import OPTION_TYPES, ChatRequest, OllamaNames, chat_params
from dgemma.serve.openai.protocol import Budgets, ChatParams, CompletionParams
from dgemma.serve.pipeline import parse_params
from dgemma.serve.service import Service

DOCS = Path(__file__).resolve().parents[1] / "docs"
MESSAGES = [{"role": "user", "content": "hi"}]


# ------------------------------------------------------------------------------------ asking the interfaces
def _subcommand(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]


def cli_flags(command: str) -> dict[str, list[str]]:
    """The GenerationConfig fields a command's flags set, each with its flags."""
    return {a.dest: a.option_strings for a in _subcommand(command)._actions if a.dest in GENERATION_FIELDS}


class _Recording:
    """Stands in for the server's defaults (the checkpoint's GenerationConfig): records the overrides a
    request's translation hands it, unchecked, so that every field can be sent at once."""

    max_new_tokens, max_denoising_steps = 256, 48

    def __init__(self):
        self.overrides: dict[str, Any] = {}

    def with_overrides(self, **overrides: Any) -> "_Recording":
        self.overrides = overrides
        return self


def overrides_of(params) -> dict[str, Any]:
    """The GenerationConfig overrides the server makes of a checked request (`Service.generation_config`
    on a context and budget that fit anything; max_tokens as pipeline.prepare passes it)."""
    scheduler = SimpleNamespace(refusal=lambda *_: None)
    service = SimpleNamespace(
        canvas=256,
        context=1 << 20,
        defaults=_Recording(),
        budgets=Budgets(),
        engine_thread=SimpleNamespace(engine=SimpleNamespace(scheduler=scheduler)),
    )
    max_tokens = getattr(params, "max_completion_tokens", None) or params.max_tokens
    Service.generation_config(service, params, ModelInputs([2, 3, 4]), max_tokens)
    return service.defaults.overrides


def _bound(info, name: str) -> float | None:
    return next((getattr(m, name) for m in info.metadata if getattr(m, name, None) is not None), None)


def request_sample(info) -> Any:
    """A valid value of a scalar request field (its lowest), or None for any other field."""
    kinds = {a for a in typing.get_args(info.annotation) or (info.annotation,) if a is not type(None)}
    if kinds == {bool}:
        return True
    if kinds not in ({int}, {float}):
        return None
    ge, gt = _bound(info, "ge"), _bound(info, "gt")
    value = ge if ge is not None else gt + 1 if gt is not None else 1
    return float(value) if kinds == {float} else int(value)


def every_scalar(kind) -> dict[str, Any]:
    """Every scalar field of a request model, at a valid value."""
    samples = {name: request_sample(info) for name, info in kind.model_fields.items()}
    return {name: value for name, value in samples.items() if value is not None}


ROUTES = {"chat": (ChatParams, {"messages": MESSAGES}), "completions": (CompletionParams, {"prompt": "hi"})}


def openai_request(route: str, fields: dict[str, Any]):
    kind, required = ROUTES[route]
    return kind.model_validate({"model": "m", **required, **fields})


def changed(params, baseline) -> set[str]:
    """The GenerationConfig fields `params` sets otherwise than `baseline` (the same route, nothing sent)."""
    sent, base = overrides_of(params), overrides_of(baseline)
    return {f for f in GENERATION_FIELDS if sent.get(f) != base.get(f)}


def option_sample(kind: str) -> Any:
    return {"integer": 1, "float": 1.0, "boolean": True, "array of strings": ["x"]}[kind]


def ollama_request(options: dict[str, Any]):
    req = ChatRequest.model_validate({"model": "m", "messages": MESSAGES, "options": options})
    return chat_params(req, "m", OllamaNames()).params


def reach() -> dict[str, set[str]]:
    """The GenerationConfig fields each interface reaches, by asking it."""
    empty_chat = openai_request("chat", {})
    openai = {
        route: changed(openai_request(route, every_scalar(ROUTES[route][0])), openai_request(route, {}))
        for route in ROUTES
    }
    assert openai["chat"] == openai["completions"]  # both routes take the same knobs
    every_option = {name: option_sample(kind) for name, kind in OPTION_TYPES.items()}
    return {
        "cli": set(cli_flags("run")),
        "openai": openai["chat"],
        "ollama": changed(ollama_request(every_option), empty_chat),
        "api": set(inspect.signature(Model.generate).parameters) & set(GENERATION_FIELDS),
    }


# ------------------------------------------------------------------------------------ the gap rule
def undeclared_gaps(table: tuple[Knob, ...], reached: dict[str, set[str]]) -> list[str]:
    """Each field an interface does not reach without the table saying why, and each reason the table
    gives for an interface that does reach it."""
    out = []
    for k in table:
        where = [i for i in INTERFACES if k.name in reached[i]]
        for i in INTERFACES:
            if k.name not in reached[i] and not k.why_absent(i):
                out.append(
                    f"{k.name}: reached from {', '.join(where) or 'no interface'} but not from {i}, "
                    "and the table does not say why"
                )
            elif k.name in reached[i] and k.why_absent(i):
                out.append(f"{k.name}: the table says why {i} does not reach it, but {i} does")
    return out


def test_the_table_has_a_row_for_every_generation_config_field_in_its_order():
    assert [k.name for k in KNOBS] == list(GENERATION_FIELDS)


def test_every_interface_reaches_what_the_table_says():
    found = reach()
    for i in INTERFACES:
        assert found[i] == {k.name for k in KNOBS if k.reached_from(i)}, i


def test_a_field_one_interface_lacks_is_listed_as_deliberately_so():
    assert undeclared_gaps(KNOBS, reach()) == []
    for k in KNOBS:
        assert all(i in INTERFACES and why.strip() for i, why in k.absent), k.name


def test_the_gap_check_fails_on_a_made_up_table_with_mistakes():
    table = (
        Knob("whole", int, "everywhere", flag="--whole", openai="whole", ollama="whole"),
        Knob("no_ollama", int, "forgotten by ollama", flag="--no-ollama", openai="no_ollama"),
        Knob("stale", int, "the reason is stale", flag="--stale", openai="stale", absent=(("ollama", "was"),)),
        Knob("nowhere", int, "the checkpoint's", api=False, absent=tuple((i, "its own") for i in INTERFACES[:3])),
    )
    everywhere = {"whole", "no_ollama", "stale"}
    reached = {"cli": everywhere, "openai": everywhere, "ollama": {"whole", "stale"}, "api": everywhere}
    assert undeclared_gaps(table, reached) == [
        "no_ollama: reached from cli, openai, api but not from ollama, and the table does not say why",
        "stale: the table says why ollama does not reach it, but ollama does",
        "nowhere: reached from no interface but not from api, and the table does not say why",
    ]


# ------------------------------------------------------------------------------------ by the table's names
@pytest.mark.parametrize("k", [k for k in KNOBS if k.flag], ids=lambda k: k.name)
def test_each_flag_sets_its_field_in_run_and_chat(k):
    for command in ("run", "chat"):
        assert cli_flags(command)[k.name] == [k.flag], command


def test_serve_and_bench_take_the_turbo_knobs_flags_and_no_other_knob_flag():
    flags = {(k.flag, k.name) for k in KNOBS if k.flag}  # bench's own --steps sets its own `steps`
    for command in ("serve", "bench"):
        taken = {(s, a.dest) for a in _subcommand(command)._actions for s in a.option_strings}
        assert taken & flags == {(k.flag, k.name) for k in KNOBS if k.turbo}, command


@pytest.mark.parametrize("k", [k for k in KNOBS if k.openai], ids=lambda k: k.name)
def test_each_request_field_sets_its_field_on_both_routes(k):
    for route, (kind, _) in ROUTES.items():
        sample = request_sample(kind.model_fields[k.openai])
        assert changed(openai_request(route, {k.openai: sample}), openai_request(route, {})) == {k.name}, route


@pytest.mark.parametrize("k", [k for k in KNOBS if k.ollama], ids=lambda k: k.name)
def test_each_option_sets_its_field(k):
    sample = option_sample(OPTION_TYPES[k.ollama])
    assert changed(ollama_request({k.ollama: sample}), openai_request("chat", {})) == {k.name}


@pytest.mark.parametrize("k", [k for k in KNOBS if k.openai and k.kind is not bool], ids=lambda k: k.name)
def test_a_value_past_the_tables_bound_is_refused_by_name_on_both_apis(k):
    too_big = k.hi + 1
    with pytest.raises(ApiError) as openai:
        parse_params({"model": "m", "messages": MESSAGES, k.openai: k.kind(too_big)}, chat=True)
    assert openai.value.status == 400 and openai.value.param == k.openai
    low = k.lo - 1 if k.lo is not None else k.above
    with pytest.raises(ApiError):
        parse_params({"model": "m", "prompt": "hi", k.openai: k.kind(low)}, chat=False)
    if k.ollama is not None:
        names = OllamaNames()
        with pytest.raises(ApiError) as ollama, names.renaming():
            ollama_request({k.ollama: k.kind(too_big)})
        assert ollama.value.param == f"options.{k.ollama}" and f"options.{k.ollama}" in ollama.value.message


def test_docs_server_md_names_every_request_field_and_option_of_the_table():
    text = (DOCS / "server.md").read_text()
    for k in KNOBS:
        for name in (k.openai, k.ollama):
            assert name is None or f"`{name}`" in text, name
