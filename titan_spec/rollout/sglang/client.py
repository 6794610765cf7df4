"""Talking to a launched SGLang 0.5.23 server over HTTP, with the standard library.

The client's small surface is all the rollout engine uses:

    generate(input_ids, sampling_params) -> list of SGLang result dicts
    pause() / unpause()                   /pause_generation (mode "retract"), /continue_generation
    begin_update(selector) / end_update() /begin_weight_update, /end_weight_update
    update_tensors(pairs, load_format, weight_version, selector)   /update_weights_from_tensor
    flush_cache()                          /flush_cache
    release_memory(tags) / resume_memory(tags)   /release_memory_occupation, /resume_memory_occupation
    healthy(timeout_s) -> bool             /health_generate (runs one real token)
    shutdown()

Failures come in two kinds: ``EngineDied`` (no answer, connection refused, the process
exited: the rollout engine restarts the server) and ``SGLangError`` (SGLang answered and
refused: a bug or bad input, not retried).

The endpoint names and payload fields are those of sglang/srt/entrypoints/http_server.py
and the request structs in sglang/srt/managers/io_struct.py (0.5.23).
"""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing  # noqa: F401  (registers the tensor reductions with ForkingPickler)

from titan_spec.rollout.http import NoAnswer, request_json

__all__ = [
    "EngineDied",
    "SGLangError",
    "SGLangStartError",
    "serialize_named_tensors",
    "serialize_per_rank",
    "server_cli_args",
    "HttpClient",
    "launch_server",
]


class EngineDied(RuntimeError):
    """The SGLang engine is gone or does not answer; restarting it may help."""


class SGLangError(RuntimeError):
    """SGLang answered and refused the request."""


class SGLangStartError(RuntimeError):
    """The SGLang engine could not be started."""


def serialize_named_tensors(pairs: Sequence[tuple[str, torch.Tensor]]) -> str:
    """The wire format SGLang's ``MultiprocessingSerializer.deserialize`` reads
    (sglang/srt/utils/common.py, its ``SafeUnpickler``): a ForkingPickler pickle, base64 for
    JSON. The pickle carries handles, not bytes, so the receiver must be on the same node and
    the tensors must stay alive until the request returns. CUDA tensors travel as CUDA IPC
    handles; the server is started with the trainer's CUDA_VISIBLE_DEVICES and GPU, so torch's
    device index means the same GPU on both sides. CPU tensors travel as named shared-memory
    files (torch's "file_system" strategy): the default "file_descriptor" strategy hands fds
    over multiprocessing's resource sharer, which only a child of this process may call (its
    authkey), and SGLang's scheduler is not one. The pickle holds a reference to each shared
    file (torch's refcount in the file), so the copies may be freed once it is written. CPU
    tensors are copied first: sharing moves a storage into shared memory, and a pushed
    parameter's own storage must stay where the trainer has it."""
    cpu = [(n, t if t.is_cuda else t.detach().clone()) for n, t in pairs]
    strategy = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        buf = io.BytesIO()
        ForkingPickler(buf).dump(cpu)
    finally:
        torch.multiprocessing.set_sharing_strategy(strategy)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def serialize_per_rank(pairs: Sequence[tuple[str, torch.Tensor]], tp_size: int) -> list[str]:
    """One payload per TP rank, each its own serialization: SGLang hands payload i to TP
    rank i (sglang/srt/entrypoints/engine.py, managers/tp_worker.py), and a payload can be
    opened only once: a CPU tensor's file-descriptor handle is fetched from the sender
    once, a CUDA IPC handle carries one reference count per serialization. The same
    payload repeated would leave every rank but the first with a dead handle."""
    return [serialize_named_tensors(pairs) for _ in range(tp_size)]


def server_cli_args(server_args: dict) -> list[str]:
    """ServerArgs fields -> ``python -m sglang.launch_server`` flags (SGLang builds its CLI
    from the same fields: ``--field-name``, bools are store_true, lists are nargs)."""
    argv: list[str] = []
    for key, value in server_args.items():
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            argv += [flag, *(str(v) for v in value)]
        else:
            argv += [flag, str(value)]
    return argv


class HttpClient:
    """SGLang's HTTP API with the standard library (no extra dependency on the trainer)."""

    def __init__(
        self,
        url: str,
        request_timeout_s: float,
        tp_size: int = 1,
        process: subprocess.Popen | None = None,
        log_path: str = "",
    ):
        self.url = url.rstrip("/")
        self.timeout = request_timeout_s
        self.tp_size = tp_size
        self.process = process
        self.log_path = log_path

    @property
    def pid(self) -> int | None:
        """The server process's id (None for a client without one)."""
        return self.process.pid if self.process is not None else None

    # --- transport ----------------------------------------------------------------------

    def _died(self, what: str) -> EngineDied:
        if self.process is not None and self.process.poll() is not None:
            return EngineDied(
                f"SGLang server exited with code {self.process.returncode} ({what}); log: {self.log_path}"
            )
        return EngineDied(f"SGLang server at {self.url}: {what}")

    def _call(self, endpoint: str, payload: dict | None = None, method: str = "POST", timeout: float | None = None):
        """-> (status, decoded body). HTTP errors are answers; no answer is EngineDied."""
        try:
            status, raw = request_json(self.url, endpoint, payload, method, timeout or self.timeout)
        except NoAnswer as e:
            raise self._died(str(e)) from None
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace").strip()
        return status, body

    def _ok(self, endpoint: str, payload: dict | None = None):
        """POST and insist on success (200 and, where SGLang reports it, success=true).
        503 is how SGLang says it is unhealthy or shutting down: a lost engine."""
        status, body = self._call(endpoint, payload)
        if status == 503:
            raise self._died(f"/{endpoint} answered 503 (unhealthy or shutting down)")
        if status != 200 or (isinstance(body, dict) and body.get("success") is False):
            msg = body.get("message") if isinstance(body, dict) else body
            raise SGLangError(f"SGLang /{endpoint} failed (HTTP {status}): {msg}")
        return body

    # --- API ----------------------------------------------------------------------------

    def generate(self, input_ids: list[list[int]], sampling_params: list[dict]) -> list[dict]:
        # GenerateReqInput: batch of token-id prompts, per-request sampling params,
        # return_logprob for meta_info["output_token_logprobs"]; a batch answers a list.
        body = self._ok(
            "generate", {"input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": True}
        )
        return body if isinstance(body, list) else [body]

    def pause(self) -> None:
        # "retract": running requests go back to the queue and the KV cache may be flushed
        # (PauseGenerationReqInput in io_struct.py); in_place would refuse the flush.
        self._ok("pause_generation", {"mode": "retract"})

    def unpause(self) -> None:
        self._ok("continue_generation", {})

    def begin_update(self, selector: str) -> None:
        # 0.5.23 refuses update_weights_from_tensor outside a weight-update session.
        self._ok("begin_weight_update", {"selector": selector})

    def end_update(self) -> None:
        self._ok("end_weight_update", {})

    def update_tensors(self, pairs, load_format: str, weight_version: str, selector: str) -> None:
        # UpdateWeightsFromTensorReqInput: one serialized payload per TP rank.
        self._ok(
            "update_weights_from_tensor",
            {
                "serialized_named_tensors": serialize_per_rank(pairs, self.tp_size),
                "load_format": load_format,
                "flush_cache": False,  # flushed once after the session, see SGLangRolloutEngine._push
                "weight_version": weight_version,
                "selector": selector,
            },
        )

    def flush_cache(self) -> None:
        self._ok("flush_cache")

    def server_info(self) -> dict:
        # GET /server_info: the server's arguments and state (the titan_spec server adds
        # titan_spec_cpu: what it loaded on CPU).
        status, body = self._call("server_info", method="GET")
        if status != 200 or not isinstance(body, dict):
            raise SGLangError(f"SGLang /server_info failed (HTTP {status}): {body}")
        return body

    def release_memory(self, tags: list[str] | None) -> None:
        self._ok("release_memory_occupation", {"tags": tags})

    def resume_memory(self, tags: list[str] | None) -> None:
        self._ok("resume_memory_occupation", {"tags": tags})

    def healthy(self, timeout_s: float) -> bool:
        try:
            status, _ = self._call("health_generate", method="GET", timeout=timeout_s)
        except EngineDied:
            return False
        return status == 200

    def wait_ready(self, timeout_s: float) -> None:
        """Poll /health_generate until it answers 200; clear errors on exit or timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise SGLangStartError(
                    f"SGLang server exited with code {self.process.returncode} while starting; "
                    f"last log lines: {_tail(self.log_path)}"
                )
            if self.healthy(timeout_s=min(10.0, max(deadline - time.monotonic(), 0.1))):
                return
            time.sleep(1.0)
        self.shutdown()
        raise SGLangStartError(
            f"SGLang server at {self.url} was not ready within {timeout_s:g}s "
            f"(rollout.sglang.start_timeout_s); last log lines: {_tail(self.log_path)}"
        )

    def shutdown(self) -> None:
        """End the server's whole process group (it runs in its own session: launcher,
        scheduler, detokenizer), ours only; also when the launcher is already gone, as after a
        kill -9, whose scheduler and detokenizer would otherwise keep the CPU and memory."""
        p = self.process
        if p is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and _group_alive(p.pid):
                p.poll()
                time.sleep(0.2)
            if not _group_alive(p.pid):
                break
        p.poll()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _tail(path: str, n: int = 5) -> str:
    try:
        with open(path, errors="replace") as f:
            lines = [ln.strip() for ln in f.readlines()[-n:] if ln.strip()]
        return " | ".join(lines) or "(empty)"
    except OSError:
        return f"(no log at {path!r})"


def launch_server(
    python: str, server_args: dict, env: dict[str, str], start_timeout_s: float, request_timeout_s: float, log_path: str
) -> HttpClient:
    """The server entry (serving.py) with the SGLang environment's ``python``, in its own
    process group, from a neutral folder (so that no titan_spec folder named sglang shadows
    the package); wait until it serves."""
    from titan_spec.rollout.sglang.serving import SERVER_SCRIPT

    argv = [python, SERVER_SCRIPT, *server_cli_args(server_args)]
    full_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    full_env.update(env)
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    log = open(log_path, "ab")
    try:
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=full_env,
            cwd=os.path.dirname(os.path.abspath(log_path)),
            start_new_session=True,
        )
    except OSError as e:
        raise SGLangStartError(f"cannot start the SGLang server with {python}: {e}") from None
    finally:
        log.close()
    url = f"http://{server_args['host']}:{server_args['port']}"
    client = HttpClient(url, request_timeout_s, server_args.get("tp_size", 1), proc, log_path)
    client.wait_ready(start_timeout_s)
    return client
