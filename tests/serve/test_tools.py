"""Tool calling on /v1/chat/completions: Gemma 4's format rendered into the prompt, calls parsed
out of the answer, and the OpenAI shapes (tool_calls, finish_reason, streamed deltas), driven by
the official `openai` client. A random model never writes a call, so `FakeEngine` stands in for
the engine where a test needs one: it answers every request with fixed text, in blocks of 32
tokens, and keeps the prompts it was given."""

import json
import random

import openai
import pytest
from tool_fakes import TOOLS, WEATHER, FakeEngine  # the tools on offer; the engine's stand-in

from dgemma.inputs.tokenizer import Tokenizer
from dgemma.model.checkpoint import byte_tokenizer
from dgemma.serve.tools.calls import ToolCallParser, keeping_decoder, parse_tool_calls
from dgemma.serve.tools.render import render_chat
from dgemma.serve.tools.specs import ToolSpec, check_messages, tool_spec
from dgemma.serve.tools.syntax import QUOTE, format_call
from servers import MODEL  # conftest.py serves the tiny random `model` once a session: `server`, `client`

Q = QUOTE
NAMES = {"get_weather", "get_time"}
WEATHER_DECL = (
    f"<|tool>declaration:get_weather{{description:{Q}Current weather in a city{Q},parameters:{{properties:{{"
    f"city:{{description:{Q}City name{Q},type:{Q}STRING{Q}}},days:{{type:{Q}INTEGER{Q}}}}},"
    f"required:[{Q}city{Q}],type:{Q}OBJECT{Q}}}}}<tool|>"
)
TWO_CALLS = (
    f"I'll check both.\n<|tool_call>call:get_weather{{city:{Q}Paris{Q},days:2}}<tool_call|>\n"
    f"<|tool_call>call:get_time{{tz:{Q}Europe/Paris{Q}}}<tool_call|>"
)


# ------------------------------------------------------------------------------------ parsing
def test_parse_well_formed_call():
    content, calls = parse_tool_calls(f"<|tool_call>call:get_weather{{city:{Q}Paris{Q}}}<tool_call|>", NAMES)
    assert content is None and len(calls) == 1
    call = calls[0]
    assert call["type"] == "function" and call["id"].startswith("call_") and len(call["id"]) > 10
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_parse_two_parallel_calls_with_content():
    content, calls = parse_tool_calls(TWO_CALLS, NAMES)
    assert content == "I'll check both."  # whitespace next to the calls is dropped
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [
        {"city": "Paris", "days": 2},
        {"tz": "Europe/Paris"},
    ]
    assert len({c["id"] for c in calls}) == 2


@pytest.mark.parametrize(
    "text",
    [
        "<|tool_call>call:get_weather{city:Paris}<tool_call|>",  # a bare word is no value
        f"<|tool_call>call:get_weather{{city:{Q}Paris{Q},}}<tool_call|>",  # trailing comma
        f"<|tool_call>call:get_weather{{city:{Q}Paris{Q}}}",  # never closed
        f"<|tool_call>call:get_weather{{city:{Q}Paris}}<tool_call|>",  # unterminated string
        f"<|tool_call>get_weather{{city:{Q}Paris{Q}}}<tool_call|>",  # no "call:"
        f"<|tool_call>call:get_weather(city={Q}Paris{Q})<tool_call|>",
        f"<|tool_call>call:get_weather{{city:{Q}Paris{Q}}}<tool_call|",  # close marker cut short
        "<|tool_call>",
    ],
)
def test_malformed_call_stays_content(text):
    content, calls = parse_tool_calls("Here: " + text + " done", NAMES)
    assert calls == [] and content == "Here: " + text + " done"


def test_unknown_function_stays_content():
    text = f"<|tool_call>call:delete_everything{{path:{Q}/{Q}}}<tool_call|>"
    assert parse_tool_calls(text, NAMES) == (text, [])
    # ... while a known call next to it is still a call
    content, calls = parse_tool_calls(text + "<|tool_call>call:get_time{}<tool_call|>", NAMES)
    assert content == text and [c["function"]["name"] for c in calls] == ["get_time"]


ARGS = [
    {"city": "Paris"},
    {"query": 'he said "hi" and {left}', "path": "C:\\temp\\x.txt", "multi": "line one\nline two", "unicode": "日本 ✓"},
    {"n": -3, "x": 2.5e-3, "ok": True, "no": False, "none": None, "empty": "", "list": [], "obj": {}},
    {"outer": {"inner": {"deep": [1, {"k": "v"}, [True, None]]}, "tags": ["a", "b, c", "]"]}},
]


@pytest.mark.parametrize("args", ARGS)
def test_arguments_json_round_trip(args):
    """What the server renders for an assistant's call (format_call) parses back to the same JSON."""
    text = format_call("get_weather", args)
    assert text.startswith("<|tool_call>call:get_weather{") and text.endswith("}<tool_call|>")
    content, calls = parse_tool_calls(text, NAMES)
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == args


def test_json_style_strings_and_keys_are_read_too():
    text = '<|tool_call>call:get_weather{"city": "Par\\"is", days : 3}<tool_call|>'
    _, calls = parse_tool_calls(text, NAMES)
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": 'Par"is', "days": 3}


@pytest.mark.parametrize("seed", range(5))
def test_streaming_parser_matches_whole_text(seed):
    """Fed in any pieces, the parser gives the same content and calls as for the whole text, and
    never sends call syntax as content."""
    rng = random.Random(seed)
    text = TWO_CALLS + " and then <|tool_call>call:nope{}<tool_call|> trailing <|tool_ca"
    whole_content, whole_calls = parse_tool_calls(text, NAMES)
    parser = ToolCallParser(NAMES)
    items, i = [], 0
    while i < len(text):
        n = rng.randint(1, 12)
        items += parser.feed(text[i : i + n])
        i += n
    items += parser.feed("", final=True)
    content = "".join(x for x in items if isinstance(x, str))
    calls = [x for x in items if isinstance(x, dict)]
    assert content == whole_content and "call:get_" not in content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole_calls
    ]


def test_content_streams_before_a_call_closes():
    parser = ToolCallParser(NAMES)
    assert parser.feed("Let me look <|tool_") == ["Let me look"]  # the marker's start is held back
    assert parser.feed(f"call>call:get_time{{tz:{Q}UTC") == []  # inside a call: nothing yet
    (call,) = parser.feed(f"{Q}}}<tool_call|>")
    assert call["function"]["name"] == "get_time" and parser.feed("", final=True) == []


def test_no_parallel_calls_keeps_the_first_and_ends_the_answer():
    parser = ToolCallParser(NAMES, parallel=False)
    items = parser.feed(TWO_CALLS)
    assert [x["function"]["name"] for x in items if isinstance(x, dict)] == ["get_weather"] and parser.done


def test_tool_response_marker_ends_the_answer():
    text = f"<|tool_call>call:get_time{{}}<tool_call|><|tool_response>response:get_time{{value:{Q}noon{Q}}}<tool_response|>More"
    content, calls = parse_tool_calls(text, NAMES)
    assert content is None and len(calls) == 1


def test_text_without_calls_is_untouched():
    text = "  plain answer, with <b>tags</b> and {braces}\n\n"
    assert parse_tool_calls(text, NAMES) == (text, [])


def test_decoder_keeps_the_tool_tokens():
    """Gemma 4's tokenizer marks <|tool_call>, <tool_call|> and <|"|> special; plain decoding drops
    them, the tool decoder keeps them (and drops the other special tokens as before)."""
    hf = byte_tokenizer()
    hf.add_special_tokens(["<|tool_call>", "<tool_call|>", Q, "<|tool_response>"])
    tok = Tokenizer(hf)
    text = f"Sure<|tool_call>call:get_time{{tz:{Q}UTC{Q}}}<tool_call|><eos>"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == "Surecall:get_time{tz:UTC}"
    assert keeping_decoder(tok)(ids) == text.removesuffix("<eos>")
    assert keeping_decoder(Tokenizer(byte_tokenizer())).__name__ == "decode"  # nothing to keep: plain decode


# ------------------------------------------------------------------------------------ rendering
def _render(tok, messages, spec, **kwargs):
    """The prompt text the server builds (chat_prompt, without tokenizing)."""
    extras = check_messages(messages)
    plain = [{"role": m["role"], "content": m.get("content") or ""} for m in messages]
    chat = render_chat(plain, extras, spec, tok.chat_template)
    return tok.render_chat(chat.messages, **chat.kwargs) + chat.suffix


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]


def test_fallback_rendering_is_gemma4_format(model):  # noqa: F811
    """The tiny model's template knows nothing of tools: dgemma writes Gemma 4's blocks itself."""
    tok = model.tokenizer
    spec = tool_spec([WEATHER])
    assert _render(tok, HISTORY[:2], spec) == (
        f"<bos><|turn>system\nBe brief.{WEATHER_DECL}<turn|>\n<|turn>user\nWeather in Paris?<turn|>\n<|turn>model\n"
    )
    # results go into the model turn after its call, which stays open for the answer
    call = f"<|tool_call>call:get_weather{{city:{Q}Paris{Q}}}<tool_call|>"
    result = f"<|tool_response>response:get_weather{{value:{Q}sunny, 21 C{Q}}}<tool_response|>"
    assert _render(tok, HISTORY, spec).endswith(f"<|turn>user\nWeather in Paris?<turn|>\n<|turn>model\n{call}{result}")
    # the answer after the results goes on in the same turn; the next user message opens a new one
    later = HISTORY + [{"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Thanks"}]
    assert _render(tok, later, spec).endswith(
        f"<|turn>model\n{call}{result}Sunny.<turn|>\n<|turn>user\nThanks<turn|>\n<|turn>model\n"
    )
    # no system message: one is added for the declarations; tool_choice "none": none declared
    assert _render(tok, HISTORY[1:2], spec).startswith(f"<bos><|turn>system\n{WEATHER_DECL}<turn|>\n<|turn>user\n")
    assert "<|tool>" not in _render(tok, HISTORY, tool_spec([WEATHER], "none"))
    # without tools at all the prompt is what it always was
    assert _render(tok, HISTORY[:2], ToolSpec()) == tok.render_chat(
        [{"role": m["role"], "content": m["content"]} for m in HISTORY[:2]]
    )


# A compact Gemma-4-style template that handles tools itself (written for this test): declarations
# in the system turn, calls from tool_calls, results from tool_responses.
NATIVE_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools or messages[0]['role'] == 'system' -%}"
    "{{ '<|turn>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' -%}{{ messages[0]['content'] | trim }}{%- endif -%}"
    "{%- for tool in tools or [] -%}"
    "{{ '<|tool>declaration:' + tool['function']['name'] + '{description:<|\"|>' + tool['function']['description'] + '<|\"|>}<tool|>' }}"
    "{%- endfor -%}"
    "{{ '<turn|>\\n' }}"
    "{%- endif -%}"
    "{%- set ns = namespace(open=false) -%}"
    "{%- for m in messages if m['role'] != 'system' -%}"
    "{{ '<|turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\\n' }}"
    "{%- for c in m['tool_calls'] or [] -%}"
    "{{ '<|tool_call>call:' + c['function']['name'] + '{' }}"
    "{%- for k, v in c['function']['arguments'] | dictsort -%}{{ k + ':<|\"|>' + v + '<|\"|>' }}{{ ',' if not loop.last }}{%- endfor -%}"
    "{{ '}<tool_call|>' }}"
    "{%- endfor -%}"
    "{%- for r in m['tool_responses'] or [] -%}"
    "{{ '<|tool_response>response:' + r['name'] + '{value:<|\"|>' + r['response'] + '<|\"|>}<tool_response|>' }}"
    "{%- endfor -%}"
    "{{ m['content'] | trim }}"
    "{%- set ns.open = (m['tool_responses'] or []) | length > 0 and not m['content'] -%}"
    "{%- if not ns.open -%}{{ '<turn|>\\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt and not ns.open -%}{{ '<|turn>model\\n' }}{%- endif -%}"
)


def test_native_template_gets_tools_and_results(model, monkeypatch):  # noqa: F811
    """A template that handles tools is given them (and results as tool_responses), not dgemma's text."""
    tok = model.tokenizer
    monkeypatch.setattr(tok, "chat_template", NATIVE_TEMPLATE)
    text = _render(tok, HISTORY, tool_spec([WEATHER]))
    assert text == (
        f"<bos><|turn>system\nBe brief.<|tool>declaration:get_weather{{description:{Q}Current weather in a city{Q}}}<tool|><turn|>\n"
        f"<|turn>user\nWeather in Paris?<turn|>\n<|turn>model\n<|tool_call>call:get_weather{{city:{Q}Paris{Q}}}<tool_call|>"
        f"<|tool_response>response:get_weather{{value:{Q}sunny, 21 C{Q}}}<tool_response|>"
    )
    # tool_choice naming a function: the answer is made to start with that call's opening
    assert _render(
        tok, HISTORY[:2], tool_spec([WEATHER], {"type": "function", "function": {"name": "get_weather"}})
    ).endswith("<|turn>model\n<|tool_call>call:get_weather{")


# ------------------------------------------------------------------------------------ the server
@pytest.fixture
def fake(server, model, monkeypatch):  # noqa: F811
    engine = FakeEngine(model.tokenizer, model.generation_config.eos_token_ids[0])
    monkeypatch.setattr(server.app.state.service.engine_thread, "submit", engine)
    return engine


USER = [{"role": "user", "content": "Weather and time in Paris?"}]


def bad(**fields):
    return {"messages": USER, **fields}


BAD = [
    ("tools not a list", bad(tools={"type": "function"}), "tools", "tools must be a list"),
    ("unknown tool type", bad(tools=[{"type": "code_interpreter"}]), "tools[0].type", "must be 'function'"),
    ("missing function", bad(tools=[{"type": "function"}]), "tools[0].function", "must be an object"),
    (
        "missing name",
        bad(tools=[{"type": "function", "function": {"description": "x"}}]),
        "tools[0].function.name",
        "missing",
    ),
    (
        "bad name",
        bad(tools=[{"type": "function", "function": {"name": "get weather"}}]),
        "tools[0].function.name",
        "letters, digits",
    ),
    (
        "parameters not an object",
        bad(tools=[{"type": "function", "function": {"name": "f", "parameters": [1]}}]),
        "tools[0].function.parameters",
        "JSON Schema object",
    ),
    (
        "parameters of type string",
        bad(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]),
        "tools[0].function.parameters",
        "JSON Schema object",
    ),
    (
        "properties not schemas",
        bad(
            tools=[
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": 1}}},
                }
            ]
        ),
        "tools[0].function.parameters.properties",
        "schema object",
    ),
    ("duplicate names", bad(tools=[WEATHER, WEATHER]), "tools[1].function.name", "unique"),
    ("unknown tool field", bad(tools=[{**WEATHER, "strictness": 1}]), "tools[0].strictness", "unknown field"),
    (
        "tool_choice unknown function",
        bad(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "send_email"}}),
        "tool_choice.function.name",
        "not in tools",
    ),
    ("tool_choice bad string", bad(tools=TOOLS, tool_choice="always"), "tool_choice", "tool_choice must be"),
    (
        "tool_choice bad object",
        bad(tools=TOOLS, tool_choice={"type": "function"}),
        "tool_choice.function",
        "tool_choice must be",
    ),
    ("tool_choice required without tools", bad(tool_choice="required"), "tool_choice", "needs tools"),
    (
        "user message without content",
        {"messages": [{"role": "system", "content": "hi"}, {"role": "user"}]},
        "messages[1].content",
        "messages[1] (role 'user') has no content",
    ),
    (
        "system message without content",
        {"messages": [{"role": "system", "content": None}, *USER]},
        "messages[0].content",
        "messages[0] (role 'system') has no content",
    ),
    ("empty content list", {"messages": [{"role": "user", "content": []}]}, "messages[0].content", "has no content"),
    (
        "assistant without content or calls",
        {"messages": [*USER, {"role": "assistant"}, *USER]},
        "messages[1].content",
        "neither",
    ),
    (
        "tool message without tool_call_id",
        {"messages": [*USER, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "content": "sunny"}]},
        "messages[2].tool_call_id",
        "needs a tool_call_id",
    ),
    (
        "tool message after no call",
        {"messages": [*USER, {"role": "tool", "tool_call_id": "call_1", "content": "x"}]},
        "messages[1]",
        "must follow an assistant message with tool_calls",
    ),
    (
        "tool_call_id of no call",
        {
            "messages": [
                *USER,
                {"role": "assistant", "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_9", "content": "x"},
            ]
        },
        "messages[2].tool_call_id",
        "is not the id",
    ),
    (
        "tool message without content",
        {"messages": [*USER, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": "call_1"}]},
        "messages[2].content",
        "needs content",
    ),
    (
        "malformed assistant call",
        {
            "messages": [
                *USER,
                {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f"}}]},
                *USER,
            ]
        },
        "messages[1].tool_calls[0].function",
        "arguments",
    ),
    (
        "tool_calls on a user message",
        {"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]},
        "messages[0].tool_calls",
        "only assistant messages",
    ),
]


@pytest.mark.parametrize("name,body,param,words", BAD, ids=[b[0] for b in BAD])
def test_bad_tool_requests_get_a_400_naming_the_problem(client, name, body, param, words):  # noqa: F811
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, max_tokens=8, **body)
    assert words in e.value.message and e.value.param == param, e.value.body


@pytest.mark.slow
def test_server_lives_on_after_bad_tool_requests(client):  # noqa: F811
    for _, body, _, _ in BAD:
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL, max_tokens=8, **body)
    r = client.chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, max_tokens=32, extra_body={"max_denoising_steps": 2}
    )
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")  # the real (random) engine ran


def test_prompt_holds_gemma4_declarations(client, fake):  # noqa: F811
    fake.text = "Hello."
    client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER], max_tokens=64)
    assert (
        fake.prompts[-1]
        == f"<bos><|turn>system\n{WEATHER_DECL}<turn|>\n<|turn>user\n{USER[0]['content']}<turn|>\n<|turn>model\n"
    )
    client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER], tool_choice="none", max_tokens=64)
    assert "<|tool>" not in fake.prompts[-1]
    # tool_choice "required" / a named function: the answer is made to start with a call's opening
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required", max_tokens=64)
    assert fake.prompts[-1].endswith("<|turn>model\n<|tool_call>call:")
    assert r.choices[0].message.content == "<|tool_call>call:Hello."  # the model did not go on with a call: content
    fake.text = f"tz:{Q}UTC{Q}}}<tool_call|>"
    r = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        tools=TOOLS,
        max_tokens=64,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    assert fake.prompts[-1].endswith("<|turn>model\n<|tool_call>call:get_time{")
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments) == {"tz": "UTC"}
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None


def test_tool_calls_in_the_answer(client, fake):  # noqa: F811
    fake.text = TWO_CALLS
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, max_tokens=256)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "I'll check both."
    calls = choice.message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Paris", "days": 2}, {"tz": "Europe/Paris"}]
    assert all(c.type == "function" and c.id.startswith("call_") for c in calls)
    # without tools (or with tool_choice "none") nothing is parsed
    for extra in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=256, **extra)
        assert r.choices[0].message.content == TWO_CALLS and not r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "stop"
    # parallel_tool_calls false: the first call only
    r = client.chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, max_tokens=256, parallel_tool_calls=False
    )
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]
    assert r.choices[0].finish_reason == "tool_calls"


def test_malformed_or_unknown_call_from_the_model_is_content(client, fake):  # noqa: F811
    for text in (
        "<|tool_call>call:get_weather{city:Paris}<tool_call|>",
        f"<|tool_call>call:rm{{path:{Q}/{Q}}}<tool_call|>",
    ):
        fake.text = text
        r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, max_tokens=256)
        assert r.choices[0].message.content == text and not r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "stop"


def test_streamed_tool_call_deltas(client, fake):  # noqa: F811
    fake.text = TWO_CALLS  # 150-odd byte tokens: the calls straddle blocks of 32
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=USER, tools=TOOLS, max_tokens=256, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    content = "".join(d.content or "" for d in deltas)
    assert content == "I'll check both." and "<|tool_call>" not in content and "call:" not in content
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert [(tc.index, tc.type, tc.function.name) for tc in calls] == [
        (0, "function", "get_weather"),
        (1, "function", "get_time"),
    ]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "days": 2} and calls[0].id.startswith("call_")
    # a call's delta comes once its block committed, before the stream ends
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert (
        len(finish) == 1
        and finish[0].choices[0].finish_reason == "tool_calls"
        and chunks[-1].usage.completion_tokens > 0
    )
    # both calls in one committed block: one delta each, indexed in order
    fake.block = 1024
    chunks = list(client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, max_tokens=256, stream=True))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(tc.index, tc.function.name) for tc in calls] == [(0, "get_weather"), (1, "get_time")]
    # the openai client's stream helper puts the message back together
    with client.chat.completions.stream(model=MODEL, messages=USER, tools=TOOLS, max_tokens=256) as stream:
        final = stream.get_final_completion()
    message = final.choices[0].message
    assert message.content == "I'll check both." and [c.function.name for c in message.tool_calls] == [
        "get_weather",
        "get_time",
    ]


def test_round_trip_with_tool_messages(client, fake):  # noqa: F811
    """Call, result, answer: the assistant message the server returned goes back with the tool's
    result, rendered in the same model turn, and the model's next answer is plain content."""
    fake.text = f"<|tool_call>call:get_weather{{city:{Q}Paris{Q}}}<tool_call|>"
    first = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, max_tokens=256)
    message = first.choices[0].message
    (call,) = message.tool_calls
    messages = [*USER, message, {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear", "temp": 21}'}]
    fake.text = "Clear and 21 degrees."
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=256)
    assert second.choices[0].message.content == "Clear and 21 degrees." and second.choices[0].finish_reason == "stop"
    assert fake.prompts[-1].endswith(
        f"<|turn>user\n{USER[0]['content']}<turn|>\n<|turn>model\n<|tool_call>call:get_weather{{city:{Q}Paris{Q}}}<tool_call|>"
        f'<|tool_response>response:get_weather{{value:{Q}{{"sky": "clear", "temp": 21}}{Q}}}<tool_response|>'
    )
    # the whole exchange, then a new question
    messages += [second.choices[0].message, {"role": "user", "content": "And tomorrow?"}]
    client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=256)
    assert fake.prompts[-1].endswith(
        "<tool_response|>Clear and 21 degrees.<turn|>\n<|turn>user\nAnd tomorrow?<turn|>\n<|turn>model\n"
    )


# ------------------------------------------------------------------------------------ forced calls, enforced
# The random model writes noise; with tool_choice naming a function (or "required") the call's
# grammar (serve/tools/grammar.py) makes it a call all the same, with arguments of its schema.
FORECAST = {
    "type": "function",
    "function": {
        "name": "forecast",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "hours": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 23}, "maxItems": 3},
                "alerts": {"type": "object", "properties": {"wind": {"type": "boolean"}}, "required": ["wind"]},
            },
            "required": ["city", "days", "unit"],
        },
    },
}
ENFORCED = {"max_denoising_steps": 4}
# a random model's unbounded strings run past max_tokens: the schemas bound them
ZONE = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 8}}},
    },
}


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_named_tool_choice_is_a_valid_call(client, seed):  # noqa: F811
    import jsonschema

    choice = {"type": "function", "function": {"name": "forecast"}}
    r = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        tools=[FORECAST, ZONE],
        tool_choice=choice,
        max_tokens=256,
        seed=seed,
        extra_body=ENFORCED,
    )
    again = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        tools=[FORECAST, ZONE],
        tool_choice=choice,
        max_tokens=256,
        seed=seed,
        extra_body=ENFORCED,
    )
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "forecast"
    jsonschema.validate(json.loads(call.function.arguments), FORECAST["function"]["parameters"])
    assert again.choices[0].message.tool_calls[0].function.arguments == call.function.arguments  # deterministic


def test_required_tool_choice_calls_one_of_the_tools(client):  # noqa: F811
    r = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        tools=[FORECAST, ZONE],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=256,
        seed=4,
        extra_body=ENFORCED,
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name in ("forecast", "get_time") and isinstance(json.loads(call.function.arguments), dict)


def test_forced_call_streams_and_round_trips(client):  # noqa: F811
    choice = {"type": "function", "function": {"name": "forecast"}}
    stream = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        tools=[FORECAST],
        tool_choice=choice,
        max_tokens=256,
        seed=5,
        stream=True,
        extra_body=ENFORCED,
    )
    chunks = [c for c in stream if c.choices]
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert (
        len(deltas) == 1
        and deltas[0].function.name == "forecast"
        and chunks[-1].choices[0].finish_reason == "tool_calls"
    )
    call = {
        "id": deltas[0].id,
        "type": "function",
        "function": {"name": "forecast", "arguments": deltas[0].function.arguments},
    }
    messages = [
        *USER,
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "rain"},
    ]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[FORECAST], max_tokens=32, seed=5, extra_body=ENFORCED
    )
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_forced_call_with_an_unsupported_schema_is_a_400(client):  # noqa: F811
    tool = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"$ref": "#/x"}}}},
    }
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=USER, tools=[tool], tool_choice="required")
    assert e.value.body["param"] == "tool_choice" and "'$ref'" in e.value.body["message"]


def _accepts(spec, text):
    import llguidance

    from dgemma.serve.tools.grammar import lark_string, tool_call_grammar

    tok = llguidance.LLTokenizer(byte_tokenizer().to_str(), n_vocab=384, eos_token=[1])
    matcher = llguidance.LLMatcher(
        tok, llguidance.LLMatcher.grammar_from_lark(tool_call_grammar(spec, lark_string)), log_level=0
    )
    ids = tok.tokenize_str(text)
    return matcher.validate_tokens(ids) == len(ids) and (matcher.consume_tokens(ids) and matcher.is_accepting())


NAMED = tool_spec([FORECAST, ZONE], {"type": "function", "function": {"name": "forecast"}})
CALL_TEXTS = [
    (NAMED, f"city:{Q}Oslo{Q},days:3,unit:{Q}celsius{Q}}}<tool_call|>", True),
    (NAMED, f"city:{Q}Oslo{Q},days:3,unit:{Q}celsius{Q},hours:[1,23],alerts:{{wind:false}}}}<tool_call|>", True),
    (NAMED, f"city:{Q}Oslo{Q},unit:{Q}celsius{Q}}}<tool_call|>", False),  # required days missing
    (NAMED, f"city:{Q}Oslo{Q},days:8,unit:{Q}celsius{Q}}}<tool_call|>", False),  # days > maximum
    (NAMED, f"city:{Q}Oslo{Q},days:3,unit:{Q}kelvin{Q}}}<tool_call|>", False),  # not in the enum
    (NAMED, f"city:{Q}Oslo{Q},days:3,unit:{Q}celsius{Q},hours:[1,2,3,4]}}<tool_call|>", False),  # maxItems
    (NAMED, f"city:{Q}Oslo{Q},days:3,unit:{Q}celsius{Q},alerts:{{}}}}<tool_call|>", False),  # required wind
    (
        tool_spec([FORECAST, ZONE], "required"),
        f"get_time{{}}<tool_call|>\n<|tool_call>call:get_time{{tz:{Q}UTC{Q}}}<tool_call|>",
        True,
    ),
    (
        tool_spec([FORECAST, ZONE], "required", False),
        "get_time{}<tool_call|><|tool_call>call:get_time{}<tool_call|>",
        False,
    ),
    (tool_spec([FORECAST, ZONE], "required"), "send_email{}<tool_call|>", False),  # not a tool
]


@pytest.mark.parametrize("spec, text, ok", CALL_TEXTS)
def test_forced_call_grammar(spec, text, ok):
    assert _accepts(spec, text) == ok


# The call grammar joins properties in a balanced tree (log2(n) rules deep, not one rule chained per
# property: llguidance compiles reference chains recursively, and a few thousand overflow its stack).
def _members(names) -> str:
    return ",".join(f"{n}:1" for n in names) + "}<tool_call|>"


def _forced(properties: dict, required: list[str]):
    tool = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": properties, "required": required}},
    }
    return tool_spec([tool], {"type": "function", "function": {"name": "f"}})


@pytest.mark.slow
def test_forced_call_grammar_keeps_order_and_required_members():
    """Every subset of five properties, in declared order: accepted exactly when it holds the
    required ones; out of order or repeated: rejected (the language of the chained grammar)."""
    import itertools

    names = ["a", "b", "c", "d", "e"]
    for required in (["a", "c"], [], ["e"], names, ["b", "d"]):
        spec = _forced({n: {"type": "integer"} for n in names}, required)
        for k in range(len(names) + 1):
            for subset in itertools.combinations(names, k):
                assert _accepts(spec, _members(subset)) == (set(required) <= set(subset)), (required, subset)
        assert not _accepts(spec, _members(["c", "a", "b", "d", "e"]))
        assert not _accepts(spec, _members(["a", "a", "b", "c", "d", "e"]))


@pytest.mark.slow
def test_forced_call_grammar_with_thousands_of_properties():
    from dgemma.serve.structured.limits import lark_stats
    from dgemma.serve.tools.grammar import lark_string, tool_call_grammar

    names = [f"p{i}" for i in range(3000)]
    spec = _forced({n: {"type": "integer"} for n in names}, names[::2])
    assert lark_stats(tool_call_grammar(spec, lark_string)).depth < 40  # about 2 log2(3000), not 3000
    assert _accepts(spec, _members(names[::2]))
    assert _accepts(spec, _members(names[::2][:-1] + names[-2:]))
    assert not _accepts(spec, _members(names[::2][1:]))  # the first required one left out


def test_tool_schemas_over_the_limits_are_refused():
    from dgemma.serve.structured.limits import MAX_TOOL_DEPTH, MAX_TOOL_PROPERTIES
    from dgemma.serve.tools.specs import ToolError

    deep: dict = {"type": "string"}
    for _ in range(MAX_TOOL_DEPTH):
        deep = {"type": "object", "properties": {"a": deep}}
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(MAX_TOOL_PROPERTIES + 1)}}
    lone = {"type": "object", "properties": {"a": {"type": "string", "pattern": "\ud800"}}}
    for params, words in ((deep, "levels of nesting"), (wide, "properties"), (lone, "lone surrogate")):
        tool = {"type": "function", "function": {"name": "f", "parameters": params}}
        with pytest.raises(ToolError, match=words) as e:
            tool_spec([tool], "required")
        assert e.value.param == "tools[0].function.parameters" and "tools[0].function.parameters" in str(e.value)
    with pytest.raises(ToolError, match="lone surrogate"):
        tool_spec([{"type": "function", "function": {"name": "f", "description": "x\udfff"}}])


def test_lark_regex_escapes_what_would_end_the_literal():
    from dgemma.serve.tools.grammar import lark_regex

    assert lark_regex("a/b") == "a\\/b" and lark_regex("a\\/b") == "a\\/b" and lark_regex("a\nb") == "a\\nb"
    spec = _forced({"u": {"type": "string", "pattern": "^[a-z]+/[a-z]+$"}}, ["u"])
    assert _accepts(spec, f"u:{Q}a/b{Q}}}<tool_call|>") and not _accepts(spec, f"u:{Q}ab{Q}}}<tool_call|>")
