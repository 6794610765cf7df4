"""The trainer's side of the titan_spec vLLM server (server/titan_spec_vllm_server.py): start
it with the .venv-vllm interpreter, talk JSON over HTTP with the standard library, stop it.

    client = launch_server(python, llm_kwargs, port, start_timeout_s, request_timeout_s, log)
    client.generate(prompts, params) -> list of result dicts
    client.update_weights(which, update_info, version)   which = "target" | "draft"
    client.fingerprint(which) / client.healthy() / client.shutdown()

Failures come in two kinds, as for SGLang: ``EngineDied`` (no answer, connection refused,
the process exited: the rollout engine restarts the server) and ``VLLMError`` (the server
answered and refused: a bug or bad input, not retried).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

from titan_spec.rollout.http import NoAnswer, request_json

__all__ = ["EngineDied", "VLLMError", "VLLMStartError", "SERVER_SCRIPT", "HttpClient", "launch_server"]

SERVER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "server", "titan_spec_vllm_server.py")


class EngineDied(RuntimeError):
    """The vLLM server is gone or does not answer; restarting it may help."""


class VLLMError(RuntimeError):
    """The vLLM server answered and refused the request."""


class VLLMStartError(RuntimeError):
    """The vLLM server could not be started."""


def _tail(path: str, n: int = 12) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:]).strip()
    except OSError:
        return ""


class HttpClient:
    def __init__(self, url: str, request_timeout_s: float, process: subprocess.Popen | None = None, log_path: str = ""):
        self.url = url.rstrip("/")
        self.timeout = request_timeout_s
        self.process = process
        self.log_path = log_path

    def _died(self, what: str) -> EngineDied:
        if self.process is not None and self.process.poll() is not None:
            return EngineDied(f"vLLM server exited with code {self.process.returncode} ({what}); log: {self.log_path}")
        return EngineDied(f"vLLM server at {self.url}: {what}")

    def _call(self, endpoint: str, payload: dict | None = None, timeout: float | None = None):
        try:
            status, raw = request_json(
                self.url, endpoint, payload, "GET" if payload is None else "POST", timeout or self.timeout
            )
        except NoAnswer as e:
            raise self._died(str(e)) from None
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = {"error": raw.decode(errors="replace").strip()}
        if status != 200:
            raise VLLMError(f"vLLM server /{endpoint} failed (HTTP {status}): {body.get('error')}")
        return body.get("result", body)

    def generate(self, prompts: list[list[int]], params: list[dict]) -> list[dict]:
        return self._call("generate", {"prompts": prompts, "params": params})

    def update_weights(self, which: str, update_info: dict, version: str) -> dict:
        """One push through vLLM's weight-update bracket; ``update_info`` is the server's
        transport's (/health "transport"): {"path"} for a file, IPC handles on CUDA."""
        return self._call("update_weights", {"which": which, "update_info": update_info, "version": version})

    def fingerprint(self, which: str) -> float:
        return float(self._call("fingerprint", {"which": which})["sum"])

    def info(self) -> dict:
        """/health's body: the server's device type, whether vLLM found Triton, its version."""
        return self._call("health")

    def healthy(self, timeout_s: float = 5.0) -> bool:
        try:
            self._call("health", timeout=timeout_s)
            return True
        except (EngineDied, VLLMError):
            return False

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def shutdown(self) -> None:
        """Ask politely, then end the server's whole process group (vLLM's engine core is a
        child process of the server)."""
        p = self.process
        if p is None:
            return
        if p.poll() is None:
            try:
                self._call("shutdown", {}, timeout=10)
                p.wait(timeout=20)
            except (EngineDied, VLLMError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(p.pid, signal.SIGKILL)  # its own group (start_new_session): children too
        except (ProcessLookupError, PermissionError):
            pass
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def launch_server(
    python: str,
    llm_kwargs: dict,
    host: str,
    port: int,
    start_timeout_s: float,
    request_timeout_s: float,
    log_path: str,
    env: dict | None = None,
    work_dir: str = "",
    cpus: str = "",
) -> HttpClient:
    """Start the server (its own session, so that its process group can be ended whole; on
    the cores ``cpus`` with taskset, its children too) and wait for /health. A server that exits while starting reports its exit code and the
    last lines of its log; one that does not answer within start_timeout_s is killed."""
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    config_path = f"{log_path}.config.json"
    with open(config_path, "w") as f:
        json.dump(llm_kwargs, f, indent=1)
    full_env = dict(os.environ)
    full_env.pop("PYTHONPATH", None)  # the trainer's path must not shadow the server env's packages
    full_env.update(env or {})
    log = open(log_path, "ab")
    cmd = [
        python,
        SERVER_SCRIPT,
        "--host",
        host,
        "--port",
        str(port),
        "--config",
        config_path,
        "--parent-pid",
        str(os.getpid()),
        "--orphan-cleanup",
        work_dir,
    ]
    if cpus:
        cmd = ["taskset", "-c", cpus, *cmd]
    # cwd: a neutral folder, so that no titan_spec folder named vllm shadows the vllm package.
    proc = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=full_env,
        cwd=os.path.dirname(config_path),
        start_new_session=True,
    )
    log.close()
    client = HttpClient(f"http://{host}:{port}", request_timeout_s, proc, log_path)
    deadline = time.monotonic() + start_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise VLLMStartError(
                f"vLLM server exited with code {proc.returncode} while starting; log {log_path}:\n{_tail(log_path)}"
            )
        if client.healthy(timeout_s=2.0):
            return client
        time.sleep(1.0)
    client.shutdown()
    raise VLLMStartError(
        f"vLLM server did not answer /health within {start_timeout_s:g}s (rollout.vllm.start_timeout_s); "
        f"log {log_path}:\n{_tail(log_path)}"
    )
