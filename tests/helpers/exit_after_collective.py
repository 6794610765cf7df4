"""A process that ends while one of its gloo worker threads is about to run Python
(tests/test_faults.py):

    python -m torch.distributed.run --nproc_per_node=2 tests/helpers/exit_after_collective.py STORE MODE

Rank 0 leaves an all_reduce pending with a Python callback on its future, after a DTensor
op (so that, as in a training run, destroy_process_group leaves its process group alive),
and ends with MODE: ``exit_process`` (titan_spec.platform) or ``sys_exit`` (Python's own
exit, the interpreter finalizing). Rank 1 completes the collective only once rank 0 is
ending: for ``sys_exit`` once an object freed during rank 0's finalization has said so
through the FileStore at STORE, so the callback runs on rank 0's gloo worker thread while
its interpreter finalizes. Exit status 0 on both ranks is the outcome a finished run needs.
"""

import os
import sys
import time
from datetime import timedelta

import titan_spec  # noqa: F401  (CPU shims before torch.distributed use)
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from titan_spec import platform


class _SaysWhenFreed:
    """Freed while the interpreter finalizes (a module global): tells rank 1, then lingers
    so that the collective completes while finalization is under way."""

    def __init__(self, store):
        self.store = store

    def __del__(self):
        self.store.set("finalizing", "1")
        time.sleep(2.0)


def main() -> None:
    store_path, mode = sys.argv[1], sys.argv[2]
    if mode not in ("exit_process", "sys_exit"):
        raise SystemExit(f"mode {mode!r} is not allowed; use exit_process or sys_exit")
    dist.init_process_group("gloo")
    store = dist.FileStore(store_path, 2)
    mesh = init_device_mesh("cpu", (2,))
    distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]).full_tensor()
    if dist.get_rank() == 0:
        global _finalizing
        _finalizing = _SaysWhenFreed(store)
        work = dist.all_reduce(torch.ones(16), async_op=True)
        work.get_future().then(lambda fut: None)  # run by the gloo worker thread, with the GIL
        dist.destroy_process_group()
        store.set("ending", "1")
        if mode == "exit_process":
            platform.exit_process(0)
        sys.exit(0)
    store.wait(["ending"], timedelta(seconds=60))
    if mode == "sys_exit":
        store.wait(["finalizing"], timedelta(seconds=60))
    try:
        dist.all_reduce(torch.ones(16))
    except RuntimeError:
        pass  # exit_process: rank 0 may be gone before the collective completes
    os._exit(0)  # nothing of rank 1 is under test


if __name__ == "__main__":
    main()
