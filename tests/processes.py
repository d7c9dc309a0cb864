"""Finding the processes a test started indirectly (a background builder, the ranks a
`dgemma.load` started), by a variable of their environment: so that a test can say none is left."""

from __future__ import annotations

from pathlib import Path


def processes_with(variable: str, value: str) -> list[int]:
    """This user's processes whose environment sets `variable` to `value` (Linux's /proc)."""
    wanted, found = f"{variable}={value}".encode(), []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if wanted in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:  # another user's, or gone meanwhile
                pass
    return found
