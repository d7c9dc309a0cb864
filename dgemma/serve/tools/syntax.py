"""Gemma 4's function-calling syntax: the marker tokens and the writing of values, declarations,
calls and results in it. Gemma 4 writes tools as special-token-delimited blocks:

    declaration (system turn)  <|tool>declaration:NAME{description:<|"|>...<|"|>,parameters:{...}}<tool|>
    call (model turn)          <|tool_call>call:NAME{city:<|"|>Paris<|"|>,days:3}<tool_call|>
    result (same model turn)   <|tool_response>response:NAME{value:<|"|>...<|"|>}<tool_response|>

Inside the braces: bare keys, strings between `<|"|>` markers (raw text, no escapes), numbers,
true / false / null, `{...}` objects and `[...]` lists. Parallel calls are consecutive blocks.
The one place that knows the syntax's tokens; render.py writes chats with it, calls.py
reads calls back, grammar.py forces them (docs/server.md, "Tool calling").
"""

from __future__ import annotations

import json
from typing import Any

TOOL_CALL, TOOL_CALL_END = "<|tool_call>", "<tool_call|>"
TOOL_RESPONSE, TOOL_RESPONSE_END = "<|tool_response>", "<tool_response|>"
TOOL_DECL, TOOL_DECL_END = "<|tool>", "<tool|>"
QUOTE = '<|"|>'
# tokens a tool request's output is decoded with even where the tokenizer marks them special
KEPT_TOKENS = (TOOL_CALL, TOOL_CALL_END, QUOTE, TOOL_RESPONSE)


def format_value(value: Any) -> str:
    """A JSON value in Gemma 4's argument syntax (object keys bare and sorted, as its template writes them)."""
    if isinstance(value, str):
        return QUOTE + value + QUOTE
    if value is True or value is False:
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return json.dumps(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{format_value(v)}" for k, v in sorted(value.items())) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(format_value(v) for v in value) + "]"
    return QUOTE + str(value) + QUOTE


SCHEMA_KEYS = ("description", "enum", "items", "nullable", "properties", "required", "type")


def _schema(schema: dict) -> str:
    """A parameter schema as Gemma 4 declares it: description first, type (upper case) last,
    properties recursively; keys other than SCHEMA_KEYS are left out, as Gemma 4's template does."""
    parts = []
    if isinstance(schema.get("description"), str):
        parts.append(f"description:{QUOTE}{schema['description']}{QUOTE}")
    for key in sorted(k for k in schema if k in SCHEMA_KEYS and k not in ("description", "type")):
        value = schema[key]
        if key == "properties" and isinstance(value, dict):
            inner = ",".join(
                f"{n}:{_schema(s) if isinstance(s, dict) else format_value(s)}" for n, s in sorted(value.items())
            )
            parts.append("properties:{" + inner + "}")
        elif key == "items" and isinstance(value, dict):
            parts.append("items:" + _schema(value))
        else:
            parts.append(f"{key}:{format_value(value)}")
    kind = schema.get("type")
    if isinstance(kind, str):
        parts.append(f"type:{format_value(kind.upper())}")
    elif isinstance(kind, list):
        parts.append(f"type:{format_value([str(k).upper() for k in kind])}")
    return "{" + ",".join(parts) + "}"


def format_declaration(tool: dict) -> str:
    fn = tool["function"]
    body = f"description:{QUOTE}{fn.get('description', '')}{QUOTE}"
    if fn.get("parameters"):
        body += ",parameters:" + _schema(fn["parameters"])
    return f"{TOOL_DECL}declaration:{fn['name']}{{{body}}}{TOOL_DECL_END}"


def format_call(name: str, arguments: dict | str) -> str:
    """A call as Gemma 4 emits it; arguments that were not a JSON object go in as sent."""
    inner = format_value(arguments)[1:-1] if isinstance(arguments, dict) else arguments
    return f"{TOOL_CALL}call:{name}{{{inner}}}{TOOL_CALL_END}"


def format_response(name: str, result: str) -> str:
    return f"{TOOL_RESPONSE}response:{name}{{value:{format_value(result)}}}{TOOL_RESPONSE_END}"
