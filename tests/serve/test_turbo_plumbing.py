"""Where turbo denoising is chosen (engine/turbo.py does it): the server's per-request `turbo`
field and knobs, `dgemma serve --turbo` as their default, usage and /metrics counting decoder
positions, draft frames marking frozen positions, the CLI flags, and the bench's turbo row.

The server tests run on conftest's tiny random model, whose positions rarely converge: they
force freezing (`turbo_freeze_passes` 1, a freeze entropy above any entropy), so a request that
runs several passes computes fewer than passes x canvas positions. The CLI and bench tests run
on the shipped dgemma-tiny (trained: its positions freeze at the default knobs)."""

import json
import logging
import re

import httpx
import pytest
import torch

import dgemma
from dgemma.cli import build_parser, main
from dgemma.loading import default_model_dir
from dgemma.serve.app import create_app
from dgemma.serve.http.listener import ServerThread
from servers import MODEL  # conftest.py's session fixtures: `model` (tiny, random) and its `server`

FAST = {"max_denoising_steps": 6, "ignore_eos": True}
FREEZE = {"turbo_freeze_passes": 1, "turbo_freeze_entropy": 100.0}  # freezes what is accepted once


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


def completion(url: str, prompt: str, **fields) -> dict:
    r = post(url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 32, "seed": 3, **FAST, **fields})
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def metric(url: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", httpx.get(url + "/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.fixture(scope="module")
def turbo_server(model):
    """`model` served with turbo on by default (`dgemma serve --turbo` and two knobs)."""
    app = create_app(model, MODEL, max_active=2, max_queue=4, sampler={"turbo": True, **FREEZE})
    with ServerThread(app) as s:
        yield s


# ------------------------------------------------------------------------------------ the server
def test_the_turbo_field_computes_fewer_positions_and_metrics_count_them(model, server):
    c = model.config.canvas_length
    before = metric(server.url, "dgemma_decoder_positions_total")
    exact = completion(server.url, "turbo plumbing: exact", turbo=False)
    turbo = completion(server.url, "turbo plumbing: exact", turbo=True, **FREEZE)
    assert exact["decoder_passes"] > 1 and turbo["decoder_passes"] > 1  # several passes: something can freeze
    assert exact["decoder_positions"] == exact["decoder_passes"] * c
    assert 0 < turbo["decoder_positions"] < turbo["decoder_passes"] * c
    assert list(turbo).index("decoder_positions") == list(turbo).index("decoder_passes") + 1
    grown = metric(server.url, "dgemma_decoder_positions_total") - before
    assert grown >= exact["decoder_positions"] + turbo["decoder_positions"]
    assert "# TYPE dgemma_decoder_positions_total counter" in httpx.get(server.url + "/metrics").text


def test_serve_turbo_is_the_default_and_a_request_turns_it_off(model, turbo_server):
    c = model.config.canvas_length
    card = httpx.get(turbo_server.url + "/v1/models").json()["data"][0]
    assert card["sampler_defaults"]["turbo"] is True
    default = completion(turbo_server.url, "turbo plumbing: default")
    off = completion(turbo_server.url, "turbo plumbing: default", turbo=False)
    assert default["decoder_positions"] < default["decoder_passes"] * c
    assert off["decoder_positions"] == off["decoder_passes"] * c
    chat = post(
        turbo_server.url,
        "/v1/chat/completions",
        {"model": MODEL, "max_tokens": 32, "seed": 3, **FAST, "messages": [{"role": "user", "content": "turbo chat"}]},
    )
    usage = chat.json()["usage"]
    assert chat.status_code == 200 and usage["decoder_positions"] < usage["decoder_passes"] * c


def test_turbo_goes_with_insert_mode_logprobs_and_structured_output(model, server):
    c = model.config.canvas_length
    body = {
        "model": MODEL,
        "prompt": "def turbo(",
        "suffix": ")\n",
        "span_length": 5,
        "max_tokens": 8,
        "seed": 3,
        "max_denoising_steps": 6,
        "turbo": True,
        **FREEZE,
    }
    r = post(server.url, "/v1/completions", body)
    usage = r.json()["usage"]
    assert r.status_code == 200 and usage["span_length"] == 5, r.text
    assert 0 < usage["decoder_positions"] < usage["decoder_passes"] * c
    r = post(
        server.url,
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": "turbo plumbing: logprobs",
            "max_tokens": 32,
            "seed": 3,
            "logprobs": 2,
            "turbo": True,
            **FAST,
            **FREEZE,
        },
    )
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["tokens"]) == 32, r.text
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "turbo json"}],
        "max_tokens": 32,
        "seed": 3,
        "max_denoising_steps": 6,
        "response_format": {"type": "json_object"},
        "turbo": True,
        **FREEZE,
    }
    r = post(server.url, "/v1/chat/completions", body)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"].lstrip().startswith("{"), r.text


BAD_FIELDS = [
    ("turbo", "yes"),
    ("turbo", 1),
    ("turbo_freeze_passes", 0),
    ("turbo_freeze_passes", 1.5),
    ("turbo_freeze_passes", True),
    ("turbo_freeze_entropy", -0.5),
    ("turbo_freeze_entropy", "low"),
    ("turbo_refresh_every", -1),
    ("turbo_refresh_every", 5000),
    ("turbo_dormant_entropy", -0.5),
    ("turbo_dormant_entropy", "high"),
    ("turbo_dormant_entropy", 1e7),
]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_bad_turbo_fields_are_400s_naming_the_field(server, chat):
    for name, value in BAD_FIELDS:
        body = {"model": MODEL, "max_tokens": 8, name: value}
        body |= {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
        r = post(server.url, "/v1/chat/completions" if chat else "/v1/completions", body)
        assert r.status_code == 400, (name, value, r.text)
        error = r.json()["error"]
        assert error["param"] == name and name in error["message"], error


def test_ollama_options_take_turbo(server):
    body = {
        "model": MODEL,
        "prompt": "turbo plumbing: ollama",
        "raw": True,
        "stream": False,
        "options": {"num_predict": 8, "max_denoising_steps": 2, "turbo": True, "turbo_freeze_passes": 1},
    }
    r = post(server.url, "/api/generate", body)
    assert r.status_code == 200 and r.json()["done"] is True, r.text
    for option, value, words in (
        ("turbo", "yes", 'option "turbo" must be of type boolean'),
        ("turbo_freeze_passes", 0, "options.turbo_freeze_passes"),
        ("turbo_dormant_entropy", -1.0, "options.turbo_dormant_entropy"),
    ):
        r = post(server.url, "/api/generate", {**body, "options": {option: value}})
        assert r.status_code == 400 and words in r.json()["error"], r.text


def draft_frames(url: str, prompt: str, **fields) -> list[dict]:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 32,
        "seed": 4,
        "stream": True,
        "stream_drafts": True,
        **FAST,
        **fields,
    }
    frames = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                draft = json.loads(line[6:])["choices"][0].get("draft")
                frames += [draft] if draft else []
    return frames


def test_draft_frames_mark_frozen_positions_only_with_turbo(model, server):
    c = model.config.canvas_length
    exact = draft_frames(server.url, "turbo plumbing: drafts")
    assert exact and all("frozen" not in f for f in exact)
    assert list(exact[0]) == ["block", "step", "text", "tokens", "pieces", "accepted", "entropy"]  # as before
    turbo = draft_frames(server.url, "turbo plumbing: drafts", turbo=True, **FREEZE)
    assert turbo and all(len(f["frozen"]) == c and all(isinstance(x, bool) for x in f["frozen"]) for f in turbo)
    assert any(any(f["frozen"]) for f in turbo)
    for earlier, later in zip(turbo, turbo[1:]):  # a frozen position stays frozen (and its token) within its block
        if earlier["block"] == later["block"]:
            for i, frozen in enumerate(earlier["frozen"]):
                if frozen:
                    assert later["frozen"][i] and later["tokens"][i] == earlier["tokens"][i]


# ------------------------------------------------------------------------------------ the command line
def test_the_turbo_flags_parse_on_run_chat_serve_and_bench():
    parser = build_parser()
    for argv in (["run", "x"], ["chat"], ["serve"]):
        assert parser.parse_args(argv).turbo is None  # absent: the checkpoint's default
        args = parser.parse_args(
            [
                *argv,
                "--turbo",
                "--turbo-freeze-passes",
                "3",
                "--turbo-freeze-entropy",
                "0.1",
                "--turbo-refresh-every",
                "4",
                "--turbo-dormant-entropy",
                "2.5",
            ]
        )
        assert (
            args.turbo,
            args.turbo_freeze_passes,
            args.turbo_freeze_entropy,
            args.turbo_refresh_every,
            args.turbo_dormant_entropy,
        ) == (True, 3, 0.1, 4, 2.5)
    from dgemma.cli.bench import resolve_settings
    from dgemma.cli.common import fit_request

    for argv, turbo in ((["serve"], False), (["serve", "--turbo"], True), (["bench", "--turbo"], True)):
        assert (
            fit_request(parser.parse_args(argv), torch.device("cpu")).turbo is turbo
        )  # the memory plan counts its K/V buffers

    args = parser.parse_args(["bench", "--quick", "--turbo"])
    resolve_settings(args, 32)
    assert args.peers == ["default", "turbo", "ar"]  # its row beside dgemma's
    args = parser.parse_args(["bench", "--quick", "--turbo-freeze-passes", "3"])
    with pytest.raises(ValueError, match="--turbo-freeze-passes .* needs --turbo"):
        resolve_settings(args, 32)


def test_chat_sets_turbo_and_underlines_frozen_positions(model, capsys):
    from dgemma.cli.chat import Session, canvas_frame

    session = Session(model, None, {}, 0, canvas=False, tty=False)
    session.command("/set turbo on")
    assert session.knobs == {"turbo": True}
    session.command("/set turbo maybe")
    assert "/set turbo: 'on', 'off' or 'default'" in capsys.readouterr().err and session.knobs == {"turbo": True}
    session.command("/set turbo default")
    assert session.knobs == {}
    styles = [str(span.style) for span in canvas_frame(["a", "b"], [True, True], [0.0, 0.0], [True, False]).spans]
    assert "underline" in styles[0] and "underline" not in styles[1]
    assert all("underline" not in str(span.style) for span in canvas_frame(["a"], [True], [0.0]).spans)


def test_reference_sampling_refuses_turbo_in_one_line(capsys):
    for argv, why in ((["--sampling", "reference"], "--sampling reference"), (["--mode", "ar"], "--mode ar")):
        assert main(["run", "x", "--turbo", *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"dgemma: error: --turbo does not go with {why}"), err


def test_a_bad_turbo_knob_is_refused_by_its_flag_before_loading(capsys):
    logger = logging.getLogger("dgemma")
    level = logger.level
    try:  # cmd_serve sets the dgemma logger's level (--log-level) first
        assert main(["serve", "--turbo", "--turbo-freeze-passes", "0"]) == 2
    finally:
        logger.setLevel(level)
    err = capsys.readouterr().err
    assert err == "dgemma: error: --turbo-freeze-passes must be an integer >= 1 (got 0)\n"


@pytest.mark.slow
def test_run_turbo_on_dgemma_tiny(capsys):
    assert main(["run", "import os\n", "--turbo", "--max-new-tokens", "16", "--seed", "1"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() and "decoder positions (" in err.splitlines()[-1]
    assert main(["run", "import os\n", "--turbo-freeze-passes", "3", "--max-new-tokens", "1", "-q"]) == 2
    assert "--turbo-freeze-passes is a knob of turbo denoising: it needs --turbo" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ the bench's row
@pytest.mark.slow
def test_bench_turbo_row_reports_positions_per_token():
    from dgemma.benchmark import run_dgemma, summarize

    tiny = dgemma.load(default_model_dir(), dtype="float32")
    prompts = [tiny.tokenizer.encode("def fib(n):\n")]
    c = tiny.config.canvas_length
    exact = run_dgemma(tiny, prompts, 2 * c, 16, False, "diffusion")
    turbo = run_dgemma(tiny, prompts, 2 * c, 16, False, "diffusion", turbo={})
    assert (exact.peer, turbo.peer) == ("dgemma", "dgemma-turbo")
    assert (
        exact.decoder_positions == exact.decoder_passes * c * len(prompts) and exact.positions_per_token == 16
    )  # 16 passes of c per c tokens
    assert turbo.decoder_positions < exact.decoder_positions
    rows = {r["peer"]: r for r in summarize([exact, turbo])}
    assert rows["dgemma-turbo"]["positions_per_token"] < rows["dgemma"]["positions_per_token"]
    assert "x_vs_dgemma" in rows["dgemma-turbo"] and "x_vs_dgemma" not in rows["dgemma"]
