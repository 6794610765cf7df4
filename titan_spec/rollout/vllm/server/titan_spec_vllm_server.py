"""titan_spec's vLLM server: vLLM's own engine (``vllm.LLM``, V1 engine core) behind a small
JSON-over-HTTP surface, run with the .venv-vllm interpreter (scripts/ensure_vllm_env.sh).

    python titan_spec_vllm_server.py --port P --config CONFIG.json

CONFIG.json holds the ``vllm.LLM`` keyword arguments (model, speculative_config, dtype, ...);
titan_spec/rollout/vllm/engine.py writes it. Endpoints (all JSON):

    GET  /health                          200 once the engine is up; says the transport
    POST /generate {prompts, params}      one result per prompt: token ids, logprobs,
                                          finish reason, per-request spec-decode counts
    POST /update_weights {which, update_info, version}
                                          pause -> vLLM's weight-update bracket into the
                                          target or the drafter -> reset the prefix cache
                                          -> resume
    POST /fingerprint {which}             sum of the served model's parameters
    POST /shutdown

The weight transport is vLLM's weight-transfer engine for this device, chosen here (the
server knows its platform): on CUDA vLLM's "ipc" (the trainer shares its tensors on the
same GPU), elsewhere titan_spec's "titan_spec_file" (titan_spec_vllm_worker.py registers it).

This file imports only vllm and the standard library: the trainer's titan_spec package
needs another torch. One lock serializes generation and weight pushes, so a push never
meets a request in flight (the "pause" of the bracket) and the cache reset after it means
no later request reuses keys computed by the old weights.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HERE = os.path.dirname(os.path.abspath(__file__))
EXTENSION = "titan_spec_vllm_worker.TitanSpecWorkerExtension"
FILE_TRANSPORT = "titan_spec_file"  # titan_spec_vllm_worker.FILE_TRANSPORT (this process does not import it)


def _sampling(vllm, d: dict):
    # logprobs=0: vLLM returns the log-prob of the sampled token only. ignore_eos: the
    # engine stops only at the ids titan_spec sends (as the built-in engine does).
    return vllm.SamplingParams(
        temperature=float(d["temperature"]),
        top_p=float(d["top_p"]),
        top_k=int(d["top_k"]),
        max_tokens=int(d["max_tokens"]),
        stop_token_ids=list(d.get("stop_token_ids") or []),
        ignore_eos=True,
        seed=d.get("seed"),
        logprobs=0,
        detokenize=False,
    )


def _result(out) -> dict:
    c = out.outputs[0]
    ids = [int(t) for t in c.token_ids]
    lps = []
    for tok, entry in zip(ids, c.logprobs or []):
        lps.append(float(entry[tok].logprob))
    spec_decode = None
    m = c.spec_decode_metrics
    if m is not None:
        spec_decode = {"histogram": list(m.histogram), "num_draft_tokens": int(m.num_draft_tokens)}
    return {"output_ids": ids, "logprobs": lps, "finish_reason": c.finish_reason, "spec_decode": spec_decode}


class Server:
    def __init__(self, llm_kwargs: dict):
        import vllm
        from vllm.platforms import current_platform
        from vllm.triton_utils import HAS_TRITON

        self.vllm = vllm
        self.transport = "ipc" if current_platform.is_cuda() else FILE_TRANSPORT
        self.llm = vllm.LLM(**llm_kwargs, weight_transfer_config={"backend": self.transport})
        # Unpacked IPC: one handle per tensor (the trainer keeps them alive until the answer).
        self.llm.init_weight_transfer_engine({"init_info": {"packed": False} if self.transport == "ipc" else {}})
        self.lock = threading.Lock()

        # What the trainer must know of this build: on CPU without Triton the speculative
        # rejection sampler is the policy's distribution only with the worker's expand-kernel
        # fix in place (cpu_expand_fix.py); every worker says whether it runs it.
        self.info = {
            "device": str(current_platform.device_type),
            "triton": bool(HAS_TRITON),
            "vllm": vllm.__version__,
            "transport": self.transport,
            "expand_fixed": all(self.llm.collective_rpc("titan_spec_expand_fixed")),
        }

    def generate(self, body: dict) -> list[dict]:
        prompts = [{"prompt_token_ids": [int(t) for t in p]} for p in body["prompts"]]
        params = [_sampling(self.vllm, d) for d in body["params"]]
        with self.lock:
            outs = self.llm.generate(prompts, params, use_tqdm=False)
        return [_result(o) for o in outs]

    def update_weights(self, body: dict) -> dict:
        """One push: vLLM's bracket, aimed at the drafter for which = "draft"."""
        with self.lock:
            if body["which"] == "draft":
                self.llm.start_draft_weight_update()
            else:
                self.llm.start_weight_update()
            self.llm.update_weights({"update_info": body["update_info"]})
            self.llm.finish_weight_update(weight_version=body.get("version"))
            if body["which"] == "draft":
                self.llm.collective_rpc("titan_spec_after_draft_reload")
            # The cached prefixes' keys and values came from the old weights.
            self.llm.reset_prefix_cache()
        return {"version": self.llm.get_weight_version()}

    def fingerprint(self, body: dict) -> dict:
        with self.lock:
            return {"sum": self.llm.collective_rpc("titan_spec_fingerprint", args=(body["which"],))[0]}


def _handler(server: Server, stop: threading.Event):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # one line per request would flood the log
            pass

        def _send(self, status: int, body) -> None:
            raw = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self):
            if self.path == "/health":
                self._send(200, {"ok": True, "pid": os.getpid(), **server.info})
            else:
                self._send(404, {"error": f"no endpoint {self.path}"})

        def do_POST(self):
            n = int(self.headers.get("Content-Length") or 0)
            try:
                body = json.loads(self.rfile.read(n) or b"{}")
                route = {
                    "/generate": server.generate,
                    "/update_weights": server.update_weights,
                    "/fingerprint": server.fingerprint,
                }
                if self.path == "/shutdown":
                    self._send(200, {"ok": True})
                    stop.set()
                    return
                if self.path not in route:
                    self._send(404, {"error": f"no endpoint {self.path}"})
                    return
                self._send(200, {"result": route[self.path](body)})
            except Exception as e:  # answered, not fatal: the trainer decides
                traceback.print_exc()
                self._send(500, {"error": f"{type(e).__name__}: {e}"})

    return Handler


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _watch_parent(pid: int, stop: threading.Event) -> None:
    """A trainer that dies without closing its engine (an exception, kill -9) must not leave
    a server behind: the server runs in its own session, so nothing else would end it."""
    while not stop.is_set():
        if not _alive(pid):
            print(f"titan_spec vLLM server: parent {pid} is gone; shutting down", flush=True)
            stop.set()
            return
        stop.wait(2.0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--config", required=True)
    p.add_argument("--parent-pid", type=int, default=0, help="exit when this process (the trainer) is gone")
    p.add_argument("--orphan-cleanup", default="", help="folder to remove when exiting because the trainer is gone")
    a = p.parse_args()
    with open(a.config) as f:
        kwargs = json.load(f)
    # vLLM's spawned workers import the extension by name: they inherit PYTHONPATH.
    os.environ["PYTHONPATH"] = HERE + os.pathsep + os.environ.get("PYTHONPATH", "")
    # The IPC transport's handles arrive pickled (vLLM's own HTTP client sends them so,
    # distributed/weight_transfer/clients.py); vLLM unpickles them only with this set. The
    # server listens on 127.0.0.1 (--host) for the trainer that started it.
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    sys.path.insert(0, HERE)
    kwargs["worker_extension_cls"] = EXTENSION
    server = Server(kwargs)
    stop = threading.Event()
    httpd = ThreadingHTTPServer((a.host, a.port), _handler(server, stop))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    print(f"titan_spec vLLM server ready on {a.host}:{a.port}", flush=True)
    if a.parent_pid:
        threading.Thread(target=_watch_parent, args=(a.parent_pid, stop), daemon=True).start()
    stop.wait()
    httpd.shutdown()
    if a.orphan_cleanup and a.parent_pid and not _alive(a.parent_pid):
        # The trainer's engine would have removed its push folder; it is gone (only then:
        # a restart's shutdown must keep the served draft directory for the next server).
        import shutil

        shutil.rmtree(a.orphan_cleanup, ignore_errors=True)
    # vLLM's engine core is a child process that outlives an exiting parent and ignores
    # SIGTERM (measured): end it through its client first. The trainer also kills the
    # server's whole process group (client.py), which covers a server killed with -9.
    try:
        server.llm.llm_engine.engine_core.shutdown()
    except Exception:
        traceback.print_exc()
    os._exit(0)


if __name__ == "__main__":  # vLLM spawns workers that re-import __main__
    main()
