"""Forced tool calls as a grammar: Gemma 4's call syntax, with each function's parameters schema,
written in llguidance's Lark dialect and enforced on the canvas like any structured output.

With `tool_choice` "required" or a named function, the prompt already ends with the call's
opening (ToolSpec.prefill); the grammar covers the rest: the function name (required), the
arguments in Gemma 4's syntax (bare keys, strings between <|"|> markers, JSON numbers and
literals), `}<tool_call|>`, further calls where parallel_tool_calls allows, then EOS. So a
forced call always parses, and its arguments validate against the parameters schema.

Schema support: type (one or a list), properties (in declared order; required ones always,
optional ones may be left out), enum and const, maxLength / minLength, pattern (as a regex on
the string's text), integer and number bounds (through llguidance's JSON number grammar),
items with minItems / maxItems, anyOf / oneOf, nullable. A schema without a type takes any value.
A string's text may not contain "<" (which would begin a marker). Other keywords that constrain
values ($ref, allOf, not, patternProperties, ...) are refused with a 400 naming them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from .specs import ToolError, ToolSpec
from .syntax import QUOTE, TOOL_CALL, TOOL_CALL_END

UNSUPPORTED = (
    "$ref",
    "allOf",
    "not",
    "patternProperties",
    "dependentSchemas",
    "if",
    "then",
    "else",
    "prefixItems",
    "contains",
    "uniqueItems",
    "propertyNames",
    "minProperties",
    "maxProperties",
)
NUMBER_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
MAX_REPEAT = 256  # a bounded array: items up to this many are spelled out as a repetition


def lark_string(text: str) -> str:
    return json.dumps(text)


def lark_regex(pattern: str) -> str:
    """A regex as the inside of a Lark /.../ literal: unescaped slashes and raw line breaks
    escaped (either would end the literal, and the rest would be read as grammar)."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            out.append(pattern[i : i + 2])
            i += 2
            continue
        out.append({"/": "\\/", "\n": "\\n", "\r": "\\r"}.get(c, c))
        i += 1
    return "".join(out)


class _Writer:
    """Lark rules for schemas, one per schema node (named r0, r1, ...)."""

    def __init__(self, literal: Callable[[str], str], where: str):
        self.literal, self.where = literal, where
        self.rules: list[str] = []
        self.q = literal(QUOTE)
        self._any: str | None = None

    def rule(self, body: str) -> str:
        name = f"r{len(self.rules)}"
        self.rules.append(f"{name}: {body}")
        return name

    def fail(self, path: str, why: str):
        raise ToolError(
            "tool_choice",
            f"tool_choice forces a call, but {self.where}{path} {why}; forced calls support "
            "the keywords listed in docs/server.md (Tool calling)",
        )

    def value(self, schema: Any, path: str) -> str:
        if schema is True or schema == {}:
            return self.any_value()
        if not isinstance(schema, dict):
            self.fail(path, f"is not a schema object (got {json.dumps(schema)[:40]})")
        bad = [k for k in UNSUPPORTED if k in schema]
        if bad:
            self.fail(path, f"uses '{bad[0]}'")
        alts = []
        if "const" in schema:
            alts = [self.constant(schema["const"], path)]
        elif "enum" in schema:
            if not isinstance(schema["enum"], list) or not schema["enum"]:
                self.fail(path, "has an enum that is not a non-empty list")
            alts = [self.constant(v, path) for v in schema["enum"]]
        elif "anyOf" in schema or "oneOf" in schema:
            options = schema.get("anyOf", schema.get("oneOf"))
            if not isinstance(options, list) or not options:
                self.fail(path, "has an anyOf / oneOf that is not a non-empty list")
            alts = [self.value(s, f"{path}.anyOf[{i}]") for i, s in enumerate(options)]
        else:
            kinds = schema.get("type")
            kinds = [kinds] if isinstance(kinds, str) else kinds
            if kinds is None:
                kinds = ["object"] if "properties" in schema else (["array"] if "items" in schema else None)
            if kinds is None:
                return self.any_value()
            alts = [self.typed(k, schema, path) for k in kinds]
        if schema.get("nullable") is True:
            alts.append(self.literal("null"))
        return self.rule(" | ".join(alts))

    def constant(self, value: Any, path: str) -> str:
        if isinstance(value, str):
            if "<" in value:
                self.fail(path, "has a string constant holding '<'")
            return f"{self.q} {lark_string(value)} {self.q}"
        if isinstance(value, (dict, list)):
            self.fail(path, "has an object or array constant")
        return self.literal(json.dumps(value))

    def typed(self, kind: Any, schema: dict, path: str) -> str:
        if kind == "string":
            return self.string(schema, path)
        if kind in ("integer", "number"):
            number = {"type": kind, **{k: schema[k] for k in NUMBER_KEYS if k in schema}}
            return f"%json {json.dumps(number)}"
        if kind == "boolean":
            return f"{self.literal('true')} | {self.literal('false')}"
        if kind == "null":
            return self.literal("null")
        if kind == "array":
            return self.array(schema, path)
        if kind == "object":
            return self.object(schema, path)
        self.fail(path, f"has type {json.dumps(kind)}")

    def string(self, schema: dict, path: str) -> str:
        lo, hi = schema.get("minLength", 0), schema.get("maxLength")
        if not isinstance(lo, int) or (hi is not None and not isinstance(hi, int)) or (hi is not None and hi < lo):
            self.fail(path, "has string length bounds that are not integers with minLength <= maxLength")
        if "pattern" in schema:
            pattern = str(schema["pattern"])
            body = pattern[1:] if pattern.startswith("^") else pattern
            body = body[:-1] if body.endswith("$") and not body.endswith("\\$") else body
            text = f"/(?:{lark_regex(body)})/"
        else:
            text = f"/[^<]{{{lo},{'' if hi is None else hi}}}/"
        return f"{self.q} {text} {self.q}"

    def array(self, schema: dict, path: str) -> str:
        item = self.value(schema.get("items", True), f"{path}.items")
        lo, hi = schema.get("minItems", 0), schema.get("maxItems")
        if not isinstance(lo, int) or (hi is not None and (not isinstance(hi, int) or hi < lo)):
            self.fail(path, "has item count bounds that are not integers with minItems <= maxItems")
        if hi is not None and hi > MAX_REPEAT:
            hi = None
        more = self.rule(f'"," {item}')
        if hi == 0:
            return '"[" "]"'
        tail = f"{more}{{{max(lo - 1, 0)},{'' if hi is None else hi - 1}}}"
        body = f"{item} {tail}"
        return f'"[" {body} "]"' if lo >= 1 else f'"[" ({body})? "]"'

    def object(self, schema: dict, path: str) -> str:
        return f'"{{" {self.members(schema, path)} "}}"'

    def members(self, schema: dict, path: str) -> str:
        """The inside of an object: declared properties in order, required ones always present.

        The properties are split in halves, recursively (a balanced tree, log2(n) deep): each
        node is a rule for its members joined by commas, never empty, holding all its required
        ones. A chain of one rule per property would be n references deep, and llguidance
        compiles reference chains recursively (a few thousand overflow its stack)."""
        props = schema.get("properties") or {}
        if not props:
            return (
                self.rule(f'({self.any_member()} ("," {self.any_member()})*)?')
                if schema.get("additionalProperties", True) is not False
                else '""'
            )
        required = set(schema.get("required") or [])
        items = [
            (self.rule(f"{lark_string(name + ':')} {self.value(sub, f'{path}.properties.{name}')}"), name in required)
            for name, sub in props.items()
        ]
        rule, needed = self.joined(items)
        return rule if needed else f"({rule})?"

    def joined(self, items: list[tuple[str, bool]]) -> tuple[str, bool]:
        """A rule for a non-empty, comma-joined, in-order selection of `items` ((rule, required)
        pairs) that holds every required one; and whether any is required."""
        if len(items) == 1:
            return items[0]
        half = len(items) // 2
        (a, need_a), (b, need_b) = self.joined(items[:half]), self.joined(items[half:])
        if need_a and need_b:
            body = f'{a} "," {b}'
        elif need_a:
            body = f'{a} ("," {b})?'
        elif need_b:
            body = f'({a} ",")? {b}'
        else:
            body = f'{a} ("," {b})? | {b}'
        return self.rule(body), need_a or need_b

    def any_member(self) -> str:
        return self.rule(f'/[A-Za-z_][A-Za-z0-9_]*/ ":" {self.any_value()}')

    def any_value(self) -> str:
        """Any value in Gemma 4's syntax (one recursive rule, written once)."""
        if self._any is None:
            self._any = f"r{len(self.rules)}"
            self.rules.append("")  # reserved: the body refers to itself
            member = self.rule(f'/[A-Za-z_][A-Za-z0-9_]*/ ":" {self._any}')
            body = (
                f'{self.q} /[^<]*/ {self.q} | %json {{"type": "number"}} | {self.literal("true")} | '
                f'{self.literal("false")} | {self.literal("null")} | "{{" ({member} ("," {member})*)? "}}" | '
                f'"[" ({self._any} ("," {self._any})*)? "]"'
            )
            self.rules[int(self._any[1:])] = f"{self._any}: {body}"
        return self._any


def tool_call_grammar(spec: ToolSpec, literal: Callable[[str], str]) -> str | None:
    """The Lark grammar of what follows `spec.prefill` in a forced call, or None when the
    choice forces nothing. `literal(text)` spells a marker (a special token, or its text).
    The writer recurses on the schemas' nesting, which check_tools bounds (MAX_TOOL_DEPTH); a
    RecursionError all the same is a ToolError (a 400), not a server fault."""
    if spec.choice not in ("required", "function"):
        return None
    try:
        return _call_grammar(spec, literal)
    except RecursionError:
        raise ToolError(
            "tool_choice",
            "tool_choice forces a call, but the parameters schemas are nested too deeply to write its grammar",
        ) from None


def _call_grammar(spec: ToolSpec, literal: Callable[[str], str]) -> str:
    functions = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in spec.tools}
    end = literal(TOOL_CALL_END)
    if spec.choice == "function":
        w = _Writer(literal, f"the parameters of '{spec.name}'")
        start = f'{w.members(functions[spec.name], "")} "}}" {end}'
    else:
        w = _Writer(literal, "the parameters of ")
        calls = []
        for name, params in functions.items():
            w.where = f"the parameters of '{name}'"
            calls.append(w.rule(f'{lark_string(name + "{")} {w.members(params, "")} "}}" {end}'))
        call = w.rule(" | ".join(calls))
        again = f' ("\\n"? {literal(TOOL_CALL)} "call:" {call})*' if spec.parallel else ""
        start = f"{call}{again}"
    return "\n".join([f"start: {start}", *w.rules])
