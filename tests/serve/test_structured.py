"""Structured output enforced on the canvas (engine/constraints/grammar.py) and its request fields (serve/structured/formats.py).

A random tiny model writes noise, so whatever it produces under a grammar shows the enforcement:
every answer must parse and validate, and an answer cut by max_tokens must be a valid prefix."""

import json
import re
import textwrap

import jsonschema
import llguidance
import openai
import pytest
import torch

import dgemma
from dgemma.engine.constraints import grammar
from dgemma.engine.constraints.grammar import (
    GrammarError,
    best_allowed,
    best_allowed_candidate,
    single_token,
    top_candidates,
)
from dgemma.engine.sampler import pack_token_mask
from dgemma.serve.structured.formats import OutputFormat, StructuredError, guided_format
from dgemma.serve.structured.limits import LarkStats
from servers import MODEL  # conftest.py serves the tiny random `model` once a session: `server`, `client`

FAST = {"max_denoising_steps": 4}
# One pass per block: each block is then the refined (valid left to right) argmax of its first
# pass. The enforcement is the same at any step count; the fifty-request tests run 4x faster.
ONE_PASS = {"max_denoising_steps": 1}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "score": {"type": "number", "minimum": -1, "maximum": 1},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
        "owner": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999}, "vip": {"type": "boolean"}},
            "required": ["id", "vip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "age", "score", "tags", "owner"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]{1,6}( [0-9]{1,3}){1,3}"


def texts(model, out):
    return [model.tokenizer.decode(s) for s in out.sequences]


# ------------------------------------------------------------------------------------ the engine
@pytest.mark.slow
def test_fifty_seeded_schema_answers_parse_and_validate(model):
    grammar = model.compile_grammar("json_schema", SCHEMA)
    out = model.generate(
        ["Describe a pet:"] * 50, max_new_tokens=256, seed=list(range(50)), grammar=grammar, **ONE_PASS
    )
    for text in texts(model, out):
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts(model, out))) > 40  # seeds differ: enforcement, not one canned answer


@pytest.mark.slow
def test_fifty_seeded_regex_answers_match(model):
    grammar = model.compile_grammar("regex", REGEX)
    out = model.generate(["x"] * 50, max_new_tokens=64, seed=list(range(50)), grammar=grammar, **ONE_PASS)
    for text in texts(model, out):
        assert re.fullmatch(REGEX, text), text


@pytest.mark.slow
def test_json_object_parses_or_is_a_valid_prefix():
    """Any JSON object: unbounded, so a model may run out of tokens first (finish "length": the
    text is then a valid prefix); every answer that ends on its own parses. On the shipped
    model, whose strings end (a random byte-level model's strings run on for hundreds of bytes)."""
    model = dgemma.load()
    grammar = model.compile_grammar("json_object", None)
    out = model.generate(["x = {"] * 8, max_new_tokens=128, seed=list(range(8)), grammar=grammar, max_denoising_steps=8)
    closed = 0
    for text, seq in zip(texts(model, out), out.sequences):
        if len(seq) < 128:
            assert isinstance(json.loads(text), dict)
            closed += 1
        else:
            assert llguidance.LLMatcher(model.grammars.tokenizer, grammar.source, log_level=0).consume_tokens(seq)
    assert closed >= 2


def test_lark_grammar(model):
    lark = 'start: "(" item ("," item)* ")"\nitem: /[0-9]/ | "x"'
    grammar = model.compile_grammar("lark", lark)
    out = model.generate(["y"] * 4, max_new_tokens=64, seed=list(range(4)), grammar=grammar, **FAST)
    for text in texts(model, out):
        assert re.fullmatch(r"\(([0-9]|x)(,([0-9]|x))*\)", text), text


def test_max_tokens_cut_is_a_valid_prefix(model):
    grammar = model.compile_grammar("json_schema", SCHEMA)
    out = model.generate(["p"] * 4, max_new_tokens=10, seed=list(range(4)), grammar=grammar, **FAST)
    tok = model.grammars.tokenizer
    for seq in out.sequences:
        assert len(seq) == 10
        matcher = llguidance.LLMatcher(tok, grammar.source, log_level=0)
        assert matcher.consume_tokens(seq) and not matcher.is_error()


@pytest.mark.slow
def test_batched_equals_alone(model):
    grammar = model.compile_grammar("json_schema", SCHEMA)
    alone = [
        model.generate(["a pet"], max_new_tokens=128, seed=s, grammar=grammar, **FAST).sequences[0] for s in (3, 4)
    ]
    batched = model.generate(["a pet", "a pet"], max_new_tokens=128, seed=[3, 4], grammar=grammar, **FAST).sequences
    assert batched == alone


def test_forced_tokens_are_fixed_and_commits_are_valid_prefixes(model):
    """The walk fixes tokens the grammar forces, masks the valid prefix of the draft and one past
    it; a block commits only what the grammar accepts."""
    grammar = model.compile_grammar("regex", r'\{"key":"[a-z]+"\}')
    state = model.grammars.canvas(grammar, model.config.canvas_length)
    forced = model.grammars.tokenizer.tokenize_str('{"key":"')

    class Draft:
        argmax = torch.zeros(model.config.canvas_length, dtype=torch.long)  # token 0 (<pad>): never valid

    c = state(Draft)
    assert c.fixed[: len(forced)].tolist() == forced and (c.fixed[len(forced) :] < 0).all()
    allowed = c.allowed_dense(model.config.vocab_size)
    assert allowed[len(forced) + 1 :].all()  # past the first rejected token: free
    assert not allowed[len(forced)].all() and not allowed[len(forced), 0]
    block = forced + model.grammars.tokenizer.tokenize_str("ab") + [0, 0]
    assert state.commit(block) == len(forced) + 2
    assert state.commit([0]) == 0  # nothing valid: nothing consumed


def test_single_token_of_a_mask():
    for token in (0, 31, 32, 95, 383):
        mask = torch.zeros(384, dtype=torch.bool)
        mask[token] = True
        assert single_token(pack_token_mask(mask)) == token
    two = torch.zeros(384, dtype=torch.bool)
    two[[5, 200]] = True
    assert single_token(pack_token_mask(two)) is None


def test_the_candidates_pick_what_the_whole_row_picks():
    """A rejected token's replacement from each position's 64 heaviest tokens (one read from the
    device per refined pass) equals the whole row's: ties to the lowest id, zero weights never,
    undecided (False) only where an unseen token could win."""
    g = torch.Generator().manual_seed(0)
    vocab, decided = 384, 0
    for trial in range(300):
        weights = torch.rand(vocab, generator=g) ** 8
        if trial % 3 == 0:
            weights = (weights * 4).round() / 4  # ties
        if trial % 5 == 0:
            weights[torch.rand(vocab, generator=g) < 0.8] = 0.0
        allowed = torch.rand(vocab, generator=g) < (0.02 if trial % 2 else 0.5)
        mask = pack_token_mask(allowed)
        ((values, ids),) = top_candidates(weights[None])
        got = best_allowed_candidate(mask, values, ids)
        if got is not False:
            decided += 1
            assert got == best_allowed(mask, weights), trial
    assert decided > 150


def test_a_refined_pass_reads_the_device_once(model, monkeypatch):
    """Grammar refinement reads each position's candidates once per pass, not a row per rejection."""
    reads = []
    monkeypatch.setattr(grammar, "top_candidates", lambda w, k=64: reads.append(1) or top_candidates(w, k))
    grammar_ = model.compile_grammar("regex", REGEX)
    passes = model.engine.stats.decoder_passes
    model.generate(["x"] * 4, max_new_tokens=64, seed=list(range(4)), grammar=grammar_, **ONE_PASS)
    assert 0 < len(reads) <= model.engine.stats.decoder_passes - passes  # at most one per request's pass


@pytest.mark.parametrize(
    "kind, spec, words",
    [
        ("json_schema", {"type": "foo"}, "Invalid type"),
        ("json_schema", {"type": "string", "format": "weird"}, "Unknown format"),
        ("json_schema", {"properties": {"a": {"$ref": "#/nowhere"}}}, "does not exist"),
        ("json_schema", {"type": "integer", "minimum": 5, "maximum": 2}, "Unsatisfiable"),
        ("json_schema", [1, 2], "must be an object"),
        ("regex", "a(b", "regex parse error"),
        ("lark", "start: x", "unknown name"),
    ],
)
def test_bad_grammars_name_the_problem(model, kind, spec, words):
    with pytest.raises(GrammarError, match=re.escape(words)):
        model.compile_grammar(kind, spec)


# ------------------------------------------------------------------------------------ the server
@pytest.mark.slow
def test_response_format_json_schema(client):
    rf = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "a pet"}],
            max_tokens=256,
            seed=seed,
            response_format=rf,
            extra_body=FAST,
        )
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_response_format_json_object_and_guided_fields(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "json"}],
        max_tokens=400,
        seed=1,
        response_format={"type": "json_object"},
        extra_body=FAST,
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(
        model=MODEL, prompt="n:", max_tokens=64, seed=2, extra_body={"guided_regex": REGEX, **FAST}
    )
    assert re.fullmatch(REGEX, r.choices[0].text)
    r = client.completions.create(
        model=MODEL, prompt="c:", max_tokens=16, seed=2, extra_body={"guided_choice": ["yes", "no"], **FAST}
    )
    assert r.choices[0].text in ("yes", "no")
    r = client.completions.create(
        model=MODEL,
        prompt="j:",
        max_tokens=200,
        seed=2,
        extra_body={
            "guided_json": {
                "type": "object",
                "properties": {"ok": {"type": "boolean"}},
                "required": ["ok"],
                "additionalProperties": False,
            },
            **FAST,
        },
    )
    assert json.loads(r.choices[0].text) in ({"ok": True}, {"ok": False})


def test_streaming_with_a_schema(client):
    rf = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "a pet"}],
        max_tokens=256,
        seed=7,
        response_format=rf,
        stream=True,
        extra_body=FAST,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1  # it streamed, block by block
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


def test_length_finish_is_a_valid_prefix(client):
    r = client.completions.create(
        model=MODEL, prompt="n:", max_tokens=3, seed=5, extra_body={"guided_regex": "[a-z]{20,30}", **FAST}
    )
    assert r.choices[0].finish_reason == "length" and re.fullmatch("[a-z]*", r.choices[0].text)


BAD = [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
        "response_format.json_schema.schema",
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?=a)"}},
            }
        },
        "response_format.json_schema.schema",
    ),  # look-around: unsupported
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}},
        "response_format.json_schema.schema",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}}},
        "response_format.json_schema.strict",
    ),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_grammar": "start: x"}, "guided_grammar"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"guided_regex": "a", "ignore_eos": True}, "ignore_eos"),
]


@pytest.mark.parametrize("extra, param", BAD)
def test_bad_structured_output_is_a_400_naming_it(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, extra_body=extra
        )
    assert e.value.body["param"] == param, e.value.body
    assert e.value.body["message"]


def test_server_stays_up_after_bad_grammars(client):
    r = client.completions.create(
        model=MODEL, prompt="n:", max_tokens=32, seed=1, extra_body={"guided_regex": "[0-9]{3}", **FAST}
    )
    assert re.fullmatch("[0-9]{3}", r.choices[0].text)


def test_structured_output_with_tools_is_refused(client):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    with pytest.raises(openai.BadRequestError, match="structured output and tools"):
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            tools=tools,
            response_format={"type": "json_object"},
        )


# ------------------------------------------------------------------------------------ dgemma run
def test_run_with_json_schema_and_regex(tmp_path, capsys):
    from dgemma.cli import main

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    assert main(["run", "a pet:", "--json-schema", str(schema), "--seed", "1", "--steps", "4"]) == 0
    jsonschema.validate(json.loads(capsys.readouterr().out), SCHEMA)
    assert main(["run", "x", "--regex", REGEX, "--seed", "2", "--steps", "4"]) == 0
    assert re.fullmatch(REGEX, capsys.readouterr().out.strip("\n"))


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--regex", "a("], "--regex: invalid regex"),
        (["--json-schema", "/no/such/file"], "cannot read"),
        (["--regex", "a", "--mode", "ar"], "engine's sampler only"),
        (["--regex", "a", "--json-schema", "s.json"], "give one of"),
    ],
)
def test_run_grammar_errors(argv, words, capsys):
    from dgemma.cli import main

    assert main(["run", "x", *argv]) == 2
    assert words in capsys.readouterr().err


# ------------------------------------------------------------------------------------ limits (serve/structured/limits.py)
# llguidance compiles recursively: what is too deep for it crashes the server (tests/serve/hostile/
# test_hostile_grammar.py sends such grammars to a server in a subprocess). The checks that
# refuse them first are pure Python, without recursion of their own.
def test_lark_stats_reads_rules_references_and_nesting():
    from dgemma.serve.structured.limits import lark_stats

    chain = "start: r0\n" + "".join(f'r{i}: "a" r{i + 1}\n' for i in range(3000)) + 'r3000: "b"\n'
    assert lark_stats(chain).rules == lark_stats(chain).depth == 3002
    grammar = textwrap.dedent("""
        start: ("a" (b | c)+)* // a comment: r9 ((((((
        ?b.2: /((a)[(b)])/ c "((((" r9
            | "x" b
        C: "c" D
        D: /[0-9]+/
        c: C | start
        %ignore D
    """)
    # start, b and c refer to each other (a cycle: counted once, 3 rules), then C, then D
    assert lark_stats(grammar) == LarkStats(len(grammar), 5, 5, 2)


def test_regex_nesting_skips_escapes_and_classes():
    from dgemma.serve.structured.limits import regex_nesting

    assert regex_nesting("((((a))))") == 4
    assert regex_nesting(r"\(\([(((]") == 1
    assert regex_nesting("[]]a[^]]") == 1 and regex_nesting("[a[b]]") == 2 and regex_nesting("abc") == 0


def test_longest_chain_collapses_cycles():
    from dgemma.serve.structured.limits import longest_chain

    assert longest_chain({1: [2], 2: [3, 1], 3: []}) == 3
    assert longest_chain({1: [1]}) == 1 and longest_chain({}) == 0
    assert longest_chain({i: [i + 1] for i in range(50000)} | {50000: []}) == 50001  # no recursion to overflow


def test_ref_depth_follows_pointers():
    from dgemma.serve.structured.limits import check_schema, ref_depth, schema_stats

    chain = {
        "$defs": {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(100)} | {"d100": {"type": "string"}},
        "$ref": "#/$defs/d0",
    }
    assert ref_depth(chain, schema_stats(chain, "s").refs) == 101
    loop = {"$defs": {"a": {"type": "object", "properties": {"next": {"$ref": "#/$defs/a"}}}}, "$ref": "#/$defs/a"}
    assert check_schema(loop, "s").refs and ref_depth(loop, schema_stats(loop, "s").refs) == 1
    anchors = {"properties": {"a": {"$ref": "#x"}, "b": {"$ref": "#y"}}}  # anchors: one link each, an upper bound
    assert ref_depth(anchors, schema_stats(anchors, "s").refs) == 2


def _deep(n: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(n):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


LIMITED = [
    (
        OutputFormat(
            "lark",
            "start: r0\n" + "".join(f'r{i}: "a" r{i + 1}\n' for i in range(5000)) + 'r5000: "b"\n',
            "guided_grammar",
        ),
        ["guided_grammar: 5002 levels of rule references; at most 5000 are allowed"],
    ),
    (
        OutputFormat("lark", 'start: "a"\n' + "".join(f'r{i}:"a"\n' for i in range(9000)), "guided_grammar"),
        ["9001 rules; at most 8192 are allowed"],
    ),
    (
        OutputFormat("lark", "start: " + "(" * 100 + '"a"' + ")" * 100, "guided_grammar"),
        ["100 levels of nested groups", "at most 64"],
    ),
    (OutputFormat("lark", 'start: "' + "a" * 140000 + '"', "guided_grammar"), ["140009 bytes", "at most 131072"]),
    (OutputFormat("lark", 'start: "\ud800"', "guided_grammar"), ["guided_grammar: holds a lone surrogate (U+D800)"]),
    (OutputFormat("regex", "(" * 65 + ")" * 65, "guided_regex"), ["65 levels of nested groups"]),
    (OutputFormat("regex", "a\udc00", "guided_regex"), ["lone surrogate (U+DC00) at character 1"]),
    (OutputFormat("json_schema", _deep(40), "guided_json"), ["levels of nesting", "at most 64"]),
    (OutputFormat("json_schema", json.dumps(_deep(40)), "guided_json"), ["levels of nesting", "at most 64"]),
    (OutputFormat("json_schema", '{"a":' * 5000 + "1" + "}" * 5000, "guided_json"), ["nested too deeply"]),
    (
        OutputFormat("json_schema", {"properties": {f"p{i}": {} for i in range(5000)}}, "guided_json"),
        ["5000 properties (or more); at most 2048 are allowed"],
    ),
    (OutputFormat("json_schema", {"enum": list(range(20000))}, "guided_json"), ["schema values", "at most 16384"]),
    (OutputFormat("json_schema", {"description": "x" * 300000}, "guided_json"), ["bytes", "at most 262144"]),
    (
        OutputFormat(
            "json_schema",
            {"$defs": {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(5000)}, "$ref": "#/$defs/d0"},
            "guided_json",
        ),
        ["5001 levels of $ref; at most 4096 are allowed"],
    ),
    (
        OutputFormat("json_schema", {"properties": {"\udfff": {}}}, "guided_json"),
        ["the text at properties.\\udfff holds a lone surrogate"],
    ),
]


@pytest.mark.parametrize("fmt, words", LIMITED, ids=range(len(LIMITED)))
def test_check_format_refuses_what_is_over_a_limit(fmt, words):
    from dgemma.serve.structured.formats import check_format

    with pytest.raises(StructuredError) as e:
        check_format(fmt)
    assert e.value.param == fmt.param
    for word in words:
        assert word in str(e.value), str(e.value)
    str(e.value).encode("utf-8")  # the message itself is valid text (it goes out as JSON)


def test_guided_choice_limits():
    with pytest.raises(StructuredError, match="5000 choices; at most 1024"):
        guided_format({"guided_choice": [f"c{i}" for i in range(5000)]})
    with pytest.raises(StructuredError, match="bytes of choices") as e:
        guided_format({"guided_choice": ["x" * 1000] * 100})
    with pytest.raises(StructuredError, match="lone surrogate") as e:
        guided_format({"guided_choice": ["ok", "n\ud800"]})
    assert e.value.param == "guided_choice[1]"


def test_start_with_stack_gives_the_thread_its_stack():
    """threads.start_with_stack: the thread gets the size asked for; the default is put back."""
    import ctypes
    import threading

    from dgemma.serve.threads import CompileWorker, start_thread

    libc = ctypes.CDLL(None)
    libc.pthread_self.restype = ctypes.c_ulong

    def own_stack() -> int:
        attr, addr, size = ctypes.create_string_buffer(256), ctypes.c_void_p(), ctypes.c_size_t()
        assert libc.pthread_getattr_np(ctypes.c_ulong(libc.pthread_self()), attr) == 0
        libc.pthread_attr_getstack(attr, ctypes.byref(addr), ctypes.byref(size))
        libc.pthread_attr_destroy(attr)
        return size.value

    sizes, before = [], threading.stack_size()
    start_thread(lambda: sizes.append(own_stack()), "big", 32 << 20).join()
    assert sizes[0] >= 32 << 20 and threading.stack_size() == before  # (glibc may reuse that stack for the next thread)
    worker = CompileWorker(stack_bytes=48 << 20)
    assert worker.submit(own_stack).result(10) >= 48 << 20
    with pytest.raises(ZeroDivisionError):  # raised on the worker, set on the future; the worker goes on
        worker.submit(lambda: 1 / 0).result(10)
    assert worker.submit(lambda: 7).result(10) == 7
    worker.close()


def test_a_compiled_grammar_is_copied_per_request(model):  # noqa: F811
    """The grammar compiles once (serve: on the compile thread); each request's state is a copy
    of its start state, and two requests do not share their progress."""
    grammar = model.compile_grammar("regex", "ab|ac")
    assert grammar.matcher is not None
    a, b = (model.grammars.canvas(grammar, model.config.canvas_length) for _ in range(2))
    tok = model.grammars.tokenizer
    assert a.commit(tok.tokenize_str("ab")) == 2
    assert a.complete and not b.complete and b.matcher is not grammar.matcher
    assert not grammar.matcher.is_accepting()  # the template never moves
