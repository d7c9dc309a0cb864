"""One-line errors for what can go wrong between a hub id and a checkpoint directory.

huggingface_hub raises its own exception per failure (repo, revision or file not found, a gated
repo, no network, offline mode, a full disk); `hub_errors` turns each into a HubError whose message
says what happened and what to do, so that the CLI prints one line and the API raises one readable
exception, never a traceback of the HTTP layer.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from contextlib import contextmanager


class HubError(ValueError):
    """A hub id that cannot become a checkpoint directory (the message is one line and says why)."""


class FitError(HubError):
    """A checkpoint whose memory plan does not fit the device (the message says what would)."""


def one_line(text: object, limit: int = 200) -> str:
    """`text` on one line, at most `limit` characters: for quoting a server's or the OS's words."""
    words = " ".join(str(text).split())
    return words if len(words) <= limit else words[: limit - 3] + "..."


def cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def not_cached(repo_id: str, revision: str | None, reason: BaseException | None = None) -> str:
    """Why a hub id cannot be used from the cache alone: offline mode, or the hub out of reach."""
    from huggingface_hub import constants, is_offline_mode

    at = repo_id + (f" (revision {revision})" if revision else "")
    if is_offline_mode():
        return (
            f"{at} is not in the cache ({cache_dir()}) and HF_HUB_OFFLINE=1 forbids downloading it: run "
            f"`dgemma pull {repo_id}` with network access first"
        )
    why = f" ({one_line(reason)})" if reason is not None and str(reason) else ""
    return f"cannot reach the hub at {constants.ENDPOINT}{why}, and {at} is not in the cache ({cache_dir()})"


def describe(error: BaseException, repo_id: str, revision: str | None = None, what: str | None = None) -> str | None:
    """The one-line message for a huggingface_hub (or network, or disk) error met while fetching
    `what` (a file name, or None) of `repo_id` at `revision`; None for an error this does not know."""
    import httpx2
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        DisabledRepoError,
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        NotASafetensorsRepoError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
        SafetensorsParsingError,
    )

    endpoint = constants.ENDPOINT
    at = repo_id + (f" at revision {revision}" if revision else "")
    if isinstance(error, GatedRepoError):
        status = getattr(getattr(error, "response", None), "status_code", None)
        token = "the token in HF_TOKEN has no access to it yet" if status == 403 else "no HF_TOKEN was sent"
        return (
            f"{repo_id} is gated ({token}): accept its license on {endpoint}/{repo_id} while signed in, then set "
            "HF_TOKEN to an access token of that account"
        )
    if isinstance(error, RepositoryNotFoundError):
        return (
            f"checkpoint directory {repo_id} does not exist, and the hub ({endpoint}) has no model repo {repo_id} "
            "(a private one needs HF_TOKEN)"
        )
    if isinstance(error, DisabledRepoError):
        return f"{repo_id} is disabled on the hub ({endpoint})"
    if isinstance(error, RevisionNotFoundError):
        return f"{repo_id} has no revision {revision!r} (a branch, tag or commit of the repo)"
    if isinstance(error, (LocalEntryNotFoundError, OfflineModeIsEnabled)):
        return not_cached(repo_id, revision, error.__cause__ or error.__context__)
    if isinstance(error, EntryNotFoundError):
        return f"{at} has no {what or 'such file'}"
    if isinstance(error, httpx2.TransportError):
        return f"cannot reach the hub at {endpoint} for {at}: {one_line(error) or type(error).__name__}"
    if isinstance(error, HfHubHTTPError):
        status = getattr(getattr(error, "response", None), "status_code", "an error")
        said = error.server_message or str(error).splitlines()[0]
        return f"the hub at {endpoint} answered {status} for {at}{f' ({what})' if what else ''}: {one_line(said)}"
    if isinstance(error, (NotASafetensorsRepoError, SafetensorsParsingError)):
        return f"{at}: {one_line(error)}"
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        return (
            f"no space left on the disk of the cache {cache_dir()} while downloading {repo_id}: free some "
            "(`dgemma rm` removes cached checkpoints) or set HF_HOME to a larger disk"
        )
    if isinstance(error, OSError):
        return f"cannot write {repo_id} to the cache {cache_dir()}: {one_line(error.strerror or error)}"
    return None


@contextmanager
def hub_errors(repo_id: str, revision: str | None = None, what: str | None = None) -> Iterator[None]:
    """Run the block, turning the errors `describe` knows into a HubError of one line."""
    try:
        yield
    except HubError:
        raise
    except Exception as error:  # noqa: BLE001 - describe() decides which it knows; the rest propagate
        message = describe(error, repo_id, revision, what)
        if message is None:
            raise
        raise HubError(message) from None
