"""Hugging Face hub ids wherever a model is named: `resolve_checkpoint` turns a directory or an
`owner/name` id into a local checkpoint (fetching only the files dgemma reads, after checking the
memory plan fits the device); cache.py lists and removes what the cache holds.

huggingface_hub is imported inside the functions that use it: a local directory never needs it.
"""

from .checkpoint import Checkpoint
from .errors import FitError, HubError
from .fit import Fit, FitRequest
from .resolve import is_hub_id, resolve_checkpoint

__all__ = ["Checkpoint", "Fit", "FitError", "FitRequest", "HubError", "is_hub_id", "resolve_checkpoint"]
