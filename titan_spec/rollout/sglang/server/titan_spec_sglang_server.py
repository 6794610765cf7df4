"""SGLang's ``launch_server`` with the CPU stand-ins of titan_spec_sglang_cpu in place.

    PYTHONPATH=<this folder> <sglang venv>/bin/python titan_spec_sglang_server.py <launch_server flags>

The flags are exactly ``python -m sglang.launch_server``'s. On CPU (``--device cpu`` or
``SGLANG_USE_CPU_ENGINE=1``) ``titan_spec_sglang_cpu.apply()`` runs before SGLang parses them;
on a GPU machine nothing is applied and this is plain ``launch_server``.

Every process has to apply it, not only this one: the scheduler (TP worker) builds the
attention backend and calls the ops. SGLang starts its processes with multiprocessing's
"spawn" (sglang/srt/entrypoints/engine.py sets it), and a spawned child re-runs the parent's
main script as ``__mp_main__`` before it unpickles its target; so the module-level
``_apply_on_cpu()`` below runs in each of them. (A sitecustomize.py would do it too, but would
shadow any sitecustomize the venv has, and reach every python started with this PYTHONPATH.)

The server ends its whole process group when the trainer that started it (the pid in
TITAN_SPEC_PARENT_PID) is gone: it runs in its own session, so a trainer that dies without
closing its engine (an exception, SIGTERM, kill -9) would otherwise leave it serving.

The trainer learns what was applied from one log line per process,
``titan_spec sglang cpu: registered [...] (pid N)``, and from ``/server_info``, which gains
a ``titan_spec_cpu`` field (this process's ``apply()`` result; empty on GPU).
"""

import logging
import os
import runpy
import signal
import sys
import threading
import time

logger = logging.getLogger("titan_spec_sglang_server")

APPLIED: tuple[str, ...] = ()


def _on_cpu(argv: list[str]) -> bool:
    if os.environ.get("SGLANG_USE_CPU_ENGINE", "").lower() in ("1", "true"):
        return True
    for i, arg in enumerate(argv):
        if arg == "--device" and i + 1 < len(argv):
            return argv[i + 1] == "cpu"
        if arg == "--device=cpu":
            return True
    return False


def _apply_on_cpu() -> tuple[str, ...]:
    # A spawned child has the parent's sys.argv, so it takes the same decision.
    if not _on_cpu(sys.argv[1:]):
        return ()
    import titan_spec_sglang_cpu

    done = titan_spec_sglang_cpu.apply()
    # print, not logging: SGLang configures logging later, and the line must reach the log.
    print(f"titan_spec sglang cpu: registered {list(done)} (pid {os.getpid()})", file=sys.stderr, flush=True)
    return done


def _report_in_server_info(done: tuple[str, ...]) -> None:
    """Add ``titan_spec_cpu`` to /server_info (and the deprecated /get_server_info)."""
    from sglang.srt.entrypoints import http_server

    build = http_server.build_server_info

    def build_server_info(*args, **kwargs):
        return {**build(*args, **kwargs), "titan_spec_cpu": list(done)}

    http_server.build_server_info = build_server_info


def _watch_parent(pid: int, poll_s: float = 2.0) -> None:
    """Block until process ``pid`` is gone, then kill this process group (the server, its
    scheduler and detokenizer)."""
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        except PermissionError:  # alive, another user's
            pass
        time.sleep(poll_s)
    print(f"titan_spec sglang server: parent {pid} is gone; shutting down", file=sys.stderr, flush=True)
    os.killpg(os.getpgrp(), signal.SIGKILL)


APPLIED = _apply_on_cpu()

if __name__ == "__main__":
    parent = int(os.environ.get("TITAN_SPEC_PARENT_PID") or 0)
    if parent:
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    _report_in_server_info(APPLIED)
    # alter_sys=False keeps this script as __main__, which the spawned children re-run.
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=False)
