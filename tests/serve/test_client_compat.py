"""Client compatibility and thinking on /v1/chat/completions.

Request bodies that LangChain's ChatOpenAI and LiteLLM send (recorded from the libraries into
fixtures/client_bodies.json; the file says which versions) are posted as they are; each newer
OpenAI / vLLM field is accepted, ignored or refused with a 400 naming it; Gemma 4's thinking is
switched on in the prompt and its thought channel comes back as `reasoning_content`, whole and
streamed. A random model never thinks or calls tools, so most requests here are answered by
`FakeEngine` (tests/serve/tool_fakes.py: fixed text, in blocks of 32 tokens)."""

import json
import random
from pathlib import Path

import httpx
import pytest
from tool_fakes import TOOLS, FakeEngine

from dgemma.serve.reasoning import (
    CHANNEL,
    CHANNEL_END,
    THINK,
    ReasoningParser,
    Thought,
    keeping_channel,
    split_reasoning,
)
from dgemma.serve.tools.syntax import QUOTE as Q
from servers import MODEL  # conftest.py serves the tiny random `model` once a session: `server`, `client`

RECORDED = json.loads((Path(__file__).parent / "fixtures" / "client_bodies.json").read_text())
USER = [{"role": "user", "content": "What is 2+2?"}]
THOUGHT = f"{CHANNEL}thought\nThe user asks 2+2. That is 4.\n{CHANNEL_END}\nThe answer is 4."


class Fake(FakeEngine):
    """FakeEngine taking whatever else the server passes the engine (constraints, ...)."""

    def __call__(self, prompt, config, seed, drafts=False, images=(), **_):
        return super().__call__(prompt, config, seed, drafts, images)


@pytest.fixture
def fake(server, model, monkeypatch):  # noqa: F811
    engine = Fake(model.tokenizer, model.generation_config.eos_token_ids[0])
    engine.text = "The answer is 4."
    monkeypatch.setattr(server.app.state.service.engine_thread, "submit", engine)
    return engine


def post(server, body, path="/v1/chat/completions"):  # noqa: F811
    return httpx.post(server.url + path, json=body, timeout=60)


def chat(server, **fields):  # noqa: F811
    return post(server, {"model": MODEL, "messages": USER, "max_tokens": 64, **fields})


def sse(response) -> list[dict]:
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


# ------------------------------------------------------------------------------------ recorded client bodies
def _answer_for(body) -> str:
    """What the fake model writes for a recorded body: a call when tools are on offer (the rest of
    one when tool_choice names the function: its opening is in the prompt), else a plain answer,
    after a thought when the body asks for thinking."""
    if isinstance(body.get("tool_choice"), dict):
        name = body["tool_choice"]["function"]["name"]
        return f"answer:{Q}4{Q},confidence:0.9}}<tool_call|>" if name == "Answer" else f"city:{Q}Paris{Q}}}<tool_call|>"
    if body.get("tools") and body["messages"][-1]["role"] != "tool":
        return f"<|tool_call>call:weather{{city:{Q}Paris{Q}}}<tool_call|>"
    thinks = body.get("reasoning_effort") or body.get("chat_template_kwargs", {}).get("enable_thinking")
    return THOUGHT if thinks else "The answer is 4."


@pytest.mark.parametrize("record", RECORDED["records"], ids=lambda r: f"{r['library']}-{r['case']}")
def test_recorded_client_bodies(server, fake, record):  # noqa: F811
    body = record["body"]
    fake.text = _answer_for(body)
    r = post(server, body)
    assert r.status_code == 200, r.text
    thinks = fake.text == THOUGHT
    assert (THINK in fake.prompts[-1]) == thinks
    if body.get("stream"):
        chunks = sse(r)
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        content = "".join(d.get("content") or "" for d in deltas)
        reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
        calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
        assert (chunks[-1].get("usage") is not None) == bool((body.get("stream_options") or {}).get("include_usage"))
    else:
        choice = r.json()["choices"][0]
        message, finish = choice["message"], [choice["finish_reason"]]
        content, calls, reasoning = (
            message["content"],
            message.get("tool_calls") or [],
            message.get("reasoning_content") or "",
        )
        assert r.json()["usage"]["completion_tokens"] > 0
    if calls:
        assert finish == ["tool_calls"] and len(calls) == 1 and calls[0]["id"].startswith("call_")
        assert json.loads(calls[0]["function"]["arguments"]) in ({"city": "Paris"}, {"answer": "4", "confidence": 0.9})
        assert not content
    else:
        assert finish == ["stop"] and content == "The answer is 4."
        assert reasoning == ("The user asks 2+2. That is 4." if thinks else "")


@pytest.mark.parametrize("case", ["langchain-stream_usage", "litellm-completion_options"])
def test_recorded_bodies_on_the_engine(server, case):  # noqa: F811
    """Two of the recorded bodies against the real (random) model: the engine path takes them too."""
    (body,) = [r["body"] for r in RECORDED["records"] if f"{r['library']}-{r['case']}" == case]
    body = {**body, "max_denoising_steps": 4}
    r = post(server, body)
    assert r.status_code == 200, r.text
    usage = sse(r)[-1]["usage"] if body.get("stream") else r.json()["usage"]
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] <= 64


# ------------------------------------------------------------------------------------ newer fields
ACCEPTED = [
    {"stream_options": {"include_usage": True, "include_obfuscation": False}, "stream": True},
    {"metadata": {"session": "s-1", "k" * 64: "v" * 512}},
    {"store": True},
    {"store": False},
    {"reasoning_effort": "none"},
    {"verbosity": "low"},
    {"modalities": ["text"]},
    {"prediction": {"type": "content", "content": "The answer is 4."}},
    {"prediction": {"type": "content", "content": [{"type": "text", "text": "The answer"}]}},
    {"audio": None, "web_search_options": None, "moderation": None, "functions": None, "function_call": None},
    {"safety_identifier": "user-hash", "prompt_cache_key": "chat-7", "user": "u-1"},
    {"prompt_cache_retention": "24h", "prompt_cache_options": {"mode": "explicit", "ttl": "30m"}},
    {"top_k": -1, "min_p": 0, "repetition_penalty": 1},
    {"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0},
    {"chat_template_kwargs": {"custom_flag": True, "enable_thinking": False}},
    {
        "messages": [
            *USER,
            {
                "role": "assistant",
                "content": "4",
                "reasoning_content": "2+2",
                "reasoning": None,
                "refusal": None,
                "function_call": None,
                "audio": None,
            },
            {"role": "user", "content": "Sure?"},
        ]
    },
]


@pytest.mark.parametrize("fields", ACCEPTED, ids=lambda f: ",".join(f))
def test_accepted_fields(server, fake, fields):  # noqa: F811
    r = chat(server, **fields)
    assert r.status_code == 200, r.text
    if fields.get("stream"):
        assert sse(r)[-1]["usage"]["completion_tokens"] > 0
    else:
        assert r.json()["choices"][0]["message"]["content"] == "The answer is 4."
        assert "reasoning_content" not in r.json()["choices"][0]["message"]  # no thinking asked for


@pytest.mark.parametrize("tier", ["auto", "default", "flex", "scale", "priority", "fast"])
def test_service_tier_is_served_at_the_one_tier(server, fake, tier):  # noqa: F811
    assert chat(server, service_tier=tier).json()["service_tier"] == "default"
    chunks = sse(chat(server, service_tier=tier, stream=True))
    assert {c["service_tier"] for c in chunks} == {"default"}
    assert "service_tier" not in chat(server).json()  # not sent: not reported


REFUSED = [
    ({"modalities": ["text", "audio"]}, "modalities", "only text output"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio", "audio output is not supported"),
    ({"web_search_options": {}}, "web_search_options", "web search"),
    ({"moderation": {"model": "omni-moderation-latest"}}, "moderation", "moderation"),
    ({"functions": [{"name": "f", "parameters": {"type": "object"}}]}, "functions", "send tools"),
    ({"function_call": "auto"}, "function_call", "send tool_choice"),
    ({"top_k": 40}, "top_k", "top-k truncation is not supported"),
    ({"min_p": 0.05}, "min_p", "min-p truncation is not supported"),
    ({"repetition_penalty": 1.1}, "repetition_penalty", "repetition penalties are not supported"),
    ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    ({"service_tier": "turbo"}, "service_tier", "'auto', 'default'"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort", "'none', 'minimal'"),
    ({"verbosity": "max"}, "verbosity", "'low', 'medium' or 'high'"),
    ({"store": "yes"}, "store", "valid boolean"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "at most 16 items"),
    ({"metadata": {"k": "v" * 513}}, "metadata", "values at most 512"),
    ({"metadata": {"k": 1}}, "metadata.k", "valid string"),
    ({"prediction": {"type": "diff", "content": "x"}}, "prediction.type", "'content'"),
    ({"prediction": {"type": "content"}}, "prediction.content", "missing"),
    ({"safety_identifier": "x" * 65}, "safety_identifier", "at most 64 characters"),
    ({"prompt_cache_retention": "forever"}, "prompt_cache_retention", "'in_memory' or '24h'"),
    (
        {"stream_options": {"include_obfuscation": "no"}, "stream": True},
        "stream_options.include_obfuscation",
        "boolean",
    ),
    ({"stream_options": {"include_usage": True}}, "stream_options", "needs stream: true"),
    ({"chat_template_kwargs": {"enable_thinking": "yes"}}, "chat_template_kwargs.enable_thinking", "must be a boolean"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages", "set by the server"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools", "set by the server"),
    ({"chat_template_kwargs": {"not a name": 1}}, "chat_template_kwargs.not a name", "not a template variable"),
    (
        {"chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "high"},
        "reasoning_effort",
        "contradicts",
    ),
    (
        {
            "messages": [
                *USER,
                {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
            ]
        },
        "messages[1].function_call",
        "send tool_calls",
    ),
    (
        {"messages": [{"role": "user", "content": "hi", "reasoning_content": "hm"}]},
        "messages[0].reasoning_content",
        "only assistant messages",
    ),
    ({"messages": [*USER, {"role": "assistant", "content": "4", "audio": {"id": "a1"}}]}, "messages[1].audio", "audio"),
    ({"guided_nonsense": 1}, "guided_nonsense", "unknown field"),
]


@pytest.mark.parametrize("fields,param,text", REFUSED, ids=[r[1] + "-" + json.dumps(r[0])[:30] for r in REFUSED])
def test_refused_fields(server, fake, fields, param, text):  # noqa: F811
    r = chat(server, **fields)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and text in error["message"] and param.split(".")[0] in error["message"]


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"metadata": {"a": "b"}}, "metadata"),
        ({"reasoning_effort": "low"}, "reasoning_effort"),
        ({"top_k": 3}, "top_k"),
    ],
)
def test_completions_endpoint_takes_only_its_fields(server, fake, fields, param):  # noqa: F811
    """The legacy endpoint has no chat fields (an unknown field, as on OpenAI); vLLM's extras are checked the same."""
    r = post(server, {"model": MODEL, "prompt": "x", "max_tokens": 32, **fields}, "/v1/completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    neutral = {"top_k": -1, "min_p": 0, "repetition_penalty": 1, "user": "u-1"}
    stream = {"stream": True, "stream_options": {"include_usage": True, "include_obfuscation": True}}
    ok = post(server, {"model": MODEL, "prompt": "x", "max_tokens": 32, **neutral, **stream}, "/v1/completions")
    assert ok.status_code == 200 and sse(ok)[-1]["usage"]["completion_tokens"] > 0


# ------------------------------------------------------------------------------------ thinking: the prompt
SYSTEM = [{"role": "system", "content": "Be brief."}, *USER]


@pytest.mark.parametrize(
    "fields",
    [
        {"reasoning_effort": "low"},
        {"reasoning_effort": "high"},
        {"chat_template_kwargs": {"enable_thinking": True}},
        {"chat_template_kwargs": {"enable_thinking": True}, "reasoning_effort": "medium"},
    ],
)
def test_thinking_writes_think_into_the_system_turn(server, fake, fields):  # noqa: F811
    """The tiny model's template knows nothing of thinking: dgemma writes <|think|> where Gemma 4's
    template does, at the start of the system turn (one is opened when the chat has none)."""
    assert chat(server, messages=SYSTEM, **fields).status_code == 200
    assert fake.prompts[-1].startswith(f"<bos><|turn>system\n{THINK}Be brief.<turn|>\n<|turn>user\n")
    assert chat(server, **fields).status_code == 200
    assert fake.prompts[-1].startswith(
        f"<bos><|turn>system\n{THINK}<turn|>\n<|turn>user\nWhat is 2+2?<turn|>\n<|turn>model\n"
    )
    # with tools: <|think|>, the system text, the declarations (Gemma 4's order)
    assert chat(server, messages=SYSTEM, tools=TOOLS[:1], **fields).status_code == 200
    assert fake.prompts[-1].startswith(f"<bos><|turn>system\n{THINK}Be brief.<|tool>declaration:get_weather{{")
    # off: the prompt is what it always was
    for off in ({}, {"reasoning_effort": "none"}, {"chat_template_kwargs": {"enable_thinking": False}}):
        assert chat(server, messages=SYSTEM, **off).status_code == 200
        assert THINK not in fake.prompts[-1]


# A Gemma-4-style template that switches thinking itself (written for this test, after Google's).
THINKING_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if (enable_thinking is defined and enable_thinking) or messages[0]['role'] == 'system' -%}"
    "{{ '<|turn>system\\n' }}{%- if enable_thinking is defined and enable_thinking -%}{{ '<|think|>' }}{%- endif -%}"
    "{%- if messages[0]['role'] == 'system' -%}{{ messages[0]['content'] | trim }}{%- endif -%}{{ '<turn|>\\n' }}"
    "{%- endif -%}"
    "{%- for m in messages if m['role'] != 'system' -%}"
    "{{ '<|turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\\n' + m['content'] | trim + '<turn|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|turn>model\\n' }}"
    "{%- if not (enable_thinking is defined and enable_thinking) -%}{{ '<|channel>thought\\n<channel|>' }}{%- endif -%}"
    "{%- endif -%}"
    "{%- if custom_flag is defined -%}{{ '[custom]' }}{%- endif -%}"
)


def test_a_template_that_thinks_gets_enable_thinking(server, fake, model, monkeypatch):  # noqa: F811
    monkeypatch.setattr(model.tokenizer, "chat_template", THINKING_TEMPLATE)
    r = chat(server, messages=SYSTEM, reasoning_effort="low", chat_template_kwargs={"custom_flag": 1})
    assert r.status_code == 200
    user = "<|turn>user\nWhat is 2+2?<turn|>\n"
    assert fake.prompts[-1] == f"<bos><|turn>system\n{THINK}Be brief.<turn|>\n{user}<|turn>model\n[custom]"
    assert chat(server, messages=SYSTEM).status_code == 200
    assert fake.prompts[-1].endswith("<|turn>model\n<|channel>thought\n<channel|>") and THINK not in fake.prompts[-1]


def test_a_checkpoint_without_a_think_token_refuses_thinking(server, fake, model, monkeypatch):  # noqa: F811
    tok = model.tokenizer
    real = tok.token_to_id
    monkeypatch.setattr(tok, "token_to_id", lambda t: None if t == THINK else real(t))
    r = chat(server, reasoning_effort="high")
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "reasoning_effort" and "cannot think" in r.json()["error"]["message"]


# ------------------------------------------------------------------------------------ thinking: the answer
def test_reasoning_content_whole(client, fake):  # noqa: F811
    fake.text = THOUGHT
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=128, reasoning_effort="low")
    message = r.choices[0].message
    assert message.content == "The answer is 4." and message.reasoning_content == "The user asks 2+2. That is 4."
    assert r.choices[0].finish_reason == "stop"
    # the model did not think: reasoning_content null; thinking not asked for: the markers are
    # dropped as special tokens and nothing is split off
    fake.text = "Just 4."
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=128, reasoning_effort="low")
    message = r.choices[0].message
    assert message.content == "Just 4." and message.reasoning_content is None
    fake.text = THOUGHT
    message = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=128).choices[0].message
    assert message.content == "thought\nThe user asks 2+2. That is 4.\n\nThe answer is 4."
    assert not hasattr(message, "reasoning_content")


def test_reasoning_content_streamed(client, fake):  # noqa: F811
    fake.text = (
        f"{CHANNEL}thought\n" + "Step by step: " * 12 + f"done.{CHANNEL_END}The answer is 4."
    )  # over several blocks
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=USER,
            max_tokens=256,
            stream=True,
            extra_body={"chat_template_kwargs": {"enable_thinking": True}},
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = [d.reasoning_content for d in deltas if getattr(d, "reasoning_content", None)]
    content = [d.content for d in deltas if d.content]
    assert len(reasoning) > 1 and "".join(reasoning) == "Step by step: " * 12 + "done."
    assert "".join(content) == "The answer is 4."
    last_thought = max(i for i, d in enumerate(deltas) if getattr(d, "reasoning_content", None))
    assert last_thought < min(i for i, d in enumerate(deltas) if d.content)  # the thought first, then the answer
    assert not any(CHANNEL in x or CHANNEL_END in x or "thought\n" in x for x in reasoning + content)
    # the same split as the whole response gives
    whole = (
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=256, reasoning_effort="high")
        .choices[0]
        .message
    )
    assert (whole.reasoning_content, whole.content) == ("".join(reasoning), "".join(content))


def test_thinking_cut_by_max_tokens(client, fake):  # noqa: F811
    fake.text = f"{CHANNEL}thought\nStill thinking about it"
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=128, reasoning_effort="low")
    assert r.choices[0].message.reasoning_content == "Still thinking about it" and r.choices[0].message.content == ""


def test_thinking_then_a_tool_call(client, fake):  # noqa: F811
    """The thought is split off first; the call is parsed from the content only."""
    call = f"<|tool_call>call:get_weather{{city:{Q}Paris{Q}}}<tool_call|>"
    for text in (
        f"{CHANNEL}thought\nI need the weather.{CHANNEL_END}{call}",
        f"{CHANNEL}thought\nI need the weather. {call}",
    ):
        fake.text = text
        r = client.chat.completions.create(
            model=MODEL, messages=USER, tools=TOOLS, max_tokens=256, reasoning_effort="low"
        )
        message = r.choices[0].message
        assert message.reasoning_content == "I need the weather." and message.content is None
        assert [c.function.name for c in message.tool_calls] == ["get_weather"] and r.choices[
            0
        ].finish_reason == "tool_calls"
        chunks = list(
            client.chat.completions.create(
                model=MODEL, messages=USER, tools=TOOLS, max_tokens=256, stream=True, reasoning_effort="low"
            )
        )
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "I need the weather."
        assert not "".join(d.content or "" for d in deltas)
        assert [tc.function.name for d in deltas for tc in d.tool_calls or []] == ["get_weather"]


def test_nothing_after_the_answer_ends(client, fake):  # noqa: F811
    """After a <|tool_response> (the hand-over to the tool runner) nothing is sent, thoughts included."""
    call = f"<|tool_call>call:get_weather{{city:{Q}Paris{Q}}}<tool_call|>"
    result = f"<|tool_response>response:get_weather{{value:{Q}x{Q}}}<tool_response|>"
    fake.text = f"{call}{result}{CHANNEL}thought\nlate{CHANNEL_END}late"
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, max_tokens=256, reasoning_effort="low")
    message = r.choices[0].message
    assert message.reasoning_content is None and message.content is None and len(message.tool_calls) == 1
    # an empty channel is no reasoning
    fake.text = f"{CHANNEL}thought\n{CHANNEL_END}4."
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=128, reasoning_effort="low")
    message = r.choices[0].message
    assert message.reasoning_content is None and message.content == "4."


def test_answer_sent_back_with_its_reasoning(client, fake):  # noqa: F811
    """The message a thinking response returned goes back as it is (reasoning_content included);
    the thought is not rendered into the history (Gemma 4's template drops earlier thoughts)."""
    fake.text = THOUGHT
    first = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=128, reasoning_effort="low")
    messages = [*USER, first.choices[0].message, {"role": "user", "content": "And 3+3?"}]
    fake.text = "6."
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=128, reasoning_effort="low")
    assert second.choices[0].message.content == "6."
    assert fake.prompts[-1].endswith(
        "<|turn>model\nThe answer is 4.<turn|>\n<|turn>user\nAnd 3+3?<turn|>\n<|turn>model\n"
    )
    assert "That is 4" not in fake.prompts[-1]


def test_think_written_by_the_client_is_parsed(client, fake):  # noqa: F811
    """<|think|> in the client's own system prompt switches thinking on in the model: parsed too."""
    fake.text = THOUGHT
    messages = [{"role": "system", "content": THINK + "Be brief."}, *USER]
    message = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=128).choices[0].message
    assert (message.reasoning_content, message.content) == ("The user asks 2+2. That is 4.", "The answer is 4.")


# ------------------------------------------------------------------------------------ the parser
PARSED = [
    (THOUGHT, "The user asks 2+2. That is 4.", "The answer is 4."),
    ("plain answer, no channel", None, "plain answer, no channel"),
    (f"{CHANNEL}thought\ncut off here", "cut off here", ""),
    (f"Before {CHANNEL}thought\nA{CHANNEL_END}B{CHANNEL}thought\nC{CHANNEL_END} D", "AC", "Before BD"),
    (
        f"{CHANNEL}thought\nneed a tool <|tool_call>call:f{{}}<tool_call|>",
        "need a tool",
        "<|tool_call>call:f{}<tool_call|>",
    ),
    (f"stray {CHANNEL_END}close", None, "stray close"),
    (f"{CHANNEL}thoughtful\nx{CHANNEL_END}y", "thoughtful\nx", "y"),  # not the label: kept
    (f"{CHANNEL}{CHANNEL_END}answer", "", "answer"),
    (f"{CHANNEL}thought\n<|chan{CHANNEL_END}ok <|channel", "<|chan", "ok <|channel"),  # partial markers are text
]


@pytest.mark.parametrize("text,reasoning,content", PARSED)
def test_parser_streaming_matches_whole(text, reasoning, content):
    assert split_reasoning(text) == (reasoning, content)
    for seed in range(8):
        rng, parser, pieces, i = random.Random(seed), ReasoningParser(), [], 0
        while i < len(text):
            n = rng.randint(1, 7)
            pieces += parser.feed(text[i : i + n])
            i += n
        pieces += parser.feed("", final=True)
        got = (
            "".join(p.text for p in pieces if isinstance(p, Thought)),
            "".join(p for p in pieces if isinstance(p, str)),
        )
        assert got == (reasoning or "", content)
        assert not any(CHANNEL in (p.text if isinstance(p, Thought) else p) for p in pieces)


def test_parser_holds_back_only_what_may_be_a_marker():
    parser = ReasoningParser()
    assert parser.feed("Hi <|chan") == ["Hi "]
    assert parser.feed("nel>thou") == []  # the label may still come
    assert parser.feed("ght\nLet me see.  \n") == [Thought("Let me see.")]  # trailing space waits
    assert parser.feed(" More.<chan") == [Thought("  \n More.")]
    assert parser.feed("nel|>\n\nAnswer") == ["Answer"]
    assert parser.feed("", final=True) == []


def test_decoder_keeps_the_channel_markers(model):  # noqa: F811
    tok = model.tokenizer
    ids = tok.encode(THOUGHT, add_special_tokens=False)
    assert tok.decode(ids) == THOUGHT.replace(CHANNEL, "").replace(CHANNEL_END, "")
    assert keeping_channel(tok, tok.decode)(ids) == THOUGHT
