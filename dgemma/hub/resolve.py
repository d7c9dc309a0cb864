"""From what the user typed (`--model`, `dgemma.load(...)`) to a local checkpoint directory.

An existing local path wins; otherwise a hub id (`owner/name`) is fetched into the Hugging Face
cache (fetch.py); otherwise "no such directory". Either way the fit check (fit.py) runs when the
caller says what it will load, before any weights are read or downloaded.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from pathlib import Path

from .checkpoint import Checkpoint, scheme_to_load
from .errors import HubError
from .fit import FitRequest, check_fit, local_facts

log = logging.getLogger("dgemma")

# huggingface_hub's repo id rules (utils/_validators.py), owner/name only: letters, digits, - _ .;
# no leading or trailing - or ., no "--" or "..", 96 characters at most
HUB_ID = re.compile(r"[A-Za-z0-9](?:[\w.-]*[A-Za-z0-9_])?/[A-Za-z0-9](?:[\w.-]*[A-Za-z0-9_])?")


def is_hub_id(ref: str) -> bool:
    """Whether `ref` has the shape of a hub model id, owner/name."""
    return bool(HUB_ID.fullmatch(ref)) and "--" not in ref and ".." not in ref and len(ref) <= 96


def resolve_checkpoint(
    ref: str | Path,
    revision: str | None = None,
    *,
    fit: FitRequest | None = None,
    force: bool = False,
    say: Callable[[str], None] | None = None,
) -> Checkpoint:
    """The local checkpoint `ref` names: a directory, or a hub id (fetched at `revision`, a branch,
    tag or commit; from the cache alone under HF_HUB_OFFLINE=1). With `fit`, the memory plan is
    checked first (FitError unless `force`) and "auto" becomes a scheme. `say` reports downloads
    (default: the "dgemma" logger)."""
    say = say or log.info
    path = Path(ref).expanduser()
    if path.exists():
        if not path.is_dir():
            raise FileNotFoundError(
                f"{path} is a file: a checkpoint is the directory that holds config.json, the weights and the tokenizer"
            )
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{path} is not a checkpoint directory: it has no config.json (a checkpoint is the directory "
                "that holds config.json, the weights and the tokenizer)"
            )
        if revision is not None:
            raise HubError(
                f"revision {revision!r}: {ref} is a local directory; a revision names a branch, tag or "
                "commit of a hub repo (owner/name)"
            )
        result = check_fit(local_facts(path), fit, force) if fit is not None else None
        if result is not None and not result.fits:
            say(f"warning: {result.message}")
        name = Path(os.path.abspath(path)).name  # `.` and `..` named as the directories they are
        return Checkpoint(path, name, quantization=scheme_to_load(result, fit), fit=result)
    text = str(ref)
    if not is_hub_id(text):
        raise FileNotFoundError(f"checkpoint directory {text} does not exist (nor is it a hub id owner/name)")
    from .fetch import fetch_checkpoint

    return fetch_checkpoint(text, revision, fit, force, say)
