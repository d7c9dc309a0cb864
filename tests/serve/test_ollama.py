"""The ollama-compatible API (`/api/*`, dgemma/serve/ollama/routes.py) driven by the official `ollama` client
and LangChain's `ChatOllama`: model listing and details, chat and generate whole and streamed
(newline-delimited JSON), images on a vision checkpoint, a JSON schema `format`, tools (arguments
as objects), thinking, insert mode (`suffix`); the same answers as the OpenAI endpoints for the
same seed; ollama-shaped errors; the API key, Host and Origin rules. The random model never calls a
tool or thinks, so those tests are answered by a stand-in engine (tests/serve/tool_fakes.py)."""

import asyncio
import base64
import inspect
import json
import time
from datetime import datetime

import httpx
import ollama
import pytest
from tool_fakes import TOOLS, WEATHER, FakeEngine

import dgemma
from dgemma.engine.events import Block
from dgemma.serve.app import create_app
from dgemma.serve.engine_thread import EngineFailure, Job
from dgemma.serve.http.access import Access
from dgemma.serve.http.listener import ServerThread
from dgemma.serve.reasoning import CHANNEL, CHANNEL_END
from dgemma.serve.tools.syntax import QUOTE as Q
from media_samples import PNG, data_url, image_part
from servers import MODEL, VISION_FAST, VISION_MODEL, serve_vision  # conftest.py serves `model` as MODEL: `server`

FAST = {"max_denoising_steps": 2}
USER = [{"role": "user", "content": "Say something short."}]
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
CALL_TEXT = f"<|tool_call>call:get_weather{{city:{Q}Paris{Q},days:2}}<tool_call|>"
THOUGHT = f"{CHANNEL}thought\nThe user asks 2+2. That is 4.\n{CHANNEL_END}\nThe answer is 4."


class Fake(FakeEngine):
    """FakeEngine taking whatever else the server passes the engine; with `fail`, the engine
    fails after the first block (a server fault once the answer has begun)."""

    fail = False

    def __call__(self, prompt, config, seed, drafts=False, images=(), **_):
        if not self.fail:
            return super().__call__(prompt, config, seed, drafts, images)
        job = Job(list(prompt), config, seed, drafts, asyncio.get_running_loop(), list(images))
        job.deliver(Block(0, 0, self.tokenizer.encode(self.text, add_special_tokens=False)[: self.block], False, 1))
        job.deliver(EngineFailure("the fake engine broke"))
        return job


@pytest.fixture
def fake(server, model, monkeypatch):
    engine = Fake(model.tokenizer, model.generation_config.eos_token_ids[0])
    engine.text = "The answer is 4."
    monkeypatch.setattr(server.app.state.service.engine_thread, "submit", engine)
    return engine


@pytest.fixture(scope="module")
def api(server):
    return ollama.Client(host=server.url, timeout=60)


def options(**extra) -> dict:
    return {"seed": 3, "num_predict": 16, **FAST, **extra}


def openai_chat(client, messages=USER, max_tokens=16, seed=3, **extra):
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, seed=seed, extra_body={**FAST, **extra}
    )


def ndjson(response: httpx.Response) -> list[dict]:
    assert response.headers["content-type"] == "application/x-ndjson"
    return [json.loads(line) for line in response.text.splitlines() if line]


# ------------------------------------------------------------------------------------ models
def test_version_tags_show_ps_and_head(server, api, model):
    assert httpx.get(server.url + "/api/version").json()["version"].count(".") == 2
    head = httpx.head(server.url + "/")
    assert head.status_code == 200 and head.content == b""
    assert httpx.get(server.url + "/").headers["content-type"].startswith("text/html")  # the playground stays
    (listed,) = api.list().models
    assert listed.model == f"{MODEL}:latest" and listed.size > 0 and len(listed.digest) == 64
    assert listed.details.format == "safetensors" and listed.details.family == "diffusion_gemma"
    assert listed.details.parameter_size and listed.details.quantization_level in ("F32", "BF16")
    for name in (MODEL, f"{MODEL}:latest"):
        shown = api.show(name)
        assert shown.capabilities[:3] == ["completion", "tools", "insert"] and "vision" not in shown.capabilities
        assert "thinking" in shown.capabilities  # the tiny tokenizer has <|think|>
        assert shown.modelinfo["diffusion_gemma.context_length"] == server.app.state.service.context
        assert shown.modelinfo["general.parameter_count"] == model.config.num_parameters()
        assert shown.details.family == "diffusion_gemma"
    (running,) = api.ps().models
    assert running.model == f"{MODEL}:latest" and running.context_length == server.app.state.service.context


# ------------------------------------------------------------------------------------ chat and generate
def test_chat_whole_equals_openai(api, client):
    r = api.chat(model=MODEL, messages=USER, options=options(), stream=False, keep_alive="5m")
    expected = openai_chat(client)
    assert r.message.role == "assistant" and r.message.content == expected.choices[0].message.content
    assert r.done and r.done_reason == expected.choices[0].finish_reason
    assert r.prompt_eval_count == expected.usage.prompt_tokens and r.eval_count == expected.usage.completion_tokens
    durations = (r.total_duration, r.load_duration, r.prompt_eval_duration, r.eval_duration)
    assert all(isinstance(v, int) and v >= 0 for v in durations)
    assert r.total_duration >= r.eval_duration > 0 and r.model == MODEL
    datetime.fromisoformat(r.created_at.replace("Z", "+00:00"))
    tagged = api.chat(model=f"{MODEL}:latest", messages=USER, options=options(), stream=False)
    assert tagged.message.content == r.message.content and tagged.model == f"{MODEL}:latest"


def test_chat_streams_ndjson_by_default(server, api):
    two_blocks = options(num_predict=2 * server.app.state.service.canvas, ignore_eos=True)
    whole = api.chat(model=MODEL, messages=USER, options=two_blocks, stream=False)
    chunks = list(api.chat(model=MODEL, messages=USER, options=two_blocks, stream=True))
    assert all(not c.done for c in chunks[:-1]) and chunks[-1].done and chunks[-1].done_reason == whole.done_reason
    assert "".join(c.message.content for c in chunks) == whole.message.content
    assert len(chunks) > 2  # a piece per block, as it commits
    assert chunks[-1].eval_count == whole.eval_count and chunks[-1].message.content == ""
    # no "stream" field: streamed, as ollama does
    body = {"model": MODEL, "messages": USER, "options": options()}
    raw = httpx.post(server.url + "/api/chat", json=body, timeout=60)
    lines = ndjson(raw)
    assert lines[-1]["done"] is True and all(line["done"] is False for line in lines[:-1])
    assert set(lines[-1]) >= {
        "done_reason",
        "total_duration",
        "load_duration",
        "prompt_eval_count",
        "prompt_eval_duration",
        "eval_count",
        "eval_duration",
        "created_at",
        "model",
        "message",
    }


def test_generate_equals_the_openai_endpoints(api, client):
    templated = api.generate(model=MODEL, prompt=USER[0]["content"], options=options(), stream=False)
    assert templated.response == openai_chat(client).choices[0].message.content and templated.done
    system = api.generate(model=MODEL, prompt="Hi", system="Be brief.", options=options(), stream=False)
    chat = openai_chat(client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert system.response == chat.choices[0].message.content
    raw = api.generate(model=MODEL, prompt="Once upon a time", raw=True, options=options(), stream=False)
    completion = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=16, seed=3, extra_body=FAST
    )
    assert raw.response == completion.choices[0].text and raw.eval_count == completion.usage.completion_tokens
    streamed = list(api.generate(model=MODEL, prompt="Once upon a time", raw=True, options=options(), stream=True))
    assert "".join(c.response for c in streamed) == raw.response and streamed[-1].done and not streamed[0].done


def test_generate_with_suffix_is_insert_mode(api, client):
    body = {"prompt": "def add(a, b):\n    ", "suffix": "\n    return c\n"}
    r = api.generate(model=MODEL, **body, options={"seed": 4, "num_predict": 8, **FAST}, stream=False)
    expected = client.completions.create(model=MODEL, max_tokens=8, seed=4, extra_body=FAST, **body)
    assert r.response == expected.choices[0].text and r.done_reason == "stop"
    assert r.eval_count == expected.usage.completion_tokens
    chunks = list(api.generate(model=MODEL, **body, options={"seed": 4, "num_predict": 8, **FAST}, stream=True))
    assert "".join(c.response for c in chunks) == r.response and chunks[-1].done
    # stop strings cut the span (the OpenAI route refuses them in insert mode)
    if r.response:
        cut = api.generate(
            model=MODEL, **body, options={"seed": 4, "num_predict": 8, "stop": [r.response[-1]], **FAST}, stream=False
        )
        assert cut.response == r.response[: r.response.index(r.response[-1])]


def test_load_requests_and_ignored_options(api):
    assert api.chat(model=MODEL, messages=[]).done_reason == "load"
    assert api.generate(model=MODEL, keep_alive=0).done_reason == "unload"
    # ollama's options dgemma cannot honour are ignored, unknown ones too; their types are checked
    plain = api.chat(model=MODEL, messages=USER, options=options(), stream=False)
    extra = options(
        temperature=0.7,
        top_k=40,
        top_p=0.9,
        repeat_penalty=1.1,
        num_ctx=2048,
        mirostat=0,
        num_thread=2,
        made_up_option="x",
    )
    assert api.chat(model=MODEL, messages=USER, options=extra, stream=False).message.content == plain.message.content


@pytest.mark.slow
def test_format_json_schema_is_enforced(api):
    import jsonschema

    r = api.chat(
        model=MODEL,
        messages=[{"role": "user", "content": "json"}],
        format=SCHEMA,
        stream=False,
        options={"seed": 0, "num_predict": 200, "max_denoising_steps": 4},
    )
    assert r.done_reason == "stop"
    jsonschema.validate(json.loads(r.message.content), SCHEMA)
    g = api.generate(
        model=MODEL,
        prompt="json",
        format=SCHEMA,
        stream=False,
        options={"seed": 2, "num_predict": 200, "max_denoising_steps": 4},
    )
    jsonschema.validate(json.loads(g.response), SCHEMA)


# ------------------------------------------------------------------------------------ tools and thinking
def test_tool_calls_have_object_arguments(server, api, fake):
    fake.text = f"Checking.\n{CALL_TEXT}"
    r = api.chat(model=MODEL, messages=USER, tools=TOOLS, stream=False)
    (call,) = r.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris", "days": 2}
    assert r.message.content == "Checking." and r.done_reason == "stop"
    body = {"model": MODEL, "messages": USER, "tools": TOOLS, "stream": False}
    raw = httpx.post(server.url + "/api/chat", json=body, timeout=30).json()
    assert isinstance(raw["message"]["tool_calls"][0]["function"]["arguments"], dict)
    chunks = list(api.chat(model=MODEL, messages=USER, tools=[WEATHER], stream=True))
    calls = [c for chunk in chunks for c in (chunk.message.tool_calls or [])]
    assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", {"city": "Paris", "days": 2})]


def test_tool_round_trip_renders_as_on_the_openai_route(api, client, fake):
    fake.text = "Sunny."
    history = [
        *USER,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "sunny, 21 C", "tool_name": "get_weather"},
    ]
    assert api.chat(model=MODEL, messages=history, tools=TOOLS, stream=False).message.content == "Sunny."
    prompt = fake.prompts[-1]
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    openai_history = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"},
    ]
    client.chat.completions.create(model=MODEL, messages=openai_history, tools=TOOLS, max_tokens=64)
    assert fake.prompts[-1] == prompt and "<|tool_response>" in prompt
    with pytest.raises(ollama.ResponseError) as e:  # a result answering no call
        api.chat(model=MODEL, messages=[*USER, {"role": "tool", "content": "x", "tool_name": "get_weather"}])
    assert e.value.status_code == 400 and "messages[1]" in e.value.error


def test_think_gives_message_thinking(api, fake):
    fake.text = THOUGHT
    r = api.chat(model=MODEL, messages=USER, think=True, stream=False)
    assert r.message.thinking == "The user asks 2+2. That is 4." and r.message.content == "The answer is 4."
    assert "<|think|>" in fake.prompts[-1]
    chunks = list(api.chat(model=MODEL, messages=USER, think=True, stream=True))
    assert "".join(c.message.thinking or "" for c in chunks) == r.message.thinking
    assert "".join(c.message.content for c in chunks) == r.message.content
    g = api.generate(model=MODEL, prompt="2+2?", think=True, stream=False)
    assert g.thinking == r.message.thinking and g.response == "The answer is 4."
    fake.text = "Plain."
    assert api.chat(model=MODEL, messages=USER, think=False, stream=False).message.thinking is None
    assert "<|think|>" not in fake.prompts[-1]


# ------------------------------------------------------------------------------------ errors
def _refused(call, status: int, *words: str) -> str:
    with pytest.raises(ollama.ResponseError) as e:
        result = call()
        if inspect.isgenerator(result):
            list(result)  # a stream: the error may come as a line
    assert e.value.status_code == status and all(w in e.value.error for w in words), e.value.error
    return e.value.error


def test_bad_requests_get_ollama_errors(server, api):
    _refused(lambda: api.chat(model="llama3", messages=USER), 404, "model 'llama3' not found")
    _refused(lambda: api.generate(model="tiny:7b", prompt="x"), 404, "model 'tiny:7b' not found")
    _refused(lambda: api.show("other"), 404, "model 'other' not found")
    _refused(
        lambda: api.chat(model=MODEL, messages=USER, options={"temperature": "hot"}),
        400,
        'option "temperature" must be of type float',
    )
    for bad, words in [
        ({"num_predict": "ten"}, ('"num_predict"', "integer")),
        ({"seed": 1.5}, ('"seed"', "integer")),
        ({"ignore_eos": 1}, ('"ignore_eos"', "boolean")),
        ({"stop": "x"}, ('"stop"', "array")),
        ({"stop": ["a", "b", "c", "d", "e"]}, ("options.stop",)),
    ]:
        _refused(lambda bad=bad: api.chat(model=MODEL, messages=USER, options=bad), 400, *words)
    _refused(lambda: api.chat(model=MODEL, messages=USER, options={"num_predict": 10**7}), 400, "options.num_predict")
    _refused(
        lambda: api.chat(model=MODEL, messages=USER, options={"max_denoising_steps": 10**5}),
        400,
        "options.max_denoising_steps",
    )
    _refused(lambda: api.chat(model=MODEL, messages=USER, format={"type": "foo"}), 400, "format")
    _refused(lambda: api.chat(model=MODEL, messages=[{"role": "robot", "content": "hi"}]), 400, "messages[0].role")
    _refused(lambda: api.generate(model=MODEL, prompt="x", template="{{ .Prompt }}"), 400, "template")
    _refused(lambda: api.generate(model=MODEL, prompt="x", raw=True, think=True), 400, "think")
    # images: not base64, not an image, and images on a checkpoint without a vision tower
    _refused(
        lambda: api.chat(model=MODEL, messages=[{**USER[0], "images": ["Zm9v!!!!"]}]),
        400,
        "messages[0].images[0]",
        "base64",
    )
    _refused(lambda: api.generate(model=MODEL, prompt="x", images=["Zm9vYmFy"]), 400, "images[0]", "not a PNG")
    _refused(
        lambda: api.chat(model=MODEL, messages=[{**USER[0], "images": [PNG]}]),
        400,
        "messages[0].images[0]",
        "vision tower",
    )
    for body, status, words in [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (json.dumps({"model": MODEL, "messages": "hi"}).encode(), 400, "messages"),
        (json.dumps({"model": MODEL, "messages": USER, "stream": "yes"}).encode(), 400, "stream"),
        (json.dumps({"messages": USER}).encode(), 400, "model"),
        (json.dumps({"model": MODEL, "messages": USER, "format": "yaml"}).encode(), 400, "format"),
        (json.dumps({"model": MODEL, "messages": USER, "options": [1]}).encode(), 400, "options"),
    ]:
        r = httpx.post(server.url + "/api/chat", content=body, timeout=30)
        assert r.status_code == status and set(r.json()) == {"error"} and words in r.json()["error"], r.text
    r = httpx.post(server.url + "/api/pull", json={"model": "llama3"})
    assert r.status_code == 404 and "dgemma pull" in r.json()["error"]
    # the OpenAI routes keep their own error shape
    assert set(httpx.post(server.url + "/v1/chat/completions", content=b"{").json()["error"]) >= {"message", "type"}
    assert api.chat(model=MODEL, messages=USER, options=options(), stream=False).done  # the server lives on


def test_an_engine_failure_mid_stream_is_an_error_line(server, api, fake):
    fake.text, fake.block, fake.fail = "word " * 40, 8, True
    lines = ndjson(httpx.post(server.url + "/api/chat", json={"model": MODEL, "messages": USER}, timeout=30))
    assert lines[0]["done"] is False and lines[0]["message"]["content"]
    assert lines[-1] == {"error": "generation failed: the fake engine broke"}
    _refused(lambda: api.chat(model=MODEL, messages=USER, stream=True), -1, "the fake engine broke")  # mid-stream
    _refused(lambda: api.chat(model=MODEL, messages=USER, stream=False), 500, "the fake engine broke")


# ------------------------------------------------------------------------------------ LangChain
def test_langchain_chat_ollama_gets_the_answer(server, client):
    from langchain_ollama import ChatOllama

    llm = ChatOllama(base_url=server.url, model=MODEL, seed=3, num_predict=16)
    fast = {"seed": 3, "num_predict": 16, **FAST}  # ChatOllama's fields, and a diffusion knob: its `options` whole
    answer = llm.invoke(USER[0]["content"], options=fast)
    expected = openai_chat(client)
    assert answer.content == expected.choices[0].message.content
    assert answer.response_metadata["done_reason"] == expected.choices[0].finish_reason
    assert answer.usage_metadata["output_tokens"] == expected.usage.completion_tokens
    assert answer.usage_metadata["input_tokens"] == expected.usage.prompt_tokens
    assert "".join(chunk.content for chunk in llm.stream(USER[0]["content"], options=fast)) == answer.content


# ------------------------------------------------------------------------------------ access rules
def test_key_host_and_origin_rules_cover_the_ollama_api(model):
    with ServerThread(create_app(model, MODEL, max_active=2, access=Access(api_key="s3cret"), ui=False)) as s:
        assert httpx.head(s.url + "/").status_code == 200  # ollama's probe stays open
        assert httpx.get(s.url + "/").status_code == 404  # no playground (--no-ui): GET / is no route, as before
        _refused(lambda: ollama.Client(host=s.url).list(), 401, "API key")
        _refused(
            lambda: ollama.Client(host=s.url, headers={"Authorization": "Bearer nope"}).chat(
                model=MODEL, messages=USER
            ),
            401,
            "API key",
        )
        keyed = ollama.Client(host=s.url, headers={"Authorization": "Bearer s3cret"}, timeout=60)
        assert keyed.list().models[0].model == f"{MODEL}:latest"
        assert keyed.chat(model=MODEL, messages=USER, options=options(num_predict=8), stream=False).done
        auth = {"Authorization": "Bearer s3cret"}
        for headers in ({"Host": "evil.example"}, {"Origin": "http://evil.example"}):
            r = httpx.get(s.url + "/api/version", headers={**auth, **headers})
            assert r.status_code == 403 and set(r.json()) == {"error"} and "not allowed" in r.json()["error"]
        body = {"model": MODEL, "messages": USER}
        r = httpx.post(s.url + "/api/chat", json=body, headers={**auth, "Origin": "http://evil.example"})
        assert r.status_code == 403


# ------------------------------------------------------------------------------------ images
@pytest.fixture(scope="module")
def vision(vision_checkpoint):
    with serve_vision(dgemma.load(vision_checkpoint)) as s:
        s.api = ollama.Client(host=s.url, timeout=120)
        yield s


@pytest.mark.slow
def test_chat_with_an_image_on_a_vision_checkpoint(vision):
    assert "vision" in vision.api.show(VISION_MODEL).capabilities
    knobs = {**VISION_FAST, "seed": 1, "num_predict": 8}
    r = vision.api.chat(
        model=VISION_MODEL,
        messages=[{"role": "user", "content": "what is this?", "images": [PNG]}],
        options=knobs,
        stream=False,
    )
    expected = vision.client.chat.completions.create(
        model=VISION_MODEL,
        max_tokens=8,
        seed=1,
        extra_body=VISION_FAST,
        messages=[{"role": "user", "content": [image_part(data_url(PNG)), {"type": "text", "text": "what is this?"}]}],
    )
    assert r.message.content == expected.choices[0].message.content and r.eval_count == 8
    assert r.prompt_eval_count == expected.usage.prompt_tokens
    g = vision.api.generate(
        model=VISION_MODEL, prompt="what is this?", images=[base64.b64encode(PNG).decode()], options=knobs, stream=False
    )
    assert g.response == r.message.content


@pytest.mark.slow
def test_a_client_that_leaves_a_stream_cancels_its_work(server):
    """A client that goes away mid-stream takes its request off the engine (no work for nobody)."""
    engine_thread = server.app.state.service.engine_thread
    body = {"model": MODEL, "messages": USER, "options": {"num_predict": 2000, "ignore_eos": True, "seed": 1}}
    with httpx.stream("POST", server.url + "/api/chat", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert json.loads(next(r.iter_lines()))["done"] is False
        assert engine_thread.in_flight == 1
    deadline = time.monotonic() + 20
    while engine_thread.in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine_thread.in_flight == 0 and not engine_thread.engine.scheduler.running


def test_either_api_takes_either_name(server, api, client):
    """The name /api/tags lists (`NAME:latest`) works on the OpenAI endpoints, and the OpenAI name
    on ollama's (ollama takes a name with or without `:latest`); other names stay refused."""
    import openai

    want = openai_chat(client).choices[0].message.content
    for name in (MODEL, f"{MODEL}:latest"):
        chat = client.chat.completions.create(model=name, messages=USER, max_tokens=16, seed=3, extra_body=FAST)
        assert chat.choices[0].message.content == want
        assert (
            client.completions.create(model=name, prompt="x", max_tokens=4, seed=3, extra_body=FAST).choices[0].text
            is not None
        )
        assert httpx.get(f"{server.url}/v1/models/{name}").status_code == 200
        assert api.chat(model=name, messages=USER, options=options(), stream=False).message.content == want
    for other in (f"{MODEL}:7b", "llama3:latest"):
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model=other, messages=USER, max_tokens=4, extra_body=FAST)
