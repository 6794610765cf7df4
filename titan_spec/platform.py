"""Device and backend choice, and every shim torchtitan 0.3.0 needs to train on CPU.

titan_spec runs the same code on GPU (cuda + nccl) and on CPU (cpu + gloo, several
processes on one machine). torchtitan 0.3.0 assumes an accelerator in a handful of
places; each is handled here, once, with the reason on its line. On a machine with
a GPU nothing in this file changes torchtitan's behaviour. One more, (6), is about
torch's process groups at process exit, on either device.

Import this module before anything from torchtitan (titan_spec/__init__.py does). It also
applies torch_compat.py's backfills for torch < 2.14 (the lent GPU image's 2.11), on any device.

The one shim for a process of another environment lives beside the code it runs in:
vLLM's CPU build (the .venv-vllm server) gets its expand-kernel fix from
titan_spec/rollout/vllm/server/cpu_expand_fix.py, which cannot import this module.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from titan_spec.torch_compat import apply_backfills

# Before anything imports torchtitan, on either device: torchtitan 0.3.0 imports torch 2.14
# symbols at module level (torch_compat.py; nothing changes on torch >= 2.14).
apply_backfills()

__all__ = ["DEVICE_TYPE", "on_cpu", "apply_cpu_shims", "force_sum_reduction", "exit_process"]

# TITAN_SPEC_DEVICE=cpu forces the CPU path on a GPU machine (tests, benchmarks).
_FORCED = os.environ.get("TITAN_SPEC_DEVICE", "").strip().lower()
if _FORCED not in ("", "cpu", "cuda"):
    raise SystemExit(f"TITAN_SPEC_DEVICE={_FORCED!r} is not allowed; use 'cpu' or 'cuda'")
DEVICE_TYPE: str = _FORCED or ("cuda" if torch.cuda.is_available() else "cpu")


def on_cpu() -> bool:
    return DEVICE_TYPE == "cpu"


_APPLIED = False


def apply_cpu_shims() -> None:
    """Make torchtitan 0.3.0 run on CPU. Idempotent; a no-op when DEVICE_TYPE is cuda."""
    global _APPLIED
    if _APPLIED or not on_cpu():
        return
    _APPLIED = True

    # (1) torchtitan computes its device type at import time as
    #     `_get_available_device_type() or "cuda"`; without a driver that is "cuda".
    import torch._utils as _tu

    _tu._get_available_device_type = lambda: "cpu"

    # (2) torch.cpu lacks the memory/name queries torchtitan's metrics call.
    cpu = torch.cpu
    if not hasattr(cpu, "get_device_name"):
        cpu.get_device_name = lambda device=None: "cpu"  # metrics: device name for MFU lookup
    if not hasattr(cpu, "get_device_properties"):
        import types

        def _props(device=None):  # metrics: capacity for memory percentages
            return types.SimpleNamespace(name="cpu", total_memory=_total_ram())

        cpu.get_device_properties = _props
    for name in ("reset_peak_memory_stats", "empty_cache"):  # metrics: no CPU allocator stats
        if not hasattr(cpu, name):
            setattr(cpu, name, lambda *a, **k: None)
    if not hasattr(cpu, "memory_stats"):
        cpu.memory_stats = lambda device=None: {}  # metrics: empty stats read as zeros

    # Import after (1) so torchtitan picks up "cpu".
    import torchtitan.distributed.utils as tt_dist_utils

    # (3) set_pg_timeouts barriers with device_ids=[torch.cpu.current_device()],
    #     which is the string "cpu"; gloo needs no device ids at all.
    _orig_set_pg_timeouts = tt_dist_utils.set_pg_timeouts

    def _set_pg_timeouts(timeout, parallel_dims):
        saved = torch.cpu.current_device
        torch.cpu.current_device = lambda: 0
        try:
            return _orig_set_pg_timeouts(timeout, parallel_dims)
        finally:
            torch.cpu.current_device = saved

    tt_dist_utils.set_pg_timeouts = _set_pg_timeouts


def force_sum_reduction(model: torch.nn.Module) -> None:
    """(4) gloo has no PREMUL_SUM: FSDP2 must reduce-scatter with plain SUM on CPU.

    torchtitan already disables FSDP's gradient division (it normalizes by the global
    token count itself), so SUM is the exact reduction it wants.
    """
    if not on_cpu():
        return
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def _total_ram() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def init_like_unsharded(model_parts: list[torch.nn.Module], model_config, seed: int | None) -> None:
    """(5) Initialize sharded weights exactly as an unsharded model with the same seed would be.

    DTensor's RNG tracker does not cover CPU meshes, so an FSDP-sharded init on CPU draws
    different numbers than a single-process init (each rank draws its shard from the same
    local stream). On CPU the models are small: build one full copy from the seed on every
    rank and keep each rank's shard, so the starting weights do not depend on dp.
    """
    if not on_cpu():
        return
    import torch.distributed as dist

    if seed is None:
        s = torch.randint(0, 2**31 - 1, (1,))
        if dist.is_initialized():
            dist.broadcast(s, src=0)
        seed = int(s)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        full = model_config.build()
        full.init_weights(buffer_device=None)
    full_sd = full.state_dict()
    for part in model_parts:
        # A pipeline stage holds a subset of the layers: load the keys it owns.
        load_full_state_dict(part, {k: full_sd[k] for k in part.state_dict()})


def load_full_state_dict(model: torch.nn.Module, sd: dict[str, torch.Tensor]) -> None:
    """Load full (unsharded) tensors into a model whose params may be FSDP DTensors (the
    CPU init above needs it; models/hf_io.py loads HF checkpoints with it)."""
    own = model.state_dict()
    missing, unexpected = sorted(set(own) - set(sd)), sorted(set(sd) - set(own))
    if missing or unexpected:
        raise ValueError(
            f"weights do not match the target (missing {missing[:4]}{'...' if len(missing) > 4 else ''}, "
            f"unexpected {unexpected[:4]}{'...' if len(unexpected) > 4 else ''})"
        )
    out = {}
    for key, ref in own.items():
        value = sd[key].to(dtype=ref.dtype)
        if isinstance(ref, DTensor):
            # FSDP-sharded parameter: every rank holds the full tensor, keeps its own shard.
            value = distribute_tensor(value.to(ref.device), ref.device_mesh, ref.placements)
        out[key] = value
    model.load_state_dict(out, strict=True)


def exit_process(status: int) -> NoReturn:
    """(6) End a process that ran torch.distributed with ``status``: its process groups
    destroyed (if they still are not), then without the interpreter's finalization.

    Once DTensor or functional collectives have used a gloo process group, torch keeps a
    reference to it from C++: destroy_process_group and gc.collect() leave its threads (two
    pt_gloo_runloop, one gloo_tcp_loop, read from /proc/self/task) running on into the
    interpreter's finalization. A native thread that asks for the GIL then is ended by Python
    with pthread_exit, and the unwinding through a noexcept C++ frame calls std::terminate:
    a process whose work is all done exits with SIGABRT ("terminate called without an active
    exception"), on any rank, after its last export;
    tests/helpers/exit_after_collective.py makes it happen every time (a collective's Python
    callback run by the gloo worker). So the process ends here, after what finalization does
    that matters, done as Python does it: the non-daemon threads joined, the atexit handlers
    run (logging's flush, multiprocessing's queue feeders, inductor's compile workers), the
    standard streams flushed; then os._exit, which runs nothing more.
    """
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    threading._shutdown()  # private: what Py_FinalizeEx calls first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing more can reach it
            pass
    os._exit(status)
