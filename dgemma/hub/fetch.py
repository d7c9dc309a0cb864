"""A hub id to a checkpoint directory in the Hugging Face cache, with huggingface_hub: its cache
under HF_HOME, HF_TOKEN, its retrying (resuming) transfers and progress bars, HF_HUB_OFFLINE=1.

Only what dgemma reads is fetched: SIDE_FILES, the safetensors index and exactly the shards it
names (or model.safetensors). A `*.safetensors` pattern would also take a repo's `original/`
copies. Before any weights: config.json (is it a DiffusionGemma?), the quantisation config, the
index and, for a pre-quantised checkpoint, the shards' headers (Range requests, no weights); then
the fit check and the free disk.
"""

from __future__ import annotations

import glob
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..config import ConfigError, parse_model_config
from ..model.layout import INDEX_FILE, SINGLE_FILE, WeightsError, weight_files
from .checkpoint import Checkpoint, scheme_to_load
from .errors import HubError, cache_dir, hub_errors, not_cached
from .fit import CheckpointFacts, FitRequest, check_fit, hub_headers, local_facts, quant_info, read_json_file

ARCHITECTURE = "DiffusionGemmaForBlockDiffusion"
SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "processor_config.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "hf_quant_config.json",
)


def size_text(size: int) -> str:
    """Bytes as people read them: 51.6 GB, 20.1 MB, 512 kB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


class Unreachable(Exception):
    """The hub cannot be reached (no network, a proxy, a timeout): the cache may still serve."""


@dataclass(frozen=True)
class Snapshot:
    """A commit of a repo as dgemma reads it: the cache's snapshot directory and the files to fetch
    into it (name -> size on the hub)."""

    repo_id: str
    commit: str
    path: Path
    files: dict[str, int]
    weights: tuple[str, ...]

    @property
    def missing(self) -> dict[str, int]:
        return {name: size for name, size in self.files.items() if not (self.path / name).exists()}


def check_architecture(raw: dict, name: str) -> None:
    """HubError unless config.json describes a DiffusionGemma (said before any weights are fetched)."""
    archs = raw.get("architectures")
    if isinstance(archs, list) and archs and ARCHITECTURE not in archs:
        raise HubError(
            f"{name} is not a DiffusionGemma checkpoint: its config.json's architectures are "
            f"{', '.join(map(str, archs))}, not {ARCHITECTURE}"
        )
    try:
        parse_model_config(raw, where=f"{name}'s config.json")
    except ConfigError as e:
        raise HubError(str(e)) from None


def _root(error: BaseException) -> BaseException:
    """The first error of a chain (the network's, under huggingface_hub's wrapping)."""
    while error.__cause__ is not None:
        error = error.__cause__
    return error


def _unreachable(error: BaseException) -> bool:
    import httpx2
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

    return isinstance(error, (httpx2.TransportError, LocalEntryNotFoundError, OfflineModeIsEnabled))


def fetch_checkpoint(
    repo_id: str, revision: str | None, fit: FitRequest | None, force: bool, say: Callable[[str], None]
) -> Checkpoint:
    """The checkpoint of `repo_id` at `revision` (default main) in the cache, fetched if need be;
    from the cache alone in offline mode or when the hub cannot be reached."""
    from huggingface_hub import is_offline_mode

    if is_offline_mode():
        return cached_checkpoint(repo_id, revision, fit, force, say)
    try:
        snapshot = locate(repo_id, revision)
    except Unreachable as e:
        checkpoint = cached_checkpoint(repo_id, revision, fit, force, say, reason=e.__cause__)
        say(f"cannot reach the hub; using the cached {repo_id} (commit {checkpoint.commit[:7]})")
        return checkpoint
    return fetch_snapshot(snapshot, fit, force, say)


def locate(repo_id: str, revision: str | None) -> Snapshot:
    """The commit `revision` names, its config.json, index and quantisation config in the cache
    (small files), and the list of files to fetch, checked to be a DiffusionGemma's."""
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        # the repo and revision first, in one request: no network fails here at once (the file
        # download below retries for half a minute before it gives up)
        HfApi().model_info(repo_id, revision=revision)
        config_file = Path(hf_hub_download(repo_id, "config.json", revision=revision))
    except Exception as e:  # noqa: BLE001 - sorted below; hub_errors words what it knows
        if _unreachable(e):
            raise Unreachable(str(e)) from _root(e)
        if isinstance(e, EntryNotFoundError):
            raise HubError(f"{repo_id} is not a DiffusionGemma checkpoint: it has no config.json") from None
        with hub_errors(repo_id, revision, "config.json"):
            raise
    path, commit = config_file.parent, config_file.parent.name
    raw = read_json_file(config_file)
    check_architecture(raw, repo_id)
    on_hub = repo_files(repo_id, commit)
    with hub_errors(repo_id, commit):
        for name in ("hf_quant_config.json", INDEX_FILE):
            if name in on_hub:
                hf_hub_download(repo_id, name, revision=commit)
    weights = weight_names(path, on_hub, repo_id)
    absent = [name for name in weights if name not in on_hub]
    if absent:
        raise HubError(f"{repo_id}'s {INDEX_FILE} names {absent[0]}, which the repo does not have")
    files = {name: on_hub[name] for name in SIDE_FILES if name in on_hub}
    files.update({name: on_hub[name] for name in weights})
    return Snapshot(repo_id, commit, path, files, weights)


def repo_files(repo_id: str, commit: str) -> dict[str, int]:
    """The top-level files of a commit and their sizes: the tree the cache kept of an earlier
    download, else the hub's listing."""
    from huggingface_hub import HfApi, get_cached_repo_tree
    from huggingface_hub.errors import CachedRepoTreeNotFoundError
    from huggingface_hub.hf_api import RepoFile

    try:
        entries = get_cached_repo_tree(repo_id, revision=commit)
    except CachedRepoTreeNotFoundError:
        with hub_errors(repo_id, commit):
            try:
                entries = list(HfApi().list_repo_tree(repo_id, revision=commit))
            except Exception as e:
                if _unreachable(e):
                    raise Unreachable(str(e)) from _root(e)
                raise
    return {e.path: e.size for e in entries if isinstance(e, RepoFile) and "/" not in e.path}


def weight_names(path: Path, on_hub: dict[str, int], repo_id: str) -> tuple[str, ...]:
    """The shards the index in `path` names, or model.safetensors."""
    if INDEX_FILE in on_hub:
        weight_map = read_json_file(path / INDEX_FILE).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise HubError(f"{repo_id}'s {INDEX_FILE} has no weight_map")
        return tuple(sorted(set(map(str, weight_map.values()))))
    if SINGLE_FILE in on_hub:
        return (SINGLE_FILE,)
    raise HubError(f"{repo_id} has no safetensors weights ({SINGLE_FILE} or {INDEX_FILE})")


def hub_facts(snapshot: Snapshot) -> CheckpointFacts:
    """The fit check's facts before the download: the config files from the cache and, where they
    count (a pre-quantised checkpoint's weights), the shards' headers by Range requests."""
    from huggingface_hub import HfApi

    raw = read_json_file(snapshot.path / "config.json")
    config = parse_model_config(raw, where=f"{snapshot.repo_id}'s config.json")
    quant, tensors = quant_info(config.raw, snapshot.path), None
    if quant is not None:
        with hub_errors(snapshot.repo_id, snapshot.commit, "safetensors headers"):
            tensors = hub_headers(HfApi().get_safetensors_metadata(snapshot.repo_id, revision=snapshot.commit))
    return CheckpointFacts(snapshot.repo_id, snapshot.path, config, quant, tensors, from_hub=True)


def fetch_snapshot(snapshot: Snapshot, fit: FitRequest | None, force: bool, say: Callable[[str], None]) -> Checkpoint:
    """Check the fit (and the disk), then download what the snapshot lacks."""
    missing = snapshot.missing
    size = sum(missing.values())
    result = None
    if fit is not None:
        facts = hub_facts(snapshot) if missing else local_facts(snapshot.path, snapshot.repo_id)
        result = check_fit(facts, fit, force)
        if not result.fits:
            say(f"warning: {result.message}")
        elif missing:
            say(f"{snapshot.repo_id} {result.describe()}")
    if missing:
        check_disk(snapshot.repo_id, size, force)
        say(
            f"downloading {snapshot.repo_id} (commit {snapshot.commit[:7]}): {len(missing)} files, {size_text(size)} "
            f"into {cache_dir()}"
        )
        download(snapshot.repo_id, snapshot.commit, list(snapshot.files))
    scheme = scheme_to_load(result, fit)
    return Checkpoint(snapshot.path, snapshot.repo_id, snapshot.repo_id, snapshot.commit, scheme, result, size)


def download(repo_id: str, commit: str, names: list[str]) -> None:
    """Exactly `names` of `commit` into the cache (huggingface_hub's parallel, resuming transfers)."""
    from huggingface_hub import snapshot_download

    with hub_errors(repo_id, commit):
        snapshot_download(repo_id, revision=commit, allow_patterns=[glob.escape(name) for name in names])


def check_disk(repo_id: str, need: int, force: bool) -> None:
    """HubError when the cache's disk has less free space than the download needs (unless `force`)."""
    probe = Path(cache_dir())
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return
    if need > free and not force:
        raise HubError(
            f"{repo_id} needs {size_text(need)} in the cache {cache_dir()} and its disk has "
            f"{size_text(free)} free: free some (`dgemma rm`), set HF_HOME to a larger disk, "
            "or --force"
        )


def cached_checkpoint(
    repo_id: str,
    revision: str | None,
    fit: FitRequest | None,
    force: bool,
    say: Callable[[str], None],
    reason: BaseException | None = None,
) -> Checkpoint:
    """`repo_id` at `revision` from the cache alone (no request): complete, or a HubError."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    if not isinstance(found, str):
        raise HubError(not_cached(repo_id, revision, reason))
    path = Path(found).parent
    check_architecture(read_json_file(path / "config.json"), repo_id)
    try:
        weight_files(path)
    except WeightsError as e:
        raise HubError(
            f"the cached {repo_id} (commit {path.name[:7]}) is incomplete ({e}): run `dgemma pull "
            f"{repo_id}` with network access"
        ) from None
    result = check_fit(local_facts(path, repo_id), fit, force) if fit is not None else None
    if result is not None and not result.fits:
        say(f"warning: {result.message}")
    return Checkpoint(path, repo_id, repo_id, path.name, scheme_to_load(result, fit), result)


def pull_checkpoint(
    repo_id: str, revision: str | None, fit: FitRequest | None, force: bool, say: Callable[[str], None]
) -> tuple[Checkpoint, str]:
    """`dgemma pull`: the checkpoint fetched as `fetch_checkpoint` does (from the cache alone when
    offline or out of reach), then verified; and what the verification saw."""
    from huggingface_hub import is_offline_mode

    snapshot, reason = None, None
    if not is_offline_mode():
        try:
            snapshot = locate(repo_id, revision)
        except Unreachable as e:
            reason = e.__cause__
    if snapshot is None:
        checkpoint = cached_checkpoint(repo_id, revision, fit, force, say, reason)
        if reason is not None:
            say(f"cannot reach the hub; checking the cached {repo_id} (commit {checkpoint.commit[:7]})")
        weights = tuple(sorted({f.name for f in weight_files(checkpoint.path).values()}))
        return checkpoint, verify(repo_id, checkpoint.path, weights, None)
    checkpoint = fetch_snapshot(snapshot, fit, force, say)
    return checkpoint, verify(repo_id, snapshot.path, snapshot.weights, snapshot.files)


def verify(repo_id: str, path: Path, weights: tuple[str, ...], sizes: dict[str, int] | None) -> str:
    """HubError unless every file is there with the hub's size (when known) and every weight
    file's safetensors header parses; else what was checked, in words."""
    from safetensors import safe_open

    for name, size in (sizes or {name: None for name in weights}).items():
        file = path / name
        if not file.is_file():
            raise HubError(
                f"{repo_id}: {name} is missing from {path} after the download; run `dgemma pull {repo_id}` again"
            )
        if size is not None and file.stat().st_size != size:
            raise HubError(
                f"{repo_id}: {name} has {file.stat().st_size} bytes, the hub's has {size}: remove it with "
                f"`dgemma rm {repo_id}` and pull it again"
            )
    for name in weights:
        try:
            with safe_open(path / name, framework="pt") as f:
                f.keys()
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise HubError(f"{repo_id}: {name} is not a readable safetensors file ({e})") from None
    total = sum((path / name).stat().st_size for name in weights)
    checked = "sizes as on the hub, " if sizes is not None else ""
    return f"{len(weights)} weight file{'s' * (len(weights) != 1)} ({size_text(total)}), {checked}headers parse"
