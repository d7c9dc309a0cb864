"""OpenAI tool calling in Gemma 4's function-calling format: checks, rendering, parsing.

Pure functions (and one small per-request parser); the server wires them in (docs/server.md,
"Tool calling"). Gemma 4 writes tools as special-token-delimited blocks:

    declaration (system turn)  <|tool>declaration:NAME{description:<|"|>...<|"|>,parameters:{...}}<tool|>
    call (model turn)          <|tool_call>call:NAME{city:<|"|>Paris<|"|>,days:3}<tool_call|>
    result (same model turn)   <|tool_response>response:NAME{value:<|"|>...<|"|>}<tool_response|>

Inside the braces: bare keys, strings between `<|"|>` markers (raw text, no escapes), numbers,
true / false / null, `{...}` objects and `[...]` lists. Parallel calls are consecutive blocks. A
chat template that handles `tools` (Gemma 4's does) is given the tools and the history as it
expects them; for one that does not, `render_chat` writes the same blocks into the messages itself.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from .grammar_limits import MAX_TOOL_PROPERTIES, MAX_TOOLS_BYTES, TOOL_LIMITS, LimitError, check_schema, text_bytes

TOOL_CALL, TOOL_CALL_END = "<|tool_call>", "<tool_call|>"
TOOL_RESPONSE, TOOL_RESPONSE_END = "<|tool_response>", "<tool_response|>"
TOOL_DECL, TOOL_DECL_END = "<|tool>", "<tool|>"
QUOTE = '<|"|>'
# tokens a tool request's output is decoded with even where the tokenizer marks them special
KEPT_TOKENS = (TOOL_CALL, TOOL_CALL_END, QUOTE, TOOL_RESPONSE)

MAX_TOOLS = 128
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
CHOICES = ("none", "auto", "required")
CHOICE_FORMS = "'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}"
MAX_DEPTH = 64


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
        raise ToolError(f"{p}.name", f"{p}.name must be 1 to 64 letters, digits, underscores or dashes (got {_short(name)})")
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
            raise ToolError(pp, f"{pp} must be a JSON Schema object, {{'type': 'object', 'properties': {{...}}}} "
                                f"(got {_short(params)})")  # fmt: skip
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
            raise ToolError(f"tools[{i}].type", f"tools[{i}].type must be 'function' (got {_short(tool.get('type'))}); "
                                                "only function tools are supported")  # fmt: skip
        unknown = sorted(set(tool) - {"type", "function"})
        if unknown:
            raise ToolError(f"tools[{i}].{unknown[0]}", f"unknown field 'tools[{i}].{unknown[0]}'")
        fn = _check_function(i, tool.get("function"))
        if fn["name"] in seen:
            raise ToolError(f"tools[{i}].function.name", f"tools[{i}] and tools[{seen[fn['name']]}] are both named '{fn['name']}'; "
                                                         "function names must be unique")  # fmt: skip
        seen[fn["name"]] = i
        stats = _check_parameters(i, fn.get("parameters"))
        size, properties = size + stats[0], properties + stats[1]
        if size > MAX_TOOLS_BYTES:
            raise ToolError("tools", f"tools: {size} bytes of parameters schemas (or more); at most {MAX_TOOLS_BYTES} are allowed")
        if properties > MAX_TOOL_PROPERTIES:
            raise ToolError("tools", f"tools: {properties} properties (or more); at most {MAX_TOOL_PROPERTIES} are allowed")
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
        raise ToolError("tool_choice.function", f"tool_choice must be {{'type': 'function', 'function': {{'name': ...}}}} "
                                                f"(got {_short(tool_choice)})")  # fmt: skip
    if name not in {t["function"]["name"] for t in checked}:
        known = ", ".join(t["function"]["name"] for t in checked) or "none"
        raise ToolError("tool_choice.function.name", f"tool_choice names function '{name}', which is not in tools (tools: {known})")
    return ToolSpec(checked, "function", name, parallel)


# ------------------------------------------------------------------------------------ message checks
def _no_content(content: Any) -> bool:
    return content is None or content == []


def _text_of(content: Any) -> str | None:
    """A string, or the text of a list of text parts; None for anything else."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                         for p in content):  # fmt: skip
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
            raise ToolError(f"{pj}.function", f"{pj}.function must be {{'name': str, 'arguments': JSON string}} (got {_short(fn)})")
        if set(fn) - {"name", "arguments"}:
            raise ToolError(f"{pj}.function", f"unknown field '{pj}.function.{sorted(set(fn) - {'name', 'arguments'})[0]}'")
        out.append({"id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": _arguments(fn["arguments"])}})
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
            raise ToolError(f"messages[{i}].tool_calls", f"messages[{i}].tool_calls: only assistant messages carry tool calls")
        if m.get("tool_call_id") is not None and role != "tool":
            raise ToolError(f"messages[{i}].tool_call_id", f"messages[{i}].tool_call_id: only role 'tool' messages carry one")
        if role == "assistant":
            calls = _check_calls(i, m["tool_calls"]) if m.get("tool_calls") else []
            if not calls and _no_content(content):
                raise ToolError(f"messages[{i}].content", f"messages[{i}] (role 'assistant') has neither content nor tool_calls")
            out.append({"tool_calls": calls} if calls else {})
            calls_of = i if calls else None
        elif role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise ToolError(f"messages[{i}].tool_call_id",
                                f"messages[{i}] (role 'tool') needs a tool_call_id: the id of the call it answers")  # fmt: skip
            if calls_of is None:
                raise ToolError(f"messages[{i}]", f"messages[{i}] (role 'tool') must follow an assistant message with tool_calls "
                                                  "(or another tool message answering it)")  # fmt: skip
            calls = {c["id"]: c["function"]["name"] for c in out[calls_of]["tool_calls"]}
            if call_id not in calls:
                raise ToolError(f"messages[{i}].tool_call_id", f"messages[{i}].tool_call_id {_short(call_id)} is not the id "
                                f"of a tool call in messages[{calls_of}] (ids: {', '.join(calls)})")  # fmt: skip
            if _no_content(content) or _text_of(content) is None:
                raise ToolError(f"messages[{i}].content", f"messages[{i}] (role 'tool') needs content: the tool's result as a "
                                                          "string or a list of text parts")  # fmt: skip
            out.append({"tool_call_id": call_id, "name": calls[call_id]})
        else:
            if _no_content(content):
                raise ToolError(f"messages[{i}].content", f"messages[{i}] (role '{role}') has no content")
            out.append({})
            calls_of = None
    return out


# ------------------------------------------------------------------------------------ rendering
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
            inner = ",".join(f"{n}:{_schema(s) if isinstance(s, dict) else format_value(s)}" for n, s in sorted(value.items()))
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


@dataclass
class ChatRender:
    """What the chat template gets, and the text that follows its generation prompt."""

    messages: list[dict]
    kwargs: dict  # extra template variables: {"tools": [...]} for a template that declares them
    suffix: str = ""  # appended after the rendered prompt: an open model turn (fallback), then `prefill`
    prefill: str = ""  # the start of the answer (tool_choice), which the output is parsed with


def template_mode(template: str | None) -> str:
    """"gemma": the template declares tools and takes results as `tool_responses` on the assistant
    message (Gemma 4's); "openai": it declares tools and takes role "tool" messages; "fallback":
    it knows nothing of tools, so render_chat writes Gemma 4's blocks into the message content."""
    if not template or "tools" not in template:
        return "fallback"
    return "gemma" if "tool_responses" in template else "openai"


def _join(a: str | list, b: str | list) -> str | list:
    """Two contents one after the other (strings stay a string; else a list of parts)."""
    if isinstance(a, str) and isinstance(b, str):
        return a + b

    def parts(c: str | list) -> list:
        return ([{"type": "text", "text": c}] if c else []) if isinstance(c, str) else list(c)

    return parts(a) + parts(b)


def _rstrip(content: str | list) -> str | list:
    return content.rstrip() if isinstance(content, str) else content


def render_chat(messages: list[dict], extras: list[dict], spec: ToolSpec | None, template: str | None) -> ChatRender:
    """Messages ({"role", "content"}, content ready for the template) plus `check_messages`'s
    extras, rendered for the chat template: tools declared when `spec.active`, assistant tool
    calls and tool results in the form the template takes (see `template_mode`).

    Fallback (a template without tools), as Gemma 4's template lays them out: the declarations
    follow the system message's text (a system message is added if there is none); an assistant
    message's calls follow its text; tool results follow the calls in the same model turn, and an
    assistant message after them goes on in that turn. A chat that ends with tool results ends
    with that model turn still open: its text goes after the generation prompt (`suffix`)."""
    spec = spec or ToolSpec()
    prefill = spec.prefill
    mode = template_mode(template)
    out: list[dict] = []
    if mode != "fallback":
        for m, extra in zip(messages, extras):
            if "tool_calls" in extra:
                out.append({**m, "tool_calls": extra["tool_calls"]})
            elif "tool_call_id" in extra and mode == "gemma":
                last = out[-1]  # the assistant message with the calls (check_messages made sure)
                result = {"name": extra["name"], "response": _text_of(m["content"])}
                last["tool_responses"] = [*last.get("tool_responses", []), result]
            elif "tool_call_id" in extra:
                out.append({**m, "content": _text_of(m["content"]), **extra})
            else:
                out.append(m)
        return ChatRender(out, {"tools": spec.tools} if spec.active else {}, prefill, prefill)

    open_turn = False  # out[-1] is a model turn that ended with tool results
    for m, extra in zip(messages, extras):
        if "tool_call_id" in extra:  # out[-1] is the model turn with the calls (check_messages made sure)
            out[-1]["content"] = _join(out[-1]["content"], format_response(extra["name"], _text_of(m["content"])))
            open_turn = True
            continue
        calls = "".join(format_call(c["function"]["name"], c["function"]["arguments"]) for c in extra.get("tool_calls", []))
        if m["role"] == "assistant" and open_turn:
            out[-1]["content"] = _join(out[-1]["content"], _join(_rstrip(m["content"]), calls))
        elif calls:
            out.append({**m, "content": _join(_rstrip(m["content"]), calls)})
        else:
            out.append(dict(m))
        open_turn = False
    if spec.active:
        decls = "".join(format_declaration(t) for t in spec.tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": _join(_rstrip(out[0]["content"]), decls)}
        else:
            out.insert(0, {"role": "system", "content": decls})
    suffix = ""
    if open_turn and len(out) > 1 and isinstance(out[-1]["content"], str):
        suffix = out.pop()["content"]
    return ChatRender(out, {}, suffix + prefill, prefill)


# ------------------------------------------------------------------------------------ decoding
def keeping_decoder(tokenizer) -> Callable[[list[int]], str]:
    """`tokenizer.decode` (special tokens skipped), except that the tool-call tokens stay in the
    text: Gemma 4's tokenizer marks <|tool_call>, <tool_call|> and <|"|> special."""
    keep = {i: t for t in KEPT_TOKENS if (i := tokenizer.token_to_id(t)) is not None}
    if not keep:
        return tokenizer.decode

    def decode(ids: list[int]) -> str:
        out, run = [], []
        for t in ids:
            if t in keep:
                out.append(tokenizer.decode(run) if run else "")
                out.append(keep[t])
                run = []
            else:
                run.append(t)
        out.append(tokenizer.decode(run) if run else "")
        return "".join(out)

    return decode


# ------------------------------------------------------------------------------------ parsing
class _Incomplete(Exception):
    """The text ends inside what may still become a call."""


class _NotACall(Exception):
    """The text breaks the call syntax (or names an unknown function)."""


_SPACE = " \t\r\n"
_BARE_KEY = re.compile(r"[^:{}\[\],\"<>\n]+")
_BARE_VALUE = re.compile(r"[^,}\]\s]+")
_FUNCTION = re.compile(r"[A-Za-z0-9_-]*")


class _Reader:
    """A recursive-descent reader of one Gemma 4 call at s[i:]."""

    def __init__(self, s: str, i: int):
        self.s, self.i = s, i

    def space(self) -> None:
        while self.i < len(self.s) and self.s[self.i] in _SPACE:
            self.i += 1

    def at_end(self) -> None:
        if self.i >= len(self.s):
            raise _Incomplete

    def starts(self, token: str) -> bool:
        """Whether `token` is next; text that ends in the middle of it is incomplete."""
        rest = self.s[self.i : self.i + len(token)]
        if rest == token:
            return True
        if len(rest) < len(token) and self.i + len(rest) == len(self.s) and token.startswith(rest):
            raise _Incomplete
        return False

    def expect(self, token: str) -> None:
        if not self.starts(token):
            raise _NotACall
        self.i += len(token)

    def string(self) -> str:
        if self.starts(QUOTE):
            start = self.i + len(QUOTE)
            end = self.s.find(QUOTE, start)
            if end < 0:
                raise _Incomplete
            self.i = end + len(QUOTE)
            return self.s[start:end]
        try:  # a JSON string, which some outputs use instead
            text, self.i = json.decoder.scanstring(self.s, self.i + 1, False)
        except json.JSONDecodeError as e:
            raise (_Incomplete if e.msg.startswith("Unterminated") else _NotACall) from None
        return text

    def key(self) -> str:
        self.space()
        self.at_end()
        if self.s[self.i] == '"' or self.starts(QUOTE):
            return self.string()
        m = _BARE_KEY.match(self.s, self.i)
        if not m:
            raise _NotACall
        if m.end() == len(self.s):
            raise _Incomplete
        self.i = m.end()
        if not m.group().strip():
            raise _NotACall
        return m.group().strip()

    def value(self, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise _NotACall
        self.space()
        self.at_end()
        c = self.s[self.i]
        if c == '"' or self.starts(QUOTE):
            return self.string()
        if c == "{":
            self.i += 1
            return self.members(depth + 1)
        if c == "[":
            self.i += 1
            return self.items(depth + 1)
        m = _BARE_VALUE.match(self.s, self.i)
        if not m or m.group().startswith("<"):
            raise _NotACall
        if m.end() == len(self.s):
            raise _Incomplete  # more digits may follow
        try:
            value = json.loads(m.group())  # a number, true, false or null
        except ValueError:
            raise _NotACall from None
        if isinstance(value, (dict, list, str)):
            raise _NotACall
        self.i = m.end()
        return value

    def _next(self, close: str) -> bool:
        """After an item: True for ',' (another follows), False for `close` (the end)."""
        self.space()
        self.at_end()
        c = self.s[self.i]
        self.i += 1
        if c == ",":
            return True
        if c == close:
            return False
        raise _NotACall

    def members(self, depth: int) -> dict:
        out: dict = {}
        self.space()
        self.at_end()
        if self.s[self.i] == "}":
            self.i += 1
            return out
        while True:
            key = self.key()
            self.space()
            self.expect(":")
            out[key] = self.value(depth)
            if not self._next("}"):
                return out

    def items(self, depth: int) -> list:
        out: list = []
        self.space()
        self.at_end()
        if self.s[self.i] == "]":
            self.i += 1
            return out
        while True:
            out.append(self.value(depth))
            if not self._next("]"):
                return out

    def call(self, names: set[str]) -> tuple[str, dict]:
        self.expect(TOOL_CALL)
        self.expect("call:")
        m = _FUNCTION.match(self.s, self.i)
        self.i = m.end()
        self.at_end()
        if self.s[self.i] != "{" or not m.group() or m.group() not in names:
            raise _NotACall
        self.i += 1
        arguments = self.members(1)
        self.space()
        self.expect(TOOL_CALL_END)
        return m.group(), arguments


def _partial_tail(s: str, start: int, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of s[start:] that is a proper prefix of one of `markers`."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(s) - start), best, -1):
            if s.endswith(marker[:k]):
                best = k
                break
    return best


def split_calls(s: str, names: set[str], final: bool) -> tuple[list, int, bool]:
    """Scan s for calls: returns (items, used, ended). Items are content strings and
    (name, arguments) calls, in order, for s[:used]; the rest may still become a call (all of s is
    decided when `final`: an unfinished call is content). `ended`: a <|tool_response> came, with
    which the model hands over to the tool runner; nothing after it is the answer."""
    items: list = []
    i = 0
    while True:
        found = [(j, m) for m in (TOOL_CALL, TOOL_RESPONSE) if (j := s.find(m, i)) >= 0]
        if not found:
            end = len(s) if final else len(s) - _partial_tail(s, i, (TOOL_CALL, TOOL_RESPONSE))
            items.append(s[i:end])
            return items, end, False
        j, marker = min(found)
        items.append(s[i:j])
        if marker == TOOL_RESPONSE:
            return items, len(s), True
        reader = _Reader(s, j)
        try:
            items.append(reader.call(names))
            i = reader.i
        except _Incomplete:
            if final:
                items.append(s[j:])
                return items, len(s), False
            return items, j, False
        except _NotACall:  # stays content; scanning goes on after its marker
            items.append(TOOL_CALL)
            i = j + len(TOOL_CALL)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolCallParser:
    """One request's committed text in, content pieces and OpenAI tool calls out, in order.

    Content is passed on as soon as it cannot be the start of a call; a call comes out once its
    closing <tool_call|> has arrived and it parses. Text that looks like a call but does not parse,
    or calls a function not in `names`, stays content. Whitespace next to calls is dropped, so an
    answer of calls only has no content. With `parallel` false the answer ends after the first
    call; it also ends at a <|tool_response> (`done`: the caller may stop generating)."""

    def __init__(self, names: set[str], parallel: bool = True, prefix: str = ""):
        self.names, self.parallel = set(names), parallel
        self.buffer = prefix  # undecided text
        self.calls: list[dict] = []
        self.done = False
        self._space = ""  # trailing whitespace held back: dropped if a call follows
        self._after_call = False

    def feed(self, text: str, final: bool = False) -> list[str | dict]:
        """New text (with `final`, the end of the answer): content strings and calls to send."""
        out: list[str | dict] = []
        if self.done:
            return out
        self.buffer += text
        items, used, ended = split_calls(self.buffer, self.names, final)
        self.buffer = self.buffer[used:]
        for item in items:
            if self.done:
                break
            if isinstance(item, str):
                self._content(item, out)
                continue
            name, arguments = item
            self._space = ""
            call = {"id": new_call_id(), "type": "function",
                    "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}  # fmt: skip
            self.calls.append(call)
            out.append(call)
            self._after_call = True
            self.done = not self.parallel
        if ended:
            self.done = True
        if (final or self.done) and self._space and not self.calls:
            out.append(self._space)
        if final or self.done:
            self._space, self.buffer = "", ""
        return out

    def _content(self, text: str, out: list) -> None:
        if self._after_call:
            text = text.lstrip(_SPACE)
            if not text:
                return
            self._after_call = False
        body = text.rstrip(_SPACE)
        if body:
            out.append(self._space + body)
            self._space = ""
        self._space += text[len(body) :]


def parse_tool_calls(text: str, names: set[str], parallel: bool = True, prefix: str = "") -> tuple[str | None, list[dict]]:
    """A whole answer as (content, tool_calls): content None when the answer is calls only."""
    parser = ToolCallParser(names, parallel, prefix)
    items = parser.feed(text, final=True)
    content = "".join(i for i in items if isinstance(i, str))
    return (content or None) if parser.calls else content, parser.calls
