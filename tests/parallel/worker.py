"""Run under torchrun by tests/parallel/test_parallel.py: every `check_*` function of the check
modules, on every rank of one gloo group, in one process group (starting ranks costs seconds;
one group serves all the model checks).

Each check takes the `ShardGroup` and returns nothing or raises; the ranks run the checks in the
same order, so their collectives pair up. Rank 0 writes {check name: "ok" | the error} to the
JSON file named by argv[1]; a check that fails on any rank fails (the ranks' results are gathered).
"""

import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from checks import all_checks  # noqa: E402

from dgemma.parallel.group import from_environment  # noqa: E402

if __name__ == "__main__":
    torch.set_num_threads(1)
    only = set(sys.argv[2].split(",")) if len(sys.argv) > 2 and sys.argv[2] else None
    group = from_environment(timeout_s=120)
    results, seconds = {}, {}
    for name, check in all_checks():
        if only and name not in only:
            continue
        start = time.perf_counter()
        try:
            check(group)
            mine = "ok"
        except Exception:  # noqa: BLE001 - reported per check, the group goes on
            mine = traceback.format_exc(limit=6)[-2500:]
        every = [None] * group.size
        dist.all_gather_object(every, mine)
        bad = [f"rank {r}: {m}" for r, m in enumerate(every) if m != "ok"]
        results[name] = "ok" if not bad else "\n".join(bad)
        seconds[name] = round(time.perf_counter() - start, 2)
    if group.rank == 0:
        Path(sys.argv[1]).write_text(json.dumps({**results, "seconds": seconds}))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's threads can abort the interpreter's teardown (tests/train/fsdp_worker.py says why)
