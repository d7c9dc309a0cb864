"""LoRA adapters over the server (docs/server.md, "Adapters"): a request names its adapter as its
`model` (the official openai and ollama clients), /v1/models and /api/tags list them, adapters load
and unload at run time (off unless allowed, only from --lora-dir, behind the API key) while other
requests stream, and every bad input is one line that changes nothing."""

from __future__ import annotations

import threading
import time

import httpx
import ollama
import openai
import pytest

import dgemma
from adapter_files import write_adapter
from dgemma.model.checkpoint import make_config, make_tiny_random
from dgemma.model.presets import PRESETS
from dgemma.serve.app import create_app
from dgemma.serve.http.access import Access
from dgemma.serve.http.listener import ServerThread
from dgemma.serve.service import RuntimeLora
from dgemma.train import lora

BASE, KEY = "tiny-lora", "s3cret"
FAST = {"max_denoising_steps": 4, "ignore_eos": True}


@pytest.fixture(scope="module")
def lora_model(tmp_path_factory):
    """The micro random model with adapters 'a' and 'b' loaded; --lora-dir holds 'c' and bad ones."""
    root = tmp_path_factory.mktemp("lora")
    model = dgemma.load(make_tiny_random(root / "ckpt", seed=1))
    model.enable_adapters(max_loras=3, max_rank=8)
    model.add_adapter("a", write_adapter(root / "a", model.config, rank=8, alpha=16, seed=1, std=0.3))
    model.add_adapter("b", write_adapter(root / "b", model.config, rank=4, alpha=8, seed=2, std=0.3))
    directory = root / "dir"
    write_adapter(directory / "c", model.config, rank=4, alpha=8, seed=3, std=0.3)
    write_adapter(directory / "big", model.config, rank=16, seed=4)
    write_adapter(directory / "corrupt", model.config, seed=5)
    (directory / "corrupt" / lora.ADAPTER_WEIGHTS).write_bytes(b'\x08\x00\x00\x00\x00\x00\x00\x00{"a": 1}')
    write_adapter(directory / "other", make_config(**dict(PRESETS["micro"], hidden_size=96)), seed=6)  # another base
    write_adapter(root / "outside", model.config, seed=7)
    model.lora_root = root
    return model


@pytest.fixture(scope="module")
def lora_server(lora_model):
    app = create_app(
        lora_model,
        BASE,
        max_active=8,
        max_queue=8,
        access=Access(api_key=KEY),
        runtime_lora=RuntimeLora(True, lora_model.lora_root / "dir"),
    )
    with ServerThread(app) as s:
        s.app = app
        s.client = openai.OpenAI(base_url=s.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        s.http = httpx.Client(base_url=s.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
        yield s


def complete(server, model: str, prompt: str = "Once upon a time", seed: int = 1, max_tokens: int = 32):
    return server.client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, seed=seed, extra_body=FAST
    )


def models(server) -> dict:
    return {m["id"]: m for m in server.http.get("/v1/models").json()["data"]}


def test_models_lists_the_base_and_each_adapter(lora_server):
    listed = models(lora_server)
    assert list(listed) == [BASE, "a", "b"]
    assert listed[BASE]["parent"] is None
    assert all(listed[n]["parent"] == BASE and listed[n]["lora_rank"] in (8, 4) for n in "ab")
    assert lora_server.http.get("/v1/models/b").json()["parent"] == BASE
    assert [m.id for m in lora_server.client.models.list()] == [BASE, "a", "b"]


def test_the_openai_client_picks_an_adapter_by_name(lora_server, lora_model):
    answers = {name: complete(lora_server, name) for name in (BASE, "a", "b")}
    assert {name: a.model for name, a in answers.items()} == {n: n for n in answers}
    texts = {name: a.choices[0].text for name, a in answers.items()}
    assert len(set(texts.values())) == 3  # each adapter changes the answer
    assert complete(lora_server, "a").choices[0].text == texts["a"]  # ... the same one every time
    chat = lora_server.client.chat.completions.create(
        model="b", messages=[{"role": "user", "content": "hi"}], max_tokens=32, seed=2, extra_body=FAST
    )
    assert chat.model == "b" and chat.choices[0].message.content is not None


def test_the_ollama_client_picks_an_adapter_by_name(lora_server):
    client = ollama.Client(host=lora_server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    listed = [m.model for m in client.list().models]
    assert listed == [f"{BASE}:latest", "a:latest", "b:latest"]
    options = {"seed": 1, "num_predict": 32, "max_denoising_steps": 4, "ignore_eos": True}
    answers = {n: client.generate(model=n, prompt="Once upon a time", raw=True, options=options) for n in listed}
    assert len({a.response for a in answers.values()}) == 3
    openai_a = complete(lora_server, "a", seed=1).choices[0].text
    assert answers["a:latest"].response == openai_a  # the same request on either API, the same text


def test_an_unknown_model_is_a_404_naming_the_served_ones(lora_server):
    with pytest.raises(openai.NotFoundError, match=r"this server serves 'tiny-lora', 'a', 'b'"):
        complete(lora_server, "nope")
    client = ollama.Client(host=lora_server.url, headers={"Authorization": f"Bearer {KEY}"})
    with pytest.raises(ollama.ResponseError, match="model 'nope' not found") as e:
        client.generate(model="nope", prompt="hi")
    assert e.value.status_code == 404


def load(server, name: str, path: str, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(
        server.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}, headers=headers, timeout=60
    )


def unload(server, name: str) -> httpx.Response:
    return server.http.post("/v1/unload_lora_adapter", json={"lora_name": name})


@pytest.mark.parametrize(
    ("name", "path", "status", "says"),
    [
        ("x", "../outside", 400, "outside the adapter directory --lora-dir"),
        ("x", "/etc", 400, "outside the adapter directory --lora-dir"),
        ("x", "missing", 400, "no adapter directory missing in"),
        ("x", "corrupt", 400, "is not a readable safetensors file"),
        ("x", "big", 400, "rank 16 is above the largest rank served here (8, --max-lora-rank)"),
        ("x", "other", 400, "this base needs"),
        ("a", "c", 400, "an adapter named 'a' is loaded already"),
        (BASE, "c", 400, "is the base model's name"),
        ("bad name", "c", 400, "adapter name 'bad name'"),
    ],
)
def test_bad_runtime_loads_are_one_line_and_change_nothing(lora_server, name, path, status, says):
    before = models(lora_server)
    r = load(lora_server, name, path)
    assert r.status_code == status, r.text
    message = r.json()["error"]["message"]
    assert says in message and "\n" not in message
    assert models(lora_server) == before
    assert complete(lora_server, "a").model == "a"  # still serving


def test_runtime_loading_needs_the_key_and_strict_bodies(lora_server):
    assert load(lora_server, "c", "c", key=None).status_code == 401
    r = lora_server.http.post("/v1/load_lora_adapter", json={"lora_name": "c"})
    assert r.status_code == 400 and "lora_path" in r.json()["error"]["message"]
    r = lora_server.http.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": "c", "extra": 1})
    assert r.status_code == 400 and "unknown field 'extra'" in r.json()["error"]["message"]
    r = unload(lora_server, "never-loaded")
    assert r.status_code == 404 and "no adapter named 'never-loaded' is loaded" in r.json()["error"]["message"]


def _stream_text(
    server, model: str, seed: int, max_tokens: int, started: threading.Event | None = None, steps: int = 4
) -> str:
    stream = server.client.completions.create(
        model=model,
        prompt="Tell me a story",
        max_tokens=max_tokens,
        seed=seed,
        stream=True,
        extra_body=FAST | {"max_denoising_steps": steps},
    )
    text = ""
    for chunk in stream:
        if started is not None:
            started.set()
        if chunk.choices:
            text += chunk.choices[0].text
    return text


def test_load_and_unload_while_other_requests_stream(lora_server):
    alone = _stream_text(lora_server, BASE, seed=4, max_tokens=96)
    results, started = {}, threading.Event()
    base = threading.Thread(target=lambda: results.setdefault("base", _stream_text(lora_server, BASE, 4, 96, started)))
    base.start()
    assert started.wait(60)
    r = load(lora_server, "c", "c")  # loading never stalls the stream beside it
    assert r.status_code == 200 and r.json()["status"] == "loaded", r.text
    assert list(models(lora_server)) == [BASE, "a", "b", "c"]
    c_alone = complete(lora_server, "c", max_tokens=32).choices[0].text
    # unloading 'c' while a request runs on it: refused to new requests at once, done when it ends
    started_c, timing = threading.Event(), {}

    def on_c():
        results["c"] = _stream_text(lora_server, "c", 5, 256, started_c, steps=32)
        timing["c ended"] = time.monotonic()

    def do_unload():
        timing["response"] = unload(lora_server, "c")
        timing["unloaded"] = time.monotonic()

    runner, unloader = threading.Thread(target=on_c), threading.Thread(target=do_unload)
    runner.start()
    assert started_c.wait(60)
    unloader.start()
    jobs = lora_server.app.state.service.engine_thread
    deadline = time.monotonic() + 30
    while not jobs.draining("c") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert runner.is_alive() and jobs.adapter_jobs("c") == 1  # the unload was asked while 'c' ran
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        complete(lora_server, "c")
    for thread in (runner, unloader, base):
        thread.join(120)
    assert timing["response"].status_code == 200 and timing["response"].json()["status"] == "unloaded"
    assert timing["unloaded"] >= timing["c ended"] - 0.2  # it waited for the request on 'c'
    assert len(results["c"]) > 0 and results["base"] == alone  # the base stream never noticed
    assert list(models(lora_server)) == [BASE, "a", "b"]
    assert load(lora_server, "c", "c").status_code == 200  # a freed slot takes it again
    assert complete(lora_server, "c", max_tokens=32).choices[0].text == c_alone
    assert unload(lora_server, "c").status_code == 200


def test_runtime_loading_is_off_unless_allowed(lora_model):
    app = create_app(lora_model, BASE, max_active=2, max_queue=2)
    with ServerThread(app) as s:
        r = httpx.post(s.url + "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": "c"}, timeout=30)
        assert r.status_code == 404 and "--allow-runtime-lora" in r.json()["error"]["message"]
        assert [m["id"] for m in httpx.get(s.url + "/v1/models").json()["data"]] == [BASE, "a", "b"]


def test_allowing_runtime_loading_needs_a_directory(tmp_path):
    with pytest.raises(ValueError, match="--allow-runtime-lora needs --lora-dir"):
        RuntimeLora(True, None)
    with pytest.raises(ValueError, match="is not a directory"):
        RuntimeLora(True, tmp_path / "nope")


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--lora", "x=/nowhere/at/all"], "adapter directory /nowhere/at/all does not exist"),
        (["--lora", "big={dir}/big", "--max-lora-rank", "8"], "rank 16 is above the largest rank served here (8,"),
        (["--lora", "other={dir}/other"], "this base needs"),
        (["--lora", "a={dir}/c", "--lora", "a={dir}/c"], "--lora names an adapter twice: a"),
        (["--lora", "a={dir}/c", "--lora", "b={dir}/c", "--max-loras", "1"], "2 --lora adapters but --max-loras 1"),
        (["--allow-runtime-lora"], "--allow-runtime-lora needs --lora-dir"),
        (["--lora", "bad name={dir}/c"], "adapter name 'bad name'"),
    ],
)
def test_serve_refuses_a_bad_lora_flag_in_one_line(lora_model, capsys, argv, says):
    from dgemma.cli import main

    directory = str(lora_model.lora_root / "dir")
    argv = [a.replace("{dir}", directory) for a in argv]
    code = main(["serve", "--model", str(lora_model.path), "--port", "0", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and says in err and len(err.splitlines()) == 1, err


def test_run_takes_a_lora_and_refuses_it_with_ar(lora_model, capsys):
    from dgemma.cli import main

    path, model = str(lora_model.lora_root / "a"), str(lora_model.path)
    common = [
        "run",
        "--model",
        model,
        "Once upon a time",
        "--seed",
        "1",
        "--max-new-tokens",
        "32",
        "--steps",
        "4",
        "-q",
    ]
    assert main(common + ["--lora", path]) == 0
    adapted = capsys.readouterr().out
    assert main(common) == 0
    assert capsys.readouterr().out != adapted
    assert main(common + ["--lora", path, "--mode", "ar"]) == 2
    assert "--lora works with the engine's sampler only" in capsys.readouterr().err
