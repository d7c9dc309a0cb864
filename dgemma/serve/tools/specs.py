"""OpenAI tool fields checked: a request's `tools`, `tool_choice` and `parallel_tool_calls`
(-> ToolSpec), and the tool parts of its messages (assistant `tool_calls`, role "tool" results).

Pure functions; each problem is a ToolError naming the request field, which the server answers
with a 400 (docs/server.md, "Tool calling").
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from ..structured.limits import MAX_TOOL_PROPERTIES, MAX_TOOLS_BYTES, TOOL_LIMITS, LimitError, check_schema, text_bytes
from .syntax import TOOL_CALL

MAX_TOOLS = 128
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
CHOICES = ("none", "auto", "required")
CHOICE_FORMS = "'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}"


class ToolError(ValueError):
    """A tools / tool_choice / tool message problem: a 400 naming `param`."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ------------------------------------------------------------------------------------ request checks
@dataclass(frozen=True)
class ToolSpec:
    """A request's validated tools and tool_choice."""

    tools: list[dict] = field(default_factory=list)
    choice: str = "none"  # "none" | "auto" | "required" | "function" (a named function)
    name: str | None = None  # the function tool_choice names
    parallel: bool = True

    @property
    def active(self) -> bool:
        """Tools are declared to the model and its output is parsed for calls."""
        return bool(self.tools) and self.choice != "none"

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}

    @property
    def prefill(self) -> str:
        """Text the answer is made to start with: the opening of a call for "required" (any
        function) and for a named function (that one), appended to the prompt."""
        if self.choice == "required":
            return TOOL_CALL + "call:"
        if self.choice == "function":
            return f"{TOOL_CALL}call:{self.name}{{"
        return ""


def _check_function(i: int, fn: Any) -> dict:
    p = f"tools[{i}].function"
    if not isinstance(fn, dict):
        raise ToolError(p, f"{p} must be an object with a 'name' (got {_short(fn)})")
    unknown = sorted(set(fn) - {"name", "description", "parameters", "strict"})
    if unknown:
        raise ToolError(f"{p}.{unknown[0]}", f"unknown field '{p}.{unknown[0]}'")
    if "name" not in fn:
        raise ToolError(f"{p}.name", f"{p}.name is missing")
    name = fn["name"]
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ToolError(
            f"{p}.name", f"{p}.name must be 1 to 64 letters, digits, underscores or dashes (got {_short(name)})"
        )
    if not isinstance(fn.get("description", ""), str):
        raise ToolError(f"{p}.description", f"{p}.description must be a string")
    try:
        text_bytes(fn.get("description") or "", f"{p}.description")
    except LimitError as e:
        raise ToolError(e.param, str(e)) from None
    if not isinstance(fn.get("strict", False), (bool, type(None))):
        raise ToolError(f"{p}.strict", f"{p}.strict must be a boolean")
    params = fn.get("parameters")
    if params is not None:
        pp = f"{p}.parameters"
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise ToolError(
                pp,
                f"{pp} must be a JSON Schema object, {{'type': 'object', 'properties': {{...}}}} "
                f"(got {_short(params)})",
            )
        props = params.get("properties", {})
        if not isinstance(props, dict) or not all(isinstance(v, dict) for v in props.values()):
            raise ToolError(f"{pp}.properties", f"{pp}.properties must map each parameter name to a schema object")
        required = params.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise ToolError(f"{pp}.required", f"{pp}.required must be a list of parameter names")
    return {k: v for k, v in fn.items() if v is not None}


def check_tools(tools: Any) -> list[dict]:
    """An OpenAI `tools` list, checked: each {"type": "function", "function": {"name", "description"?,
    "parameters"?, "strict"?}} with a unique name. None and [] are no tools."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ToolError("tools", f"tools must be a list of tool objects (got {_short(tools)})")
    if len(tools) > MAX_TOOLS:
        raise ToolError("tools", f"tools holds {len(tools)} tools; at most {MAX_TOOLS} are allowed")
    out, seen = [], {}
    size = properties = 0  # of all the tools' parameters: a forced call compiles them together
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise ToolError(f"tools[{i}]", f"tools[{i}] must be an object (got {_short(tool)})")
        if tool.get("type") != "function":
            raise ToolError(
                f"tools[{i}].type",
                f"tools[{i}].type must be 'function' (got {_short(tool.get('type'))}); "
                "only function tools are supported",
            )
        unknown = sorted(set(tool) - {"type", "function"})
        if unknown:
            raise ToolError(f"tools[{i}].{unknown[0]}", f"unknown field 'tools[{i}].{unknown[0]}'")
        fn = _check_function(i, tool.get("function"))
        if fn["name"] in seen:
            raise ToolError(
                f"tools[{i}].function.name",
                f"tools[{i}] and tools[{seen[fn['name']]}] are both named '{fn['name']}'; "
                "function names must be unique",
            )
        seen[fn["name"]] = i
        stats = _check_parameters(i, fn.get("parameters"))
        size, properties = size + stats[0], properties + stats[1]
        if size > MAX_TOOLS_BYTES:
            raise ToolError(
                "tools", f"tools: {size} bytes of parameters schemas (or more); at most {MAX_TOOLS_BYTES} are allowed"
            )
        if properties > MAX_TOOL_PROPERTIES:
            raise ToolError(
                "tools", f"tools: {properties} properties (or more); at most {MAX_TOOL_PROPERTIES} are allowed"
            )
        out.append({"type": "function", "function": fn})
    return out


def _check_parameters(i: int, params: Any) -> tuple[int, int]:
    """A parameters schema within grammar_limits' tool limits (nesting, properties, size, valid
    Unicode): the chat template renders it and a forced call compiles it, both recursively.
    Its (bytes, properties)."""
    if params is None:
        return 0, 0
    try:
        stats = check_schema(params, f"tools[{i}].function.parameters", TOOL_LIMITS)
    except LimitError as e:
        raise ToolError(e.param, str(e)) from None
    return stats.bytes, stats.properties


def tool_spec(tools: Any, tool_choice: Any = None, parallel_tool_calls: bool | None = None) -> ToolSpec:
    """The request's tools, tool_choice ("none", "auto", "required" or {"type": "function",
    "function": {"name": ...}}; default "auto" with tools, else "none") and parallel_tool_calls."""
    checked = check_tools(tools)
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    if tool_choice is None:
        return ToolSpec(checked, "auto" if checked else "none", None, parallel)
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise ToolError("tool_choice", f"tool_choice must be {CHOICE_FORMS} (got {_short(tool_choice)})")
        if tool_choice == "required" and not checked:
            raise ToolError("tool_choice", "tool_choice 'required' needs tools")
        return ToolSpec(checked, tool_choice, None, parallel)
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function":
        raise ToolError("tool_choice", f"tool_choice must be {CHOICE_FORMS} (got {_short(tool_choice)})")
    fn = tool_choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or set(tool_choice) != {"type", "function"} or set(fn) != {"name"}:
        raise ToolError(
            "tool_choice.function",
            f"tool_choice must be {{'type': 'function', 'function': {{'name': ...}}}} (got {_short(tool_choice)})",
        )
    if name not in {t["function"]["name"] for t in checked}:
        known = ", ".join(t["function"]["name"] for t in checked) or "none"
        raise ToolError(
            "tool_choice.function.name", f"tool_choice names function '{name}', which is not in tools (tools: {known})"
        )
    return ToolSpec(checked, "function", name, parallel)


# ------------------------------------------------------------------------------------ message checks
def _no_content(content: Any) -> bool:
    return content is None or content == []


def text_of(content: Any) -> str | None:
    """A string, or the text of a list of text parts; None for anything else."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    return None


def _arguments(raw: str) -> dict | str:
    """A call's JSON arguments as an object to render; a string that is not one stays as sent."""
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    return value if isinstance(value, dict) else raw


def _check_calls(i: int, calls: Any) -> list[dict]:
    p = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise ToolError(p, f"{p} must be a list of tool calls (got {_short(calls)})")
    out = []
    for j, call in enumerate(calls):
        pj = f"{p}[{j}]"
        if not isinstance(call, dict):
            raise ToolError(pj, f"{pj} must be an object (got {_short(call)})")
        unknown = sorted(set(call) - {"id", "type", "function", "index"})
        if unknown:
            raise ToolError(f"{pj}.{unknown[0]}", f"unknown field '{pj}.{unknown[0]}'")
        if not isinstance(call.get("id"), str) or not call["id"]:
            raise ToolError(f"{pj}.id", f"{pj}.id must be a non-empty string")
        if call.get("type", "function") != "function":
            raise ToolError(f"{pj}.type", f"{pj}.type must be 'function' (got {_short(call.get('type'))})")
        fn = call.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise ToolError(
                f"{pj}.function", f"{pj}.function must be {{'name': str, 'arguments': JSON string}} (got {_short(fn)})"
            )
        if set(fn) - {"name", "arguments"}:
            raise ToolError(
                f"{pj}.function", f"unknown field '{pj}.function.{sorted(set(fn) - {'name', 'arguments'})[0]}'"
            )
        out.append(
            {
                "id": call["id"],
                "type": "function",
                "function": {"name": fn["name"], "arguments": _arguments(fn["arguments"])},
            }
        )
    return out


def check_messages(messages: list[dict]) -> list[dict]:
    """Check the tool parts of OpenAI messages ({"role": system/user/assistant/tool, "content",
    "tool_calls", "tool_call_id"}; developer already made system) and that each has the content its
    role needs. Returns, per message, what rendering needs: {"tool_calls": [...]} (arguments as
    objects) for an assistant message with calls, {"tool_call_id", "name"} for a tool result, {} else."""
    out: list[dict] = []
    calls_of: int | None = None  # the assistant message the current run of tool messages answers
    for i, m in enumerate(messages):
        role, content = m["role"], m.get("content")
        if m.get("tool_calls") is not None and role != "assistant":
            raise ToolError(
                f"messages[{i}].tool_calls", f"messages[{i}].tool_calls: only assistant messages carry tool calls"
            )
        if m.get("tool_call_id") is not None and role != "tool":
            raise ToolError(
                f"messages[{i}].tool_call_id", f"messages[{i}].tool_call_id: only role 'tool' messages carry one"
            )
        if role == "assistant":
            calls = _check_calls(i, m["tool_calls"]) if m.get("tool_calls") else []
            if not calls and _no_content(content):
                raise ToolError(
                    f"messages[{i}].content", f"messages[{i}] (role 'assistant') has neither content nor tool_calls"
                )
            out.append({"tool_calls": calls} if calls else {})
            calls_of = i if calls else None
        elif role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise ToolError(
                    f"messages[{i}].tool_call_id",
                    f"messages[{i}] (role 'tool') needs a tool_call_id: the id of the call it answers",
                )
            if calls_of is None:
                raise ToolError(
                    f"messages[{i}]",
                    f"messages[{i}] (role 'tool') must follow an assistant message with tool_calls "
                    "(or another tool message answering it)",
                )
            calls = {c["id"]: c["function"]["name"] for c in out[calls_of]["tool_calls"]}
            if call_id not in calls:
                raise ToolError(
                    f"messages[{i}].tool_call_id",
                    f"messages[{i}].tool_call_id {_short(call_id)} is not the id "
                    f"of a tool call in messages[{calls_of}] (ids: {', '.join(calls)})",
                )
            if _no_content(content) or text_of(content) is None:
                raise ToolError(
                    f"messages[{i}].content",
                    f"messages[{i}] (role 'tool') needs content: the tool's result as a string or a list of text parts",
                )
            out.append({"tool_call_id": call_id, "name": calls[call_id]})
        else:
            if _no_content(content):
                raise ToolError(f"messages[{i}].content", f"messages[{i}] (role '{role}') has no content")
            out.append({})
            calls_of = None
    return out
