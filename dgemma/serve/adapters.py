"""LoRA adapters loaded and unloaded while the server runs (vLLM's `POST /v1/load_lora_adapter` and
`/v1/unload_lora_adapter`), off unless `dgemma serve --allow-runtime-lora`, reading only under
`--lora-dir`, behind the API key when one is set (http/access.py guards every /v1 route).

Loading reads and checks the adapter on a worker thread (dgemma/adapters/bank.py: files, base
shapes, targets, rank, hash), so running requests keep stepping; only the copy into a free slot
happens on the engine thread, between two steps. Unloading refuses new requests naming the adapter
at once, waits for the ones running it, then empties its slot and drops its prefix-cache blocks
(engine_thread.py). Every refusal is one line, and nothing else changes.
"""

from __future__ import annotations

import asyncio

from ..adapters import AdapterError, check_name
from .engine_thread import UnknownAdapter
from .errors import ApiError, excerpt
from .service import Service, listed_name


class RuntimeAdapters:
    """The two routes' work over `service`'s adapter bank and engine thread."""

    def __init__(self, service: Service):
        self.service = service

    def _allowed(self) -> None:
        if not self.service.runtime_lora.allowed:
            raise ApiError(
                404,
                "loading and unloading adapters at run time is off: start the server with --allow-runtime-lora "
                "and --lora-dir DIR",
                code="runtime_lora_off",
            )

    async def load(self, name: str, path: str) -> dict:
        """Read, check and install the adapter at `path` (under --lora-dir) as `name`."""
        self._allowed()
        service = self.service
        try:
            check_name(name)
        except AdapterError as e:
            raise ApiError(400, str(e), "lora_name", "invalid_value") from None
        if name in service.names or listed_name(name) in service.names:
            raise ApiError(400, f"lora_name {excerpt(name)} is the base model's name", "lora_name", "invalid_value")
        if service.adapters.get(name) is not None:
            raise ApiError(
                400,
                f"an adapter named {excerpt(name)} is loaded already (unload it first)",
                "lora_name",
                "invalid_value",
            )
        try:  # files and checks off the event loop and off the engine thread
            read = await asyncio.to_thread(service.adapters.read, name, path, service.runtime_lora.directory)
            entry = await service.engine_thread.install_adapter(read)
        except AdapterError as e:
            raise ApiError(400, str(e), "lora_path", "invalid_adapter") from None
        return {
            "object": "lora_adapter",
            "lora_name": entry.name,
            "status": "loaded",
            "rank": entry.rank,
            "parent": service.name,
            "message": f"Success: LoRA adapter '{entry.name}' added successfully.",
        }

    async def unload(self, name: str) -> dict:
        """Unload adapter `name` once the requests running it have ended."""
        self._allowed()
        try:
            entry = await self.service.engine_thread.remove_adapter(name)
        except UnknownAdapter:
            loaded = ", ".join(f"'{n}'" for n in self.service.adapters.names) or "none"
            raise ApiError(
                404, f"no adapter named {excerpt(name)} is loaded (loaded: {loaded})", "lora_name", "model_not_found"
            ) from None
        except AdapterError as e:
            raise ApiError(400, str(e), "lora_name", "invalid_value") from None
        return {
            "object": "lora_adapter",
            "lora_name": entry.name,
            "status": "unloaded",
            "message": f"Success: LoRA adapter '{entry.name}' removed successfully.",
        }
