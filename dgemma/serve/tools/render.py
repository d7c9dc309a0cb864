"""A chat with tools rendered for the chat template: tools declared, assistant tool calls and
tool results in the form the template takes, or, for a template that knows nothing of tools,
written into the messages as Gemma 4's blocks (syntax.py) the way its template lays them out.
"""

from __future__ import annotations

from dataclasses import dataclass

from .specs import ToolSpec, text_of
from .syntax import format_call, format_declaration, format_response


@dataclass
class ChatRender:
    """What the chat template gets, and the text that follows its generation prompt."""

    messages: list[dict]
    kwargs: dict  # extra template variables: {"tools": [...]} for a template that declares them
    suffix: str = ""  # appended after the rendered prompt: an open model turn (fallback), then `prefill`
    prefill: str = ""  # the start of the answer (tool_choice), which the output is parsed with


def template_mode(template: str | None) -> str:
    """ "gemma": the template declares tools and takes results as `tool_responses` on the assistant
    message (Gemma 4's); "openai": it declares tools and takes role "tool" messages; "fallback":
    it knows nothing of tools, so render_chat writes Gemma 4's blocks into the message content."""
    if not template or "tools" not in template:
        return "fallback"
    return "gemma" if "tool_responses" in template else "openai"


def join_contents(a: str | list, b: str | list) -> str | list:
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
                result = {"name": extra["name"], "response": text_of(m["content"])}
                last["tool_responses"] = [*last.get("tool_responses", []), result]
            elif "tool_call_id" in extra:
                out.append({**m, "content": text_of(m["content"]), **extra})
            else:
                out.append(m)
        return ChatRender(out, {"tools": spec.tools} if spec.active else {}, prefill, prefill)

    open_turn = False  # out[-1] is a model turn that ended with tool results
    for m, extra in zip(messages, extras):
        if "tool_call_id" in extra:  # out[-1] is the model turn with the calls (check_messages made sure)
            out[-1]["content"] = join_contents(
                out[-1]["content"], format_response(extra["name"], text_of(m["content"]))
            )
            open_turn = True
            continue
        calls = "".join(
            format_call(c["function"]["name"], c["function"]["arguments"]) for c in extra.get("tool_calls", [])
        )
        if m["role"] == "assistant" and open_turn:
            out[-1]["content"] = join_contents(out[-1]["content"], join_contents(_rstrip(m["content"]), calls))
        elif calls:
            out.append({**m, "content": join_contents(_rstrip(m["content"]), calls)})
        else:
            out.append(dict(m))
        open_turn = False
    if spec.active:
        decls = "".join(format_declaration(t) for t in spec.tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": join_contents(_rstrip(out[0]["content"]), decls)}
        else:
            out.insert(0, {"role": "system", "content": decls})
    suffix = ""
    if open_turn and len(out) > 1 and isinstance(out[-1]["content"], str):
        suffix = out.pop()["content"]
    return ChatRender(out, {}, suffix + prefill, prefill)
