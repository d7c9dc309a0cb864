"""The fake hub (tests/hub/fake_hub.py) speaks huggingface_hub's protocol: the real client, run in a subprocess with
HF_ENDPOINT pointing at it (the client reads it at import), downloads, resumes, pins revisions, reads safetensors
headers, maps errors to its exception classes and works offline from its cache. And each pre-quantised fixture
build (tests/hub/hub_repos.py), downloaded through the hub path, reads as its scheme and, loaded by its hub id
(`dgemma.load("owner/name")`), generates.

One hub for the module; three processes: the client online (its report feeds most tests), the client offline,
and dgemma loading the pre-quantised builds by hub id."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_hub import FakeHub
from hub_repos import INDEX_FILE, ORIGINAL, QUANTIZED_REPOS, tensors_of, tiny_repo

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

TINY_ID, GATED_ID, PRIVATE_ID = "google/dgemma-tiny", "google/dgemma-gated", "someone/private-tiny"
TOKEN = "hf_fixture_token"
ALLOW = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    INDEX_FILE,
    "model-*-of-*.safetensors",
    "hf_quant_config.json",
]
CUT_FILE, CUT_AFTER = "model-00001-of-00002.safetensors", 10 * 2**20 + 2**19  # past the client's first 10 MiB chunk

# Runs in the subprocess: every call of the client the tests look at, each result or error in one JSON report.
CLIENT = r"""
import hashlib, json, os, sys
args = json.loads(sys.argv[1])
from huggingface_hub import HfApi, get_safetensors_metadata, hf_hub_download, scan_cache_dir, snapshot_download
from huggingface_hub.constants import DOWNLOAD_CHUNK_SIZE

def digests(folder):
    out = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            out[os.path.relpath(path, folder)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return out

def attempt(call):
    try:
        result = call()
        return {"ok": result if isinstance(result, (str, int, list, dict)) else repr(result)}
    except Exception as error:
        return {"error": [c.__name__ for c in type(error).__mro__], "message": str(error)}

def text(path):
    return open(path).read()

tiny, report = args["tiny"], {"chunk": DOWNLOAD_CHUNK_SIZE}
snapshot = snapshot_download(tiny, allow_patterns=args["allow"])
report["snapshot"], report["files"] = snapshot, digests(snapshot)
report["offline_config"] = attempt(lambda: text(hf_hub_download(tiny, "config.json")))
if not args["online"]:
    report["not_cached"] = attempt(lambda: hf_hub_download(tiny, args["never"]))
    print(json.dumps(report))
    sys.exit(0)
api = HfApi()
info = api.model_info(tiny)
report["sha"], report["siblings"] = info.sha, sorted(s.rfilename for s in info.siblings)
report["safetensors_total"] = info.safetensors.total if info.safetensors else None
report["sha_at"] = {rev: api.model_info(tiny, revision=rev).sha for rev in ("main", "v1", args["old_sha"])}
report["readme_at"] = {rev: text(hf_hub_download(tiny, "README.md", revision=rev))
                       for rev in ("main", "v1", args["old_sha"], args["old_sha"][:12])}
report["tree"] = sorted((e.path, type(e).__name__) for e in api.list_repo_tree(tiny, recursive=True))
report["tree_original"] = sorted(e.path for e in api.list_repo_tree(tiny, path_in_repo="original"))
report["lfs"] = {e.path: e.lfs is not None for e in api.list_repo_tree(tiny) if hasattr(e, "lfs")}
metadata = get_safetensors_metadata(args["quantized"][0])
report["metadata"] = {"sharded": metadata.sharded, "files": sorted(metadata.files_metadata),
                      "dtypes": sorted({t.dtype for f in metadata.files_metadata.values() for t in f.tensors.values()}),
                      "tensors": len(metadata.weight_map)}
nobody, gated, private = "nobody/nothing", args["gated"], args["private"]
report["errors"] = {
    "repo": attempt(lambda: hf_hub_download(nobody, "config.json")),
    "repo_with_token": attempt(lambda: hf_hub_download(nobody, "config.json", token="hf_other")),
    "private": attempt(lambda: hf_hub_download(private, "config.json")),
    "revision": attempt(lambda: hf_hub_download(tiny, "config.json", revision="no-such-branch")),
    "entry": attempt(lambda: hf_hub_download(tiny, "no-such-file.json")),
    "gated": attempt(lambda: hf_hub_download(gated, "config.json")),
    "gated_wrong_token": attempt(lambda: hf_hub_download(gated, "config.json", token="hf_wrong")),
    "snapshot_repo": attempt(lambda: snapshot_download(nobody)),
    "snapshot_revision": attempt(lambda: snapshot_download(tiny, revision="no-such-branch")),
    "info_repo": attempt(lambda: api.model_info(nobody)),
    "info_revision": attempt(lambda: api.model_info(tiny, revision="no-such-branch")),
}
report["gated_with_token"] = attempt(lambda: text(hf_hub_download(gated, "config.json", token=args["token"])))
report["private_with_token"] = attempt(lambda: text(hf_hub_download(private, "config.json", token=args["token"])))
report["quantized"] = {repo: snapshot_download(repo, allow_patterns=args["allow"]) for repo in args["quantized"]}
report["cache"] = {r.repo_id: {"files": r.nb_files, "size": r.size_on_disk, "refs": sorted(r.refs)}
                   for r in scan_cache_dir().repos}
print(json.dumps(report))
"""


def run_client(hub: FakeHub, home: Path, online: bool, **args) -> dict:
    """The client script in a fresh process: HF_ENDPOINT = the fake hub, HF_HOME = `home`, no token, no Xet."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env.update(
        HF_ENDPOINT=hub.url,
        HF_HOME=str(home),
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_DISABLE_XET="1",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        HF_HUB_OFFLINE="0" if online else "1",
    )
    payload = json.dumps(dict(args, online=online, tiny=TINY_ID, allow=ALLOW))
    done = subprocess.run([sys.executable, "-c", CLIENT, payload], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def hub():
    with FakeHub() as hub:
        yield hub


@pytest.fixture(scope="module")
def repos(hub) -> dict:
    """The repos on the hub: dgemma-tiny at two commits (tag v1 on the first; main at the second, whose README
    differs), a gated and a private copy of its config, and the three pre-quantised builds."""
    tiny = tiny_repo()
    old = dict(tiny, **{"README.md": b"# the first commit\n"})
    old_sha = hub.add_repo(TINY_ID, old)
    hub.add_tag(TINY_ID, "v1", old_sha)
    new_sha = hub.add_repo(TINY_ID, tiny)
    hub.add_repo(GATED_ID, {"config.json": tiny["config.json"]}, gated=True, token=TOKEN)
    hub.add_repo(PRIVATE_ID, {"config.json": tiny["config.json"]}, private=True, token=TOKEN)
    quantized = {}
    for layout, (repo_id, build, scheme) in QUANTIZED_REPOS.items():
        files = build()
        hub.add_repo(repo_id, files)
        quantized[layout] = (repo_id, files, scheme)
    return {"tiny": tiny, "old": old, "old_sha": old_sha, "new_sha": new_sha, "quantized": quantized}


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf_home")


@pytest.fixture(scope="module")
def online(hub, repos, home) -> dict:
    """The client's first use: the report, and what the hub saw (requests, bytes) during it."""
    hub.cut_next_get(TINY_ID, CUT_FILE, CUT_AFTER)
    report = run_client(
        hub,
        home,
        online=True,
        old_sha=repos["old_sha"],
        gated=GATED_ID,
        private=PRIVATE_ID,
        token=TOKEN,
        quantized=[repo_id for repo_id, _, _ in repos["quantized"].values()],
    )
    return {"report": report, "requests": list(hub.requests), "bytes": dict(hub.bytes_served)}


def test_snapshot_fetches_what_it_asked_for(repos, online):
    """allow_patterns: exactly the allowed files, byte for byte (README.md is not among them); the `original/` copy
    a `*.safetensors` glob would take is never asked for."""
    report, tiny = online["report"], repos["tiny"]
    wanted = {p for p in tiny if p in ALLOW or (p.startswith("model-") and p.endswith(".safetensors"))}
    assert (
        set(report["files"])
        == wanted
        == {*ALLOW[:5], "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    )
    assert all(report["files"][p] == sha256(tiny[p]) for p in wanted)
    assert Path(report["snapshot"]).name == repos["new_sha"]
    assert not [p for _, p in online["requests"] if ORIGINAL in p]
    assert f"{TINY_ID}/{ORIGINAL}" not in online["bytes"]
    assert ("GET", f"/api/models/{TINY_ID}/revision/main") in online["requests"]
    tree = f"/api/models/{TINY_ID}/tree/{repos['new_sha']}?recursive=true"
    assert any(p.startswith(tree) for _, p in online["requests"])


def test_interrupted_download_resumes_with_a_range_request(repos, online):
    """The connection dropped 10.5 MiB into the 11.4 MiB shard: the client kept its first 10 MiB chunk and fetched
    the rest with a Range request (206): the file is whole, and the bytes sent are the cut part plus the rest."""
    report, size = online["report"], len(repos["tiny"][CUT_FILE])
    chunk = report["chunk"]
    assert chunk < CUT_AFTER < size
    assert report["files"][CUT_FILE] == sha256(repos["tiny"][CUT_FILE])
    assert online["bytes"][f"{TINY_ID}/{CUT_FILE}"] == CUT_AFTER + size - chunk < size + CUT_AFTER
    gets = [p for m, p in online["requests"] if m == "GET" and p.startswith(f"/{TINY_ID}/") and p.endswith(CUT_FILE)]
    assert len(gets) == 2


def test_model_info_tree_and_revisions(repos, online):
    """Model info carries the commit sha and siblings; a tag, a full and a short commit sha pin the first commit;
    main resolves to the latest; the tree lists files (LFS for shards) and directories, recursive or not."""
    report, old_sha, new_sha = online["report"], repos["old_sha"], repos["new_sha"]
    assert report["sha"] == new_sha and report["siblings"] == sorted(repos["tiny"])
    assert report["sha_at"] == {"main": new_sha, "v1": old_sha, old_sha: old_sha}
    readme = repos["tiny"]["README.md"].decode()
    assert report["readme_at"] == {
        "main": readme,
        "v1": "# the first commit\n",
        old_sha: "# the first commit\n",
        old_sha[:12]: "# the first commit\n",
    }
    assert report["tree"] == sorted([[p, "RepoFile"] for p in repos["tiny"]] + [["original", "RepoFolder"]])
    assert report["tree_original"] == [ORIGINAL]
    assert report["lfs"][CUT_FILE] and not report["lfs"]["config.json"]
    parameters = sum(t.numel() for t in tensors_of(repos["tiny"]).values())  # the shards' headers, as the hub counts
    assert report["safetensors_total"] == parameters > 9_000_000


def test_safetensors_metadata_of_a_sharded_quantised_build(online):
    meta = online["report"]["metadata"]
    assert meta["sharded"] and meta["files"] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert {"F8_E4M3", "BF16"} <= set(meta["dtypes"]) and meta["tensors"] > 100


@pytest.mark.parametrize(
    "case, exception, status",
    [
        ("repo", "RepositoryNotFoundError", "401"),
        ("repo_with_token", "RepositoryNotFoundError", "404"),
        ("private", "RepositoryNotFoundError", "401"),
        ("revision", "RevisionNotFoundError", "404"),
        ("entry", "EntryNotFoundError", "404"),
        ("gated", "GatedRepoError", "401"),
        ("gated_wrong_token", "GatedRepoError", "403"),
        ("snapshot_repo", "RepositoryNotFoundError", "401"),
        ("snapshot_revision", "RevisionNotFoundError", "404"),
        ("info_repo", "RepositoryNotFoundError", "401"),
        ("info_revision", "RevisionNotFoundError", "404"),
    ],
)
def test_errors_map_to_the_clients_exceptions(online, case, exception, status):
    """X-Error-Code (and 401 for an unknown repo without a token, as the hub answers) -> huggingface_hub's classes."""
    error = online["report"]["errors"][case]
    assert "error" in error, error
    assert exception in error["error"], error
    if exception == "RepositoryNotFoundError":
        assert "GatedRepoError" not in error["error"]
    assert error["message"].startswith(status) or f"{status} Client Error" in error["message"], error["message"]
    if exception == "RevisionNotFoundError":
        assert "Invalid rev id: no-such-branch" in error["message"]  # X-Error-Message reaches the user


def test_gated_and_private_repos_open_to_their_token(repos, online):
    config = repos["tiny"]["config.json"].decode()
    assert online["report"]["gated_with_token"] == {"ok": config}
    assert online["report"]["private_with_token"] == {"ok": config}


def test_offline_second_use_is_served_from_the_cache(hub, repos, home, online):
    """HF_HUB_OFFLINE=1: the same snapshot from the cache with no request to the hub; a file never fetched (the
    `original/` copy) is a LocalEntryNotFoundError."""
    before = len(hub.requests)
    report = run_client(hub, home, online=False, never=ORIGINAL)
    assert len(hub.requests) == before
    assert report["snapshot"] == online["report"]["snapshot"]
    assert online["report"]["files"].items() <= report["files"].items()  # (README.md came later, by revision)
    assert report["offline_config"] == {"ok": repos["tiny"]["config.json"].decode()}
    assert "LocalEntryNotFoundError" in report["not_cached"]["error"]


def test_the_cache_scan_sees_every_download(repos, online):
    cache = online["report"]["cache"]
    assert set(cache) == {TINY_ID, GATED_ID, PRIVATE_ID, *(r for r, _, _ in repos["quantized"].values())}
    tiny = cache[TINY_ID]
    assert "main" in tiny["refs"] and "v1" in tiny["refs"]
    assert tiny["size"] >= sum(len(repos["tiny"][p]) for p in online["report"]["files"])


@pytest.mark.parametrize("layout", list(QUANTIZED_REPOS))
def test_prequantised_build_downloads_and_reads_as_its_scheme(repos, online, layout):
    """Each published layout's fixture, fetched by the client with the allow-list: the files it names arrive byte
    for byte (recipe.yaml and README.md do not), and dgemma reads the config as the scheme it is."""
    from dgemma.quant.read import read_quantized

    repo_id, files, scheme = repos["quantized"][layout]
    path = Path(online["report"]["quantized"][repo_id])
    got = {p.name for p in path.iterdir()}
    assert got == {p for p in files if p in ALLOW or p.startswith("model-")}
    assert "recipe.yaml" not in got and "README.md" not in got
    assert all(sha256((path / p).read_bytes()) == sha256(files[p]) for p in got)
    info, weights = read_quantized(path)
    method = "modelopt" if layout.startswith("modelopt") else "compressed-tensors"
    assert (info.quant_method, info.scheme) == (method, scheme)
    assert {name.rpartition(".")[2] for name in weights.disk_names} == PARTS[layout]
    weights.close()


PARTS = {  # the parts of a quantised module, as each producer names them
    "fp8-dynamic": {"weight", "weight_scale"},
    "nvfp4": {"weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"},
    "modelopt-nvfp4": {"weight", "weight_scale", "weight_scale_2", "input_scale"},
}

LOAD = r"""
import json, sys, torch
torch.set_num_threads(1)  # the tiny model's ops are too small to share between threads
import dgemma
out = {}
for repo in json.loads(sys.argv[1]):
    model = dgemma.load(repo)
    tokens = model.generate(["The capital of France is"], max_new_tokens=4, seed=0, max_denoising_steps=2).sequences[0]
    out[repo] = {"name": model.name, "quantization": list(model.net.quantization), "tokens": tokens,
                 "vocab": model.config.vocab_size}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def loaded_by_hub_id(hub, repos, tmp_path_factory) -> dict:
    """`dgemma.load("owner/name")` of each pre-quantised build in one process, with an empty cache: dgemma's own
    hub path fetches it; the report and the files the hub served meanwhile."""
    ids = [repo_id for repo_id, _, _ in repos["quantized"].values()]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env.update(
        HF_ENDPOINT=hub.url,
        HF_HOME=str(tmp_path_factory.mktemp("hf_home_load")),
        HF_HUB_DISABLE_XET="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
    )
    before = len(hub.requests)
    done = subprocess.run(
        [sys.executable, "-c", LOAD, json.dumps(ids)], env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]
    fetched: dict[str, set[str]] = {repo_id: set() for repo_id in ids}
    for method, path in hub.requests[before:]:
        for repo_id in ids:
            if method == "GET" and path.startswith(f"/{repo_id}/resolve/"):
                fetched[repo_id].add(path.split("/resolve/", 1)[1].split("/", 1)[1])
    return {"report": json.loads(done.stdout.strip().splitlines()[-1]), "fetched": fetched}


@pytest.mark.parametrize("layout", list(QUANTIZED_REPOS))
def test_prequantised_build_loads_by_hub_id_and_generates(repos, loaded_by_hub_id, layout):
    """Through dgemma's hub path: only the files dgemma reads are fetched (the index's shards, config, tokenizer,
    ModelOpt's hf_quant_config.json; not recipe.yaml or README.md), the model runs quantised as its scheme, is
    named by its repo id, and generates."""
    repo_id, files, scheme = repos["quantized"][layout]
    assert loaded_by_hub_id["fetched"][repo_id] == {p for p in files if p in ALLOW or p.startswith("model-")}
    got = loaded_by_hub_id["report"][repo_id]
    assert got["name"] == repo_id and got["quantization"][0] == scheme
    assert 1 <= len(got["tokens"]) <= 4 and all(0 <= t < got["vocab"] for t in got["tokens"])
