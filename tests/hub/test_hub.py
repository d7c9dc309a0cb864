"""Hub ids wherever a model is named (dgemma/hub/, `dgemma pull | list | rm`), against the fake hub.

huggingface_hub reads HF_ENDPOINT, HF_HOME and HF_HUB_OFFLINE when it is imported, so its real
download code runs in subprocesses: one runs the online steps in order (each a `dgemma.cli.main`
call with its stdout and stderr captured: the exit code and the one-line errors are what a shell
sees), a second the offline ones against the same cache. The fake hub (tests/hub/fake_hub.py) lives in
this process and counts what was asked of it. The fit check and the error texts are also tested in
process, on local directories.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import uuid
from dataclasses import replace
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from fake_hub import FakeHub
from hub_repos import ORIGINAL, tiny_repo
from safetensors.torch import save

import dgemma
from dgemma.hub import FitError, FitRequest, HubError, is_hub_id, resolve_checkpoint
from dgemma.hub.fit import DEVICE_MEMORY_ENV, check_fit, local_facts, plan_for
from dgemma.model.checkpoint import config_json, make_config
from dgemma.model.presets import PRESETS

ROOT = Path(__file__).resolve().parents[2]
TINY, BIG, BIG2, GATED, NOT_DG, FP8 = (
    "dgemma/tiny",
    "dgemma/big",
    "dgemma/big2",
    "dgemma/gated",
    "meta/llama",
    "dgemma/tiny-fp8",
)
SHARD = "model-00001-of-00002.safetensors"
TOKEN = "hf_letmein"
SMALL_DEVICE = "1.2GiB"  # the `mid` size's plan for one request on a CPU: unquantised 1.7 GiB, fp8 1.3, int4 1.1
CUT_AFTER = 10 * 2**20 + 2**19  # past the client's first 10 MiB chunk (it keeps whole chunks), within the 12 MB shard

# Runs the steps of argv[1] (JSON) in one process, each a dgemma.cli.main call (or a dgemma.load),
# its stdout/stderr captured and any escaping exception's traceback kept; writes them to argv[2].
DRIVER = r"""
import contextlib, io, json, os, sys, time, traceback
from dgemma.cli import main
results = {}
for step in json.loads(sys.argv[1]):
    os.environ.update(step.get("env", {}))
    out, err, code, trace, started = io.StringIO(), io.StringIO(), None, None, time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            if "load" in step:
                import dgemma
                model = dgemma.load(step["load"])
                print(model.name, model.path)
                code = 0
            else:
                code = main(step["argv"])
        except SystemExit as e:
            code = e.code
        except BaseException:
            trace = traceback.format_exc()
    for name in step.get("env", {}):
        os.environ.pop(name, None)
    results[step["name"]] = {"code": code, "out": out.getvalue(), "err": err.getvalue(), "trace": trace,
                             "seconds": time.perf_counter() - started}
with open(sys.argv[2], "w") as f:
    json.dump(results, f)
"""


def fake_safetensors(value: float = 0.0) -> bytes:
    return save({"x": torch.full((4,), value)})


def config_bytes(preset: str, **extra) -> bytes:
    return (json.dumps({**config_json(make_config(**PRESETS[preset])), "dtype": "bfloat16", **extra}) + "\n").encode()


def big_repo() -> dict[str, bytes]:
    """config.json of the `mid` size (its plan is made in a blink, unlike the released size's);
    two tiny shards: their headers parse, nothing loads them."""
    index = {
        "metadata": {},
        "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"},
    }
    return {
        "config.json": config_bytes("mid"),
        "model.safetensors.index.json": json.dumps(index).encode(),
        "model-00001-of-00002.safetensors": fake_safetensors(1.0),
        "model-00002-of-00002.safetensors": fake_safetensors(2.0),
    }


def fp8_repo() -> dict[str, bytes]:
    """A pre-quantised build as the fit check sees it: config.json's compressed-tensors block and
    shards whose headers hold fp8 codes and scales (a layout of its own is tests/hub/hub_repos.py's)."""
    from dgemma.quant.quant_config import quantization_config

    shards, weight_map = {}, {}
    for i in (1, 2):
        module = f"model.decoder.layers.{i}.mlp.down_proj"
        tensors = {
            f"{module}.weight": torch.zeros(64, 128, dtype=torch.float8_e4m3fn),
            f"{module}.weight_scale": torch.ones(64, 1),
            f"model.decoder.layers.{i}.norm": torch.ones(64),
        }
        file = f"model-0000{i}-of-00002.safetensors"
        shards[file] = save(tensors)
        weight_map.update(dict.fromkeys(tensors, file))
    return {
        "config.json": config_bytes("test", quantization_config=quantization_config("fp8")),
        "model.safetensors.index.json": json.dumps({"metadata": {}, "weight_map": weight_map}).encode(),
        **shards,
    }


@pytest.fixture(scope="module")
def hub():
    with FakeHub() as fake:
        tiny = tiny_repo()
        old = fake.add_repo(TINY, tiny)
        fake.add_tag(TINY, "v1", old)
        generation = dict(json.loads(tiny["generation_config.json"]), fixture_commit=2)  # main moves on
        newer = dict(tiny, **{"generation_config.json": json.dumps(generation).encode()})
        fake.add_repo(TINY, newer)
        fake.add_repo(BIG, big_repo())
        fake.add_repo(BIG2, big_repo())
        small = {"config.json": config_bytes("test"), "model.safetensors": fake_safetensors()}
        fake.add_repo(GATED, small, gated=True, token=TOKEN)
        fake.add_repo(NOT_DG, dict(small, **{"config.json": b'{"architectures": ["LlamaForCausalLM"]}'}))
        fake.add_repo(FP8, fp8_repo())
        fake.v1, fake.tiny_files = old, tiny
        yield fake


def driver_env(endpoint: str, home: Path, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.lower().endswith("_proxy") and not k.startswith(("HF_", "HUGGING")) and k != DEVICE_MEMORY_ENV
    }
    env.update(
        HF_ENDPOINT=endpoint,
        HF_HOME=str(home),
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_DISABLE_XET="1",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        NO_PROXY="127.0.0.1,localhost",
        **extra,
    )
    return env


def drive(endpoint: str, home: Path, steps: list[dict], **extra: str) -> dict[str, dict]:
    """Run `steps` in one process against the hub at `endpoint`, with the cache in `home`."""
    out = home / f"results-{uuid.uuid4().hex}.json"
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(steps), str(out)],
        cwd=ROOT,
        env=driver_env(endpoint, home, **extra),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and out.is_file() and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    for name, r in results.items():
        assert r["trace"] is None, f"{name}: {r['trace']}"
    return results


def step(name: str, *argv: str, **env: str) -> dict:
    return {"name": name, "argv": list(argv), "env": env}


ONLINE = [
    step("list-empty", "list"),
    step("pull", "pull", TINY),  # its first shard's transfer is cut half-way (see `online`)
    step("pull-v1", "pull", TINY, "--revision", "v1"),
    step("unknown", "pull", "nobody/nothing"),
    step("run-unknown", "run", "--model", "nobody/nothing", "hi"),
    step("gated", "pull", GATED),
    step("gated-token", "pull", GATED, HF_TOKEN=TOKEN),
    step("no-revision", "pull", TINY, "--revision", "nope"),
    step("not-dgemma", "pull", NOT_DG),
    step("too-big", "pull", BIG, **{DEVICE_MEMORY_ENV: SMALL_DEVICE}),
    step("run-too-big", "run", "--model", BIG, "hi", **{DEVICE_MEMORY_ENV: SMALL_DEVICE}),
    step("forced", "pull", BIG2, "--force", **{DEVICE_MEMORY_ENV: SMALL_DEVICE}),
    step("auto", "pull", BIG2, "--quantization", "auto", **{DEVICE_MEMORY_ENV: SMALL_DEVICE}),
    step("pull-fp8", "pull", FP8),
    step("list", "list", **{DEVICE_MEMORY_ENV: SMALL_DEVICE}),
    step("rm-v1", "rm", TINY, "--revision", "v1"),
    step("rm-v1-again", "rm", TINY, "--revision", "v1"),
    step("rm-unknown", "rm", "nobody/nothing"),
    step("list-after-rm", "list"),
]


@pytest.fixture(scope="module")
def online(hub, tmp_path_factory):
    home = tmp_path_factory.mktemp("hf-home")
    hub.shard_size = len(hub.tiny_files[SHARD])
    assert CUT_AFTER < hub.shard_size
    hub.cut_next_get(TINY, SHARD, after=CUT_AFTER)
    results = drive(hub.url, home, ONLINE)
    return home, results


@pytest.fixture(scope="module")
def offline(hub, online):
    home, _ = online
    before = len(hub.requests)
    results = drive(
        hub.url,
        home,
        [
            step("run", "run", "--model", TINY, "def f", "--max-new-tokens", "4", "--steps", "2", "--seed", "0"),
            {"name": "load", "load": TINY},
            step("unknown", "pull", "nobody/nothing"),
            step("uncached-revision", "run", "--model", TINY, "--revision", "v1", "hi"),
        ],
        HF_HUB_OFFLINE="1",
    )
    return results, hub.requests[before:]


@pytest.fixture(scope="module")
def unreachable(hub, online):
    """No hub at all (a closed port): the cached checkpoint still serves, an uncached one is one line."""
    home, _ = online
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    return drive(closed, home, [step("cached", "pull", TINY), step("uncached", "pull", "nobody/nothing")])


def one_line(result: dict) -> str:
    """The error of a step that failed as a user mistake should: exit 2, one line, nothing on stdout."""
    err = result["err"]
    assert result["code"] == 2 and err.startswith("dgemma: error:") and err.count("\n") == 1, result
    assert "Traceback" not in err and not result["out"], result
    return err


def hub_paths(hub: FakeHub, repo_id: str, method: str = "GET") -> list[str]:
    return [path for m, path in hub.requests if m == method and f"/{repo_id}/resolve/" in path]


# ------------------------------------------------------------------------------------------ online
@pytest.mark.slow
@pytest.mark.subprocess
def test_first_use_downloads_only_what_dgemma_reads(hub, online):
    home, r = online
    assert r["list-empty"]["code"] == 0 and "no DiffusionGemma checkpoints" in r["list-empty"]["err"]
    pull = r["pull"]
    assert pull["code"] == 0 and "verified: 2 weight files" in pull["err"], pull
    assert "sizes as on the hub" in pull["err"]
    path = Path(pull["out"].rsplit(" is in ", 1)[1].strip())
    assert path.is_dir() and path.is_relative_to(home)
    got = sorted(p.name for p in path.iterdir())
    assert got == sorted(
        [
            "config.json",
            "generation_config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "model.safetensors.index.json",
            SHARD,
            "model-00002-of-00002.safetensors",
        ]
    )
    fetched = " ".join(hub_paths(hub, TINY))
    assert "original" not in fetched and "README.md" not in fetched  # outside the allow-list: never asked for
    assert f"{TINY}/{ORIGINAL}" not in hub.bytes_served


@pytest.mark.slow
@pytest.mark.subprocess
def test_an_interrupted_download_resumes(hub, online):
    """The first shard's GET was cut 10.5 MiB in: the client kept its first 10 MiB chunk and asked
    for the rest with a Range request, so fewer bytes were sent than the cut part plus the whole
    file (a restart), and the shard is whole (`pull` verified its size and header)."""
    _, r = online
    assert r["pull"]["code"] == 0
    sent = hub.bytes_served[f"{TINY}/{SHARD}"]
    assert hub.shard_size <= sent < hub.shard_size + CUT_AFTER
    assert len([p for p in hub_paths(hub, TINY) if p.endswith(SHARD)]) == 2  # the cut GET and the ranged one


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_revision_pins_its_commit(hub, online):
    _, r = online
    assert r["pull-v1"]["code"] == 0 and f"(commit {hub.v1[:7]})" in r["pull-v1"]["out"]
    assert r["pull-v1"]["out"].strip().endswith(hub.v1)  # the snapshot of that commit, not main's
    assert hub.v1 not in r["pull"]["out"]  # main moved on


@pytest.mark.slow
@pytest.mark.subprocess
def test_hub_errors_are_one_line(online):
    _, r = online
    unknown = one_line(r["unknown"])
    assert "does not exist, and the hub" in unknown and "no model repo nobody/nothing" in unknown
    assert "no model repo nobody/nothing" in one_line(r["run-unknown"])
    gated = one_line(r["gated"])
    assert f"{GATED} is gated" in gated and "accept its license" in gated and "HF_TOKEN" in gated
    assert r["gated-token"]["code"] == 0, r["gated-token"]
    assert "has no revision 'nope'" in one_line(r["no-revision"])
    not_dgemma = one_line(r["not-dgemma"])
    assert "is not a DiffusionGemma checkpoint" in not_dgemma and "LlamaForCausalLM" in not_dgemma


@pytest.mark.slow
@pytest.mark.subprocess
def test_the_fit_check_refuses_before_any_shard_is_fetched(hub, online):
    _, r = online
    err = one_line(r["too-big"])
    assert f"{BIG} does not fit this device's 1.2 GiB" in err and "--quantization int4" in err and "--force" in err
    assert "--max-context" in err or "--max-active" in err or "int4" in err
    run = one_line(r["run-too-big"])
    assert "does not fit" in run and "--quantization int4" in run and "--max-context" not in run  # run has no such flag
    assert not [p for p in hub_paths(hub, BIG) if p.endswith(".safetensors")]  # not even a header
    assert not [p for p in hub_paths(hub, BIG, "HEAD") if p.endswith(".safetensors")]


@pytest.mark.slow
@pytest.mark.subprocess
def test_force_and_auto(hub, online):
    _, r = online
    forced = r["forced"]
    assert forced["code"] == 0 and "warning:" in forced["err"] and "does not fit" in forced["err"], forced
    assert all(f"{BIG2}/model-0000{i}-of-00002.safetensors" in hub.bytes_served for i in (1, 2))
    auto = r["auto"]
    assert auto["code"] == 0 and "--quantization auto: int4" in auto["err"], auto


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_pre_quantised_build_is_planned_from_its_headers(hub, online):
    _, r = online
    assert r["pull-fp8"]["code"] == 0, r["pull-fp8"]
    ranged = [p for p in hub_paths(hub, FP8) if p.endswith(".safetensors")]
    assert len(ranged) >= 4  # two header reads, then two downloads
    assert "fp8" in next(line for line in r["list"]["out"].splitlines() if line.startswith(FP8))
    from dgemma.devices import resolve_dtype

    facts = local_facts(Path(r["pull-fp8"]["out"].rsplit(" is in ", 1)[1].strip()))  # the headers, as the hub's were
    assert facts.quant.scheme == "fp8" and len(facts.tensors) == 6
    cpu = torch.device("cpu")
    plan = plan_for(facts, torch.bfloat16, None, FitRequest(cpu, partial(resolve_dtype, "auto", cpu)))
    codes, scales, norms = 64 * 128, 64 * 4, 64 * 2  # fp8 bytes as stored, float32 scales, a norm in bf16
    assert plan.weights == {"stored": 2 * (codes + scales + norms)} and plan.scheme == "fp8"


@pytest.mark.slow
@pytest.mark.subprocess
def test_list_and_rm(hub, online):
    _, r = online
    lines = r["list"]["out"].splitlines()
    assert r["list"]["code"] == 0 and lines[0].startswith("MODEL")
    assert "FITS cpu (1.2 GiB DGEMMA_DEVICE_MEMORY)" in lines[0]
    rows = {tuple(line.split()[:2]) for line in lines[1:]}
    assert (TINY, "v1") in rows and (TINY, "main") in rows and (BIG2, "main") in rows
    assert NOT_DG not in r["list"]["out"]  # not a DiffusionGemma
    tiny_main = next(line for line in lines if line.startswith(TINY) and " main " in line)
    assert "bfloat16" in tiny_main and tiny_main.rstrip().endswith("yes")
    big2 = next(line for line in lines if line.startswith(BIG2))
    assert big2.rstrip().endswith("with --quantization int4")
    assert r["rm-v1"]["code"] == 0 and f"removed {TINY} (v1 ({hub.v1[:7]}))" in r["rm-v1"]["out"]
    assert "has no cached revision 'v1'" in one_line(r["rm-v1-again"])
    assert "nobody/nothing is not in the cache" in one_line(r["rm-unknown"])
    after = {tuple(line.split()[:2]) for line in r["list-after-rm"]["out"].splitlines()}
    assert (TINY, "main") in after and (TINY, "v1") not in after


# ------------------------------------------------------------------------------------------ offline
@pytest.mark.slow
@pytest.mark.subprocess
def test_offline_from_the_cache(offline):
    r, requests = offline
    assert requests == []  # HF_HUB_OFFLINE=1: not one request
    assert r["run"]["code"] == 0 and r["run"]["out"].strip(), r["run"]
    name, path = r["load"]["out"].split()
    assert name == TINY and Path(path).parent.name == "snapshots"  # the served name is the id, not the hash
    assert "HF_HUB_OFFLINE=1" in one_line(r["unknown"]) and "dgemma pull nobody/nothing" in r["unknown"]["err"]
    assert "not in the cache" in one_line(r["uncached-revision"])  # removed by `rm --revision v1`


@pytest.mark.slow
@pytest.mark.subprocess
def test_without_a_network_the_cache_serves(unreachable):
    cached = unreachable["cached"]
    assert cached["code"] == 0 and "cannot reach the hub; checking the cached dgemma/tiny" in cached["err"], cached
    uncached = one_line(unreachable["uncached"])
    assert "cannot reach the hub" in uncached and "Connection refused" in uncached and "not in the cache" in uncached


def test_a_download_the_disk_cannot_hold_is_refused(monkeypatch):
    import shutil

    from dgemma.hub.fetch import check_disk

    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=10**9))
    with pytest.raises(HubError, match=r"owner/name needs 2000.0 GB in the cache .* has 1.0 GB free: .*--force"):
        check_disk("owner/name", 2 * 10**12, force=False)
    check_disk("owner/name", 2 * 10**12, force=True)  # --force: on, and the disk's own error if it fills


# ------------------------------------------------------------------------------------------ in process
def test_a_local_directory_wins_and_names_are_checked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "owner").mkdir()
    (tmp_path / "owner" / "name").symlink_to(dgemma.default_model_dir())
    checkpoint = resolve_checkpoint("owner/name")  # a hub id's shape, but a directory here: no hub asked
    assert checkpoint.path == Path("owner/name") and checkpoint.repo_id is None and checkpoint.name == "name"
    with pytest.raises(FileNotFoundError, match="does not exist .nor is it a hub id owner/name."):
        resolve_checkpoint(tmp_path / "missing")
    with pytest.raises(HubError, match="is a local directory"):
        resolve_checkpoint("owner/name", "main")
    assert is_hub_id("google/diffusiongemma-26B-A4B-it") and is_hub_id("RedHatAI/x-FP8-dynamic")
    assert not any(map(is_hub_id, ["/abs/path", "a/b/c", "./a", "name", "a--b/c", "a/b.", "a/.b"]))


def test_auto_picks_the_best_scheme_that_fits(monkeypatch):
    from dgemma.devices import resolve_dtype
    from dgemma.hub import fit

    cpu = torch.device("cpu")
    facts = local_facts(dgemma.default_model_dir())
    request = FitRequest(cpu, partial(resolve_dtype, "auto", cpu), "auto", flags=("--quantization", "--force"))
    totals = {s: plan_for(facts, torch.bfloat16, s, request).total for s in (None, "fp8", "int4")}
    assert totals[None] > totals["fp8"] > totals["int4"]
    assert check_fit(facts, replace(request, memory=totals[None])).scheme is None  # unquantised fits: it wins
    assert check_fit(facts, replace(request, memory=totals["fp8"])).scheme == "fp8"
    assert check_fit(facts, replace(request, memory=totals["int4"] + 1)).scheme == "int4"  # not fp8 or int8
    small = replace(request, memory=2**20)
    with pytest.raises(FitError, match="does not fit this device's 0.0 GiB .DGEMMA_DEVICE_MEMORY.*--force loads it"):
        check_fit(facts, small)
    forced = check_fit(facts, small, force=True)
    assert not forced.fits and forced.scheme == "nvfp4"  # the smallest, as asked
    monkeypatch.setattr(
        fit, "device_memory", lambda device, override=None, source=None: (totals["fp8"], "a small device")
    )
    with pytest.raises(FitError, match="it would fit with quantization='fp8' .*; force=True loads it anyway"):
        dgemma.load()  # the API's refusal names load()'s arguments


@pytest.mark.slow
def test_the_device_memory_override_is_checked(monkeypatch, capsys):
    from dgemma.cli import main

    monkeypatch.setenv(DEVICE_MEMORY_ENV, "lots")
    assert main(["run", "hi"]) == 2
    assert "DGEMMA_DEVICE_MEMORY: 'lots' is not a size" in capsys.readouterr().err
    monkeypatch.setenv(DEVICE_MEMORY_ENV, "1GiB")  # the shipped model plans at ~0.6 GiB on a CPU
    assert main(["run", "hi", "--max-new-tokens", "1", "--steps", "1", "-q"]) == 0
    monkeypatch.setenv(DEVICE_MEMORY_ENV, "100MB")
    assert main(["run", "hi"]) == 2
    assert "dgemma-tiny does not fit this device's 0.1 GiB" in capsys.readouterr().err


def test_a_pre_quantised_checkpoint_refuses_another_scheme():
    from dgemma.devices import resolve_dtype

    cpu = torch.device("cpu")
    facts = local_facts(dgemma.default_model_dir())
    quantised = type(facts)(facts.name, facts.config_dir, facts.config, quant=type("Q", (), {"scheme": "fp8"})())
    request = FitRequest(cpu, partial(resolve_dtype, "auto", cpu), "int4", flags=("--quantization",))
    with pytest.raises(HubError, match=r"is already quantised \(fp8\): load it without --quantization"):
        check_fit(quantised, request)


def test_errors_of_the_network_and_the_disk_are_one_line():
    import httpx2

    from dgemma.hub.errors import describe

    cases = [
        (httpx2.ConnectError("[Errno 111] Connection refused\n  more"), "cannot reach the hub at"),
        (OSError(errno.ENOSPC, "No space left on device"), "no space left on the disk of the cache"),
        (OSError(errno.EACCES, "Permission denied"), "cannot write owner/name to the cache"),
    ]
    for error, words in cases:
        text = describe(error, "owner/name", "main")
        assert words in text and "\n" not in text, text
    assert describe(KeyError("x"), "owner/name") is None  # not the hub's: propagates as it is


@pytest.mark.parametrize("flag", ["--max-context", "--max-active"])
def test_pull_refuses_a_plan_shape_below_one(flag, capsys):
    """`dgemma pull`'s planning flags are checked before any request to the hub."""
    from dgemma.cli import main

    assert main(["pull", "owner/name", flag, "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{flag} must be at least 1 (got 0)" in err
