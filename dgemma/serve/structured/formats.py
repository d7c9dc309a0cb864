"""Structured output fields of a request, checked and compiled to a grammar (engine/constraints/grammar.py
enforces it on the canvas).

OpenAI's `response_format` ({"type": "text" | "json_object" | "json_schema"}), and vLLM's extra
fields `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (Lark). At most one of
them per request. A `json_schema` with `strict: false` is compiled leniently (schema keywords
llguidance does not implement are ignored instead of refused); the output always matches what
is enforced either way.

Every grammar is checked against serve/structured/limits.py before it is compiled (`check_format`):
llguidance's compiler recurses natively, and what is too deep for it crashes the process.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ...engine.constraints.grammar import Grammar, GrammarCompiler, GrammarError
from .limits import MAX_CHOICES, LimitError, check_choices, check_lark, check_regex, check_schema, text_bytes  # noqa: F401

SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
CACHE_SIZE = 64  # compiled grammars kept: agents resend the same schema with every turn


class StructuredError(ValueError):
    """A structured-output field the server refuses: a 400 naming `param`."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class OutputFormat:
    """What a request asks its output to be: a grammar kind and its spec, and the field it came from."""

    kind: str  # json_schema | json_object | regex | lark
    spec: Any
    param: str
    lenient: bool = False
    generated: bool = False  # written by the server from checked input (a forced call's grammar): no Lark limits

    def key(self) -> str:
        return json.dumps([self.kind, self.spec, self.lenient], sort_keys=True, default=str)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def response_format(value: Any) -> OutputFormat | None:
    """OpenAI's response_format, checked; None for plain text."""
    p = "response_format"
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise StructuredError(p, f"{p} must be an object with a 'type' (got {_short(value)})")
    kind = value["type"]
    if kind == "text":
        _no_extra(value, {"type"}, p)
        return None
    if kind == "json_object":
        _no_extra(value, {"type"}, p)
        return OutputFormat("json_object", None, p)
    if kind != "json_schema":
        raise StructuredError(
            f"{p}.type", f"{p}.type must be 'text', 'json_object' or 'json_schema' (got {_short(kind)})"
        )
    _no_extra(value, {"type", "json_schema"}, p)
    js = value.get("json_schema")
    q = f"{p}.json_schema"
    if not isinstance(js, dict):
        raise StructuredError(q, f"{q} must be an object with a 'name' and a 'schema' (got {_short(js)})")
    _no_extra(js, {"name", "schema", "strict", "description"}, q)
    name = js.get("name")
    if not isinstance(name, str) or not SCHEMA_NAME.fullmatch(name):
        raise StructuredError(
            f"{q}.name", f"{q}.name must be 1 to 64 letters, digits, underscores or dashes (got {_short(name)})"
        )
    strict = js.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise StructuredError(f"{q}.strict", f"{q}.strict must be a boolean (got {_short(strict)})")
    if not isinstance(js.get("description", ""), str):
        raise StructuredError(f"{q}.description", f"{q}.description must be a string")
    schema = js.get("schema", {"type": "object"})  # OpenAI: no schema is any JSON object
    if not isinstance(schema, dict):
        raise StructuredError(f"{q}.schema", f"{q}.schema must be a JSON Schema object (got {_short(schema)})")
    return OutputFormat("json_schema", schema, f"{q}.schema", lenient=strict is False)


def guided_format(fields: dict[str, Any]) -> OutputFormat | None:
    """vLLM's guided_* fields (at most one set), checked."""
    given = {k: v for k, v in fields.items() if v is not None}
    if not given:
        return None
    if len(given) > 1:
        raise StructuredError(
            sorted(given)[1], f"send one of {', '.join(GUIDED_FIELDS)}, not {' and '.join(sorted(given))}"
        )
    name, value = next(iter(given.items()))
    if name == "guided_json":  # a schema object or its JSON text (checked when compiled)
        if not isinstance(value, (dict, str)):
            raise StructuredError(name, f"{name} must be a JSON Schema object (got {_short(value)})")
        return OutputFormat("json_schema", value, name)
    if name == "guided_choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise StructuredError(name, f"{name} must be a non-empty list of non-empty strings (got {_short(value)})")
        try:
            check_choices(value, name)
        except LimitError as e:
            raise StructuredError(e.param, str(e)) from None
        return OutputFormat("regex", "|".join(f"(?:{re.escape(c)})" for c in value), name)
    if not isinstance(value, str) or not value:
        raise StructuredError(name, f"{name} must be a non-empty string (got {_short(value)})")
    return OutputFormat("regex" if name == "guided_regex" else "lark", value, name)


def request_format(response: Any, guided: dict[str, Any]) -> OutputFormat | None:
    """The one output format a request asks for (response_format or a guided_* field)."""
    a, b = response_format(response), guided_format(guided)
    if a is not None and b is not None:
        raise StructuredError(b.param, f"send response_format or {b.param}, not both")
    return a or b


def _no_extra(obj: dict, allowed: set[str], where: str) -> None:
    extra = sorted(set(obj) - allowed)
    if extra:
        raise StructuredError(f"{where}.{extra[0]}", f"unknown field '{where}.{extra[0]}'")


def check_format(fmt: OutputFormat) -> None:
    """`fmt` within serve/structured/limits.py's limits (size, rules, depth, nesting, properties,
    `$ref` chains) and valid Unicode, before anything compiles it; StructuredError naming its field."""
    try:
        if fmt.kind == "json_schema":
            spec = fmt.spec
            if isinstance(spec, str):
                text_bytes(spec, fmt.param)
                try:
                    spec = json.loads(spec)
                except RecursionError:
                    raise StructuredError(
                        fmt.param, f"{fmt.param}: the JSON schema is nested too deeply to read"
                    ) from None
                except ValueError:
                    return  # not JSON: compiling names the problem
            check_schema(spec, fmt.param)
        elif fmt.kind == "regex":
            check_regex(fmt.spec, fmt.param)
        elif fmt.kind == "lark" and not fmt.generated:
            check_lark(fmt.spec, fmt.param)
    except LimitError as e:
        raise StructuredError(e.param, str(e)) from None


class GrammarCache:
    """Compiled grammars by request format (least recently used out), shared by handler threads."""

    def __init__(self, compiler: GrammarCompiler, size: int = CACHE_SIZE):
        self.compiler, self.size = compiler, size
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, fmt: OutputFormat) -> Grammar:
        """`fmt` compiled (or from the cache); StructuredError when it is over a limit or does
        not compile. Blocking, and llguidance recurses deeply: run it on a big-stack thread
        (threads.CompileWorker)."""
        try:
            key = fmt.key()
        except RecursionError:  # nested deeper than any limit: check_format says how deep
            check_format(fmt)
            raise StructuredError(fmt.param, f"{fmt.param}: nested too deeply") from None
        with self._lock:
            if key in self._cache:  # it passed the checks when it was compiled
                self._cache.move_to_end(key)
                return self._cache[key]
        check_format(fmt)
        try:
            grammar = self.compiler.compile(fmt.kind, fmt.spec, lenient=fmt.lenient)
        except GrammarError as e:
            raise StructuredError(fmt.param, f"{fmt.param}: {e}") from None
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > self.size:
                self._cache.popitem(last=False)
        return grammar
