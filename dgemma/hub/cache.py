"""The DiffusionGemma checkpoints the Hugging Face cache holds (`dgemma list`) and their removal
(`dgemma rm`), over huggingface_hub's own cache scan and deletion strategy: the same cache, and
the same bookkeeping of blobs shared between revisions, as `hf cache ls` / `hf cache rm`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .errors import HubError, cache_dir
from .fetch import ARCHITECTURE


@dataclass(frozen=True)
class CachedCheckpoint:
    """One cached revision of a DiffusionGemma repo."""

    repo_id: str
    commit: str
    refs: tuple[str, ...]  # branches and tags that point at it
    path: Path  # the snapshot directory
    size: int  # bytes on disk of its files
    scheme: str  # its quantisation scheme, else its stored dtype
    complete: bool  # every weight file its index names is there

    @property
    def label(self) -> str:
        """`main (1a2b3c4)`, or the short commit of a revision no branch or tag names."""
        return f"{', '.join(self.refs)} ({self.commit[:7]})" if self.refs else self.commit[:7]


def scan():
    """huggingface_hub's HFCacheInfo of the cache (HF_HOME), or None when there is no cache yet."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        return scan_cache_dir()
    except CacheNotFound:
        return None


def describe_scheme(raw: dict, path: Path) -> str:
    """A checkpoint's quantisation scheme (fp8, int4, nvfp4, ...), else its stored dtype."""
    from ..config import ConfigError
    from ..model.weights import config_dtype
    from .fit import quant_info

    try:
        info = quant_info(raw, path)
    except (ConfigError, ValueError):
        return "quantised (unreadable config)"
    if info is not None:
        return info.scheme
    dtype = config_dtype(raw)
    return str(dtype).removeprefix("torch.") if dtype is not None else "unquantised"


def _complete(path: Path) -> bool:
    from ..model.layout import WeightsError, weight_files

    try:
        weight_files(path)
    except (WeightsError, OSError):
        return False
    return True


def cached_checkpoints() -> list[CachedCheckpoint]:
    """Every cached revision whose config.json names the DiffusionGemma architecture, by repo id,
    newest revision first."""
    info = scan()
    out = []
    for repo in sorted(info.repos if info else (), key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        for rev in sorted(repo.revisions, key=lambda r: -r.last_modified):
            try:
                raw = json.loads((rev.snapshot_path / "config.json").read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if not isinstance(raw, dict) or ARCHITECTURE not in (raw.get("architectures") or ()):
                continue
            out.append(
                CachedCheckpoint(
                    repo.repo_id,
                    rev.commit_hash,
                    tuple(sorted(rev.refs)),
                    rev.snapshot_path,
                    rev.size_on_disk,
                    describe_scheme(raw, rev.snapshot_path),
                    _complete(rev.snapshot_path),
                )
            )
    return out


def remove(repo_id: str, revision: str | None = None) -> tuple[list[str], int]:
    """Delete `repo_id` from the cache (only `revision`, a branch, tag or commit prefix, if given)
    with the cache's own deletion strategy; the labels of what went, and the bytes freed."""
    info = scan()
    repo = next((r for r in (info.repos if info else ()) if r.repo_type == "model" and r.repo_id == repo_id), None)
    if repo is None:
        raise HubError(f"{repo_id} is not in the cache ({cache_dir()}); `dgemma list` shows what is")
    revisions = list(repo.revisions)
    if revision is not None:
        prefix = len(revision) >= 4
        revisions = [r for r in revisions if revision in r.refs or (prefix and r.commit_hash.startswith(revision))]
        if not revisions:
            cached = ", ".join(_label(r) for r in repo.revisions) or "none"
            raise HubError(f"{repo_id} has no cached revision {revision!r} (cached: {cached})")
    strategy = info.delete_revisions(*(r.commit_hash for r in revisions))
    try:
        strategy.execute()
    except OSError as e:
        raise HubError(f"cannot remove {repo_id} from the cache {cache_dir()}: {e.strerror or e}") from None
    return [_label(r) for r in revisions], strategy.expected_freed_size


def _label(rev) -> str:
    refs = ", ".join(sorted(rev.refs))
    return f"{refs} ({rev.commit_hash[:7]})" if refs else rev.commit_hash[:7]
