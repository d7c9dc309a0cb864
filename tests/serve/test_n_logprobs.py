"""`n` > 1 (choices sharing one prompt, encoded once) and log probabilities, with the official
openai client against the tiny random model's server.

On CPU a seeded request's tokens do not depend on what else runs nor on the prefix cache
(row-serial passes), so every choice must equal a single request with its seed, exactly."""

import json
import math
import re
import time

import httpx
import openai
import pytest

from servers import MODEL  # conftest.py serves the tiny random `model` once a session: `server`, `client`

FAST = {"max_denoising_steps": 4}
LENGTH = {**FAST, "ignore_eos": True}  # no EOS: every choice runs to max_tokens


def stats(server):
    return server.app.state.service.engine_thread.engine.stats


def solo(model, ids, max_tokens, seed, eos=False):
    out = model.generate(
        [ids], max_new_tokens=max_tokens, seed=seed, max_denoising_steps=4, eos_token_ids=None if eos else []
    )
    return model.tokenizer.decode(out.sequences[0])


# ------------------------------------------------------------------------------------ n
@pytest.mark.slow
def test_n_choices_equal_single_seeded_requests_and_encode_the_prompt_once(model, server, client):
    prompt = "n choices share this prompt: " + "the quick brown fox jumps. " * 4
    ids = model.tokenizer.encode(prompt)
    full = len(ids) // 32 * 32  # the prompt's full blocks (canvas and KV blocks of 32)
    assert full >= 64 and len(ids) % 32
    before = (stats(server).encoded_tokens, stats(server).cached_tokens)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, seed=40, n=4, extra_body=LENGTH)
    encoded, cached = stats(server).encoded_tokens - before[0], stats(server).cached_tokens - before[1]
    # one block per choice, never encoded: only prompts were; the full blocks once, each choice its tail
    assert encoded == len(ids) + 3 * (len(ids) - full)
    assert cached == 3 * full
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    texts = [c.text for c in r.choices]
    assert texts == [solo(model, ids, 32, 40 + i) for i in range(4)]
    assert len(set(texts)) == 4  # seeds differ
    assert all(c.finish_reason == "length" for c in r.choices)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 4 * 32)  # the prompt counted once
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # as the first choice found the cache


def test_scheduler_holds_a_request_whose_prefix_is_being_computed(model):
    """Not only for n: two prompts sharing a prefix, added together, encode it once; their tokens
    are those of each alone."""
    shared = model.tokenizer.encode("a shared system prompt, " * 6)[: 3 * 32]
    prompts = [shared + model.tokenizer.encode(tail, add_special_tokens=False) for tail in ("one", "two!")]
    engine = model.engine
    before = (engine.stats.encoded_tokens, engine.stats.cached_tokens)
    out = model.generate(prompts, max_new_tokens=32, seed=[1, 2], max_denoising_steps=4, eos_token_ids=[])
    assert engine.stats.cached_tokens - before[1] == 3 * 32
    assert engine.stats.encoded_tokens - before[0] == 3 * 32 + len(prompts[0]) - 96 + len(prompts[1]) - 96
    model.configure_engine(prefix_cache=False)  # each alone, cold
    try:
        alone = [
            model.generate([p], max_new_tokens=32, seed=s, max_denoising_steps=4, eos_token_ids=[]).sequences[0]
            for p, s in zip(prompts, (1, 2))
        ]
    finally:
        model.configure_engine(prefix_cache=True)
    assert out.sequences == alone


@pytest.mark.slow
def test_chat_stream_with_n_interleaves_choices(model, client):
    messages = [{"role": "user", "content": "three answers, please"}]
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=64,
        seed=9,
        n=3,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=LENGTH,
    )
    chunks = list(stream)
    content, finishes, roles = {0: "", 1: "", 2: ""}, {}, set()
    order = []
    for c in chunks[:-1]:
        (choice,) = c.choices
        order.append(choice.index)
        content[choice.index] += choice.delta.content or ""
        roles |= {choice.index} if choice.delta.role == "assistant" else set()
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
    assert roles == {0, 1, 2} and finishes == {0: "length", 1: "length", 2: "length"}
    assert order != sorted(order)  # interleaved, not one choice after another
    ids = model.tokenizer.apply_chat_template(messages)
    assert [content[i] for i in range(3)] == [solo(model, ids, 64, 9 + i) for i in range(3)]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3 * 64
    assert chunks[-1].usage.prompt_tokens == len(ids)


@pytest.mark.slow
def test_n_with_a_grammar_gives_each_choice_its_own_state(client):
    r = client.completions.create(
        model=MODEL,
        prompt="n:",
        max_tokens=64,
        seed=3,
        n=3,
        extra_body={"guided_regex": "[a-z]{2,6}( [0-9]{1,3}){1,2}", **FAST},
    )
    texts = [c.text for c in r.choices]
    assert all(re.fullmatch("[a-z]{2,6}( [0-9]{1,3}){1,2}", t) for t in texts), texts
    assert len(set(texts)) > 1


def test_n_too_large_is_a_400_naming_n(client):
    for n in (17, 200):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="x", max_tokens=8, n=n)
        assert e.value.body["param"] == "n" and "n" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=8, n=2, best_of=3)


@pytest.mark.slow
def test_client_gone_cancels_every_choice(model, server):
    engine_thread = server.app.state.service.engine_thread
    # every block runs all 48 passes (never confident): a fast CPU (an AMX Xeon) finished the three
    # choices at 4 passes a block before this thread read the first line
    never_stops = {"max_denoising_steps": 48, "confidence_threshold": 1e-12, "stability_threshold": 4096}
    body = {"model": MODEL, "prompt": "long", "max_tokens": 2000, "n": 3, "stream": True, **LENGTH, **never_stops}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        next(r.iter_lines())
        assert engine_thread.in_flight == 3
    deadline = time.monotonic() + 20
    while engine_thread.in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine_thread.in_flight == 0 and not engine_thread.engine.scheduler.running


# ------------------------------------------------------------------------------------ logprobs
def check_entry(token, logprob, top, banned_can_change=False):
    """One token's logprobs: <= 0, the alternatives sorted, their probabilities sum to at most 1,
    and the token is the likeliest (among them) unless a grammar changed it."""
    assert logprob <= 0
    lps = [lp for _, lp in top]
    assert lps == sorted(lps, reverse=True) and all(lp <= 0 for lp in lps)
    assert sum(math.exp(lp) for lp in lps) <= 1 + 1e-9
    if not banned_can_change:
        assert token in [t for t, _ in top]
        assert logprob == max(lps)


@pytest.mark.slow
def test_chat_logprobs_whole_and_streamed(model, client):
    messages = [{"role": "user", "content": "logprobs please"}]
    args = dict(
        model=MODEL, messages=messages, max_tokens=64, seed=21, logprobs=True, top_logprobs=5, extra_body=LENGTH
    )
    r = client.chat.completions.create(**args)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 64
    for e in content:
        assert len(e.top_logprobs) == 5 and bytes(e.bytes).decode("utf-8", "backslashreplace") == e.token
        check_entry(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs])
    assert any(e.logprob < -1e-3 for e in content)  # the random model is unsure: not all probability 1
    streamed = [c for c in client.chat.completions.create(stream=True, **args) if c.choices]
    pieces = [e for c in streamed if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [p.model_dump() for p in pieces] == [e.model_dump() for e in content]
    assert sum(1 for c in streamed if c.choices[0].logprobs) == 2  # one chunk per block, each with its tokens
    # without logprobs: none
    plain = client.chat.completions.create(**{**args, "logprobs": None, "top_logprobs": None})
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == r.choices[0].message.content


def test_completion_logprobs_shape_and_stream(model, client):
    args = dict(model=MODEL, prompt="completion logprobs", max_tokens=64, seed=22, logprobs=3, extra_body=LENGTH)
    r = client.completions.create(**args)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 64
    text = r.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] < len(text)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(top) <= 4 and top[token] == logprob  # the token itself is always there, as OpenAI does
        check_entry(token, logprob, sorted(top.items(), key=lambda kv: -kv[1]))
    chunks = list(client.completions.create(stream=True, **args))
    merged = {
        k: [v for c in chunks if c.choices[0].logprobs for v in getattr(c.choices[0].logprobs, k)]
        for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    }
    assert merged == {k: getattr(lp, k) for k in merged}
    # logprobs=0: the token's own log probability only
    zero = client.completions.create(**{**args, "logprobs": 0}).choices[0].logprobs
    assert zero.token_logprobs == lp.token_logprobs and all(
        list(t) == [tok] for t, tok in zip(zero.top_logprobs, zero.tokens)
    )


def test_logprobs_with_n_and_seeds(client):
    args = dict(model=MODEL, prompt="several with logprobs", max_tokens=32, logprobs=2, extra_body=LENGTH)
    r = client.completions.create(n=2, seed=50, **args)
    for i, choice in enumerate(r.choices):
        single = client.completions.create(seed=50 + i, **args).choices[0]
        assert choice.text == single.text and choice.logprobs.token_logprobs == single.logprobs.token_logprobs
    assert r.choices[0].logprobs.tokens != r.choices[1].logprobs.tokens


def test_logprobs_under_a_grammar_never_show_banned_tokens(model, client):
    """With a grammar the masks ban tokens: they never appear among the alternatives, and a
    forced token (one allowed) has probability 1."""
    regex = "[0-9]{3}-[0-9]{3}"
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "digits"}],
        max_tokens=32,
        seed=4,
        logprobs=True,
        top_logprobs=20,
        extra_body={"guided_regex": regex, **FAST},
    )
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content == "".join(e.token for e in content if e.token not in ("<eos>",))
    for k, e in enumerate(content[:7]):
        allowed = "-" if k == 3 else "0123456789"
        assert all(t.token in allowed for t in e.top_logprobs), e.top_logprobs
        check_entry(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs], banned_can_change=True)
    assert content[3].token == "-" and content[3].logprob == 0.0 and len(content[3].top_logprobs) == 1
    assert content[-1].token == "<eos>" and r.usage.completion_tokens == len(content) == 8


def test_logprobs_stop_at_the_stop_string(model, client):
    args = dict(model=MODEL, prompt="stop here", max_tokens=64, seed=23, logprobs=1, extra_body=LENGTH)
    full = client.completions.create(**args).choices[0]
    text = full.text
    j = next((j for j in range(20, 60) if "\ufffd" not in text[j : j + 2] and text.find(text[j : j + 2]) == j), None)
    assert j is not None, text
    r = client.completions.create(stop=text[j : j + 2], **args)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == text[:j] and len(lp.tokens) == r.usage.completion_tokens < 64
    assert lp.token_logprobs == full.logprobs.token_logprobs[: len(lp.tokens)]
    assert json.loads(json.dumps(lp.model_dump()))  # plain JSON: no -inf, no NaN
