"""Talking to SGLang 0.5.23: a launched HTTP server or an in-process ``sglang.Engine``.

Both clients offer the same small surface, which is all the rollout engine uses:

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
import sys
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
    "INSTALL_HINT",
    "require_sglang",
    "serialize_named_tensors",
    "serialize_per_rank",
    "server_cli_args",
    "HttpClient",
    "InProcessClient",
    "launch_server",
]

INSTALL_HINT = "sglang is not installed; on a GPU machine run: pip install -e '.[sglang]' (sglang==0.5.23, needs CUDA)"


class EngineDied(RuntimeError):
    """The SGLang engine is gone or does not answer; restarting it may help."""


class SGLangError(RuntimeError):
    """SGLang answered and refused the request."""


class SGLangStartError(RuntimeError):
    """The SGLang engine could not be started."""


def require_sglang():
    """Import sglang or fail with one line that says how to install it."""
    try:
        import sglang
    except ImportError:
        raise SGLangStartError(INSTALL_HINT) from None
    return sglang


def serialize_named_tensors(pairs: Sequence[tuple[str, torch.Tensor]]) -> str:
    """The wire format SGLang's ``MultiprocessingSerializer.deserialize`` reads
    (sglang/srt/utils/common.py): a ForkingPickler pickle, base64 for JSON. The pickle
    carries handles, not bytes: CUDA tensors travel as CUDA IPC handles, CPU tensors as
    shared-memory file descriptors, so the receiver must be on the same node and the
    tensors must stay alive until the request returns."""
    if any(t.is_cuda for _, t in pairs):
        # SGLang names the GPU of a CUDA IPC handle by UUID, not index, so that processes
        # with different CUDA_VISIBLE_DEVICES agree; its senders patch torch's reducer for
        # that (sglang/srt/utils/patch_torch.py, used by sglang/srt/weight_sync/utils.py).
        require_sglang()
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()
    buf = io.BytesIO()
    ForkingPickler(buf).dump(list(pairs))
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
        p = self.process
        if p is None or p.poll() is not None:
            return
        # The server runs in its own session: signal its whole process group (scheduler,
        # detokenizer), ours only.
        try:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
        except ProcessLookupError:
            pass


def _tail(path: str, n: int = 5) -> str:
    try:
        with open(path, errors="replace") as f:
            lines = [ln.strip() for ln in f.readlines()[-n:] if ln.strip()]
        return " | ".join(lines) or "(empty)"
    except OSError:
        return f"(no log at {path!r})"


def launch_server(server_args: dict, start_timeout_s: float, request_timeout_s: float, log_path: str) -> HttpClient:
    """``python -m sglang.launch_server`` in its own process group; wait until it serves."""
    require_sglang()
    argv = [sys.executable, "-m", "sglang.launch_server", *server_cli_args(server_args)]
    log = open(log_path, "ab")
    try:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        log.close()
    url = f"http://{server_args['host']}:{server_args['port']}"
    client = HttpClient(url, request_timeout_s, server_args.get("tp_size", 1), proc, log_path)
    client.wait_ready(start_timeout_s)
    return client


class InProcessClient:
    """``sglang.Engine(**server_args)`` in this process (its scheduler runs in child processes).

    Caveat: SGLang's subprocess watchdog sends SIGQUIT to this process when a scheduler
    dies (sglang/srt/utils/watchdog.py), so a crash takes the trainer down with it; use
    the server mode where the trainer must survive an engine crash.
    """

    def __init__(self, server_args: dict):
        sgl = require_sglang()
        self.engine = sgl.Engine(**server_args)
        self.tp_size = server_args.get("tp_size", 1)

    def _run(self, coro):
        # How Engine's own methods reach the tokenizer manager (sglang/srt/entrypoints/engine.py).
        return self.engine.loop.run_until_complete(coro)

    @staticmethod
    def _check(name: str, out) -> None:
        ok, msg = (
            (out.success, out.message) if hasattr(out, "success") else (out if isinstance(out, tuple) else (True, ""))
        )
        if not ok:
            raise SGLangError(f"SGLang {name} failed: {msg}")

    def generate(self, input_ids, sampling_params):
        out = self.engine.generate(input_ids=input_ids, sampling_params=sampling_params, return_logprob=True)
        return out if isinstance(out, list) else [out]

    def pause(self) -> None:
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        self._run(self.engine.tokenizer_manager.pause_generation(PauseGenerationReqInput(mode="retract")))

    def unpause(self) -> None:
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput

        self._run(self.engine.tokenizer_manager.continue_generation(ContinueGenerationReqInput()))

    def begin_update(self, selector: str) -> None:
        self._check("begin_weight_update", self.engine.begin_weight_update(selector=selector))

    def end_update(self) -> None:
        self._check("end_weight_update", self.engine.end_weight_update())

    def update_tensors(self, pairs, load_format: str, weight_version: str, selector: str) -> None:
        # Engine.update_weights_from_tensor has no selector/weight_version arguments; build
        # the request it builds, with both (io_struct.UpdateWeightsFromTensorReqInput; the
        # tokenizer manager decodes base64 payloads like the HTTP server's).
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

        obj = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=serialize_per_rank(pairs, self.tp_size),
            load_format=load_format,
            flush_cache=False,
            weight_version=weight_version,
            selector=selector,
        )
        self._check(
            "update_weights_from_tensor", self._run(self.engine.tokenizer_manager.update_weights_from_tensor(obj, None))
        )

    def flush_cache(self) -> None:
        self._check("flush_cache", self.engine.flush_cache())

    def release_memory(self, tags) -> None:
        self.engine.release_memory_occupation(tags=tags)

    def resume_memory(self, tags) -> None:
        self.engine.resume_memory_occupation(tags=tags)

    def healthy(self, timeout_s: float) -> bool:
        return bool(self.engine.tokenizer_manager.is_healthy())

    def shutdown(self) -> None:
        self.engine.shutdown()
