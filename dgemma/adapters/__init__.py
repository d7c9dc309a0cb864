"""LoRA adapters served on one base, chosen per request (bank.py); the engine's side is
kernels/lora.py (the slots and the adapted network) and the requests' `AdapterRef`."""

from ..train.lora import AdapterError
from .bank import (
    DEFAULT_MAX_LORAS,
    DEFAULT_MAX_RANK,
    Adapter,
    AdapterBank,
    AdapterWeights,
    adapter_dtype,
    check_name,
    parse_lora_flag,
    read_adapter,
)

__all__ = [
    "DEFAULT_MAX_LORAS",
    "DEFAULT_MAX_RANK",
    "Adapter",
    "AdapterBank",
    "AdapterError",
    "AdapterWeights",
    "adapter_dtype",
    "check_name",
    "parse_lora_flag",
    "read_adapter",
]
