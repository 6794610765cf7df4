"""How the trainer starts SGLang 0.5.23: its environment, its entry, and what its CPU path takes.

The server runs in its own environment (scripts/ensure_sglang_env.sh: sglang 0.5.23 with
torch 2.14.1, built once per machine in the user's cache) as

    <env python> server/titan_spec_sglang_server.py <sglang.launch_server flags>

with server/ on its PYTHONPATH (the custom weight loaders and, on CPU, the kernel stand-ins
are top-level modules there; no titan_spec package is imported in that environment).

On CPU (this machine: no driver, no sgl_kernel CPU build) the environment's stub libcuda.so.1
goes on LD_LIBRARY_PATH so that sgl_kernel imports, SGLANG_USE_CPU_ENGINE=1 selects SGLang's
CPU engine, and the server args add ``device = "cpu"``, no CUDA graphs and a KV cache of
``CPU_MAX_TOTAL_TOKENS`` (SGLang sizes it from RAM otherwise: ~13 GB at its default fraction).
"""

from __future__ import annotations

import os

from titan_spec.platform import on_cpu

__all__ = [
    "SERVER_DIR",
    "SERVER_SCRIPT",
    "CPU_MAX_TOTAL_TOKENS",
    "cpu_server_args",
    "server_env",
]

SERVER_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "server")
SERVER_SCRIPT = os.path.join(SERVER_DIR, "titan_spec_sglang_server.py")

CPU_MAX_TOTAL_TOKENS = 8192
"""KV cache tokens of a CPU server (rollout.sglang.server_args may set max_total_tokens)."""

STUB_DIR = os.path.join("lib", "titan_spec_stub")
"""Where scripts/ensure_sglang_env.sh builds the stub libcuda.so.1, inside the environment."""


def cpu_server_args(speculates: bool) -> dict:
    """The ServerArgs fields a CPU server needs beyond the common ones. EAGLE-3 needs SGLang's
    CPU attention backend (intel_amx), which the server's CPU module lets run without AMX
    (server/titan_spec_sglang_cpu.py); plain decoding takes torch_native. sleep_on_idle: an
    idle scheduler otherwise spins on a core, which on CPU is one the trainer's step needs."""
    return {
        "device": "cpu",
        "attention_backend": "intel_amx" if speculates else "torch_native",
        "disable_cuda_graph": True,
        "max_total_tokens": CPU_MAX_TOTAL_TOKENS,
        "sleep_on_idle": True,
    }


def server_env(python: str) -> dict[str, str]:
    """Environment variables of the server process: server/ first on PYTHONPATH (the trainer's
    path must not shadow the environment's packages), and on CPU the stub driver and
    SGLang's CPU engine. TITAN_SPEC_PARENT_PID: the server ends itself when this process (the
    trainer) is gone (server/titan_spec_sglang_server.py)."""
    env = {"PYTHONPATH": SERVER_DIR, "TITAN_SPEC_PARENT_PID": str(os.getpid())}
    if on_cpu():
        venv = os.path.dirname(os.path.dirname(os.path.abspath(python)))
        stub = os.path.join(venv, STUB_DIR)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (stub, os.environ.get("LD_LIBRARY_PATH", "")) if p)
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    return env
