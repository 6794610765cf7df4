"""``StubSGLang``: a real HTTP server (http.server, in a thread) that plays SGLang 0.5.23's
HTTP surface for the SGLang engine's tests (test_sglang_engine.py, test_sglang_behaviour.py).

It answers SGLang's endpoints (sglang/srt/entrypoints/http_server.py) with their response
shapes, records every (endpoint, payload), and behaves as SGLang 0.5.23 does where that
behaviour is a hazard for the engine (each checked in SGLang's source; never its code):

- A pushed payload is opened once per TP rank, each rank its own payload
  (entrypoints/engine.py, managers/tp_worker.py); a payload repeated for a second rank
  fails to open (its handle was consumed) and the scheduler dies.
- ``update_weights_from_tensor`` runs the named custom loader (titan_spec's own, imported
  by its dotted path as SGLang's ``dynamic_import`` does) on the selected runners: a target
  and an EAGLE-3 draft stand-in whose ``load_weights`` hold the start files' shapes and
  fail like SGLang's (unknown name: KeyError; other shape: the weight loader's assertion).
  SGLang does not catch a loader's exception (model_runner_components/weight_updater.py),
  the scheduler dies and the server with it: so does the stub (no answer, port closed).
- ``resume_memory_occupation`` of a tag that is not released raises KeyError in the
  scheduler (``offload_tags.remove``), and ``release_memory_occupation`` with a request in
  flight fails an assertion: both kill the stub too.
- With deterministic inference on (``deterministic``, the server's
  enable_deterministic_inference), a sampled request's tokens are a function of its seed
  and position only, and a request WITHOUT ``sampling_seed`` samples with seed 42
  (sampling/sampling_batch_info.py builds the seed tensor with 42 for unseeded requests;
  the seeded sampler hashes (seed, position)): equal seeds, equal samples.
- meta_info carries SGLang's counts: ``spec_verify_ct`` (no prefill, no re-prefill),
  ``spec_num_correct_drafts`` and ``num_retractions``; ``meta`` overrides them per test.

It says nothing about SGLang itself beyond these; tests/test_sglang_server.py exercises the
real server (on this CPU too).
"""

import base64
import importlib
import sys
import json
import os
import pickle
import random
import threading
import types
from glob import glob
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from safetensors import safe_open

from titan_spec.rollout.sglang.serving import SERVER_DIR

# The real server has server/ on its PYTHONPATH: the loaders are a top-level module there.
if SERVER_DIR not in sys.path:
    sys.path.insert(0, SERVER_DIR)

V = 128
MEMORY_TYPES = ("kv_cache", "weights", "cuda_graph")  # SGLang's GPU_MEMORY_ALL_TYPES


def _shapes(files, skip=lambda n: False) -> dict[str, tuple[int, ...]]:
    out = {}
    for f in files:
        with safe_open(f, framework="pt") as st:
            out.update({n: tuple(st.get_slice(n).get_shape()) for n in st.keys() if not skip(n)})
    return out


class _Runner(torch.nn.Module):
    """A model runner's model as the custom loaders see it: ``config.architectures`` and
    ``load_weights`` with SGLang's failures (params_dict[name] -> KeyError; the default
    weight loader asserts equal sizes)."""

    def __init__(self, architectures, shapes, **attrs):
        super().__init__()
        self.config = types.SimpleNamespace(architectures=list(architectures))
        self.shapes = shapes
        self.loaded: list[str] = []
        for k, v in attrs.items():
            setattr(self, k, v)

    def load_weights(self, weights):
        for name, t in weights:
            want = self.shapes[name]  # KeyError for a name the model does not have
            assert tuple(t.shape) == want, f"{name}: param size {want} vs loaded {tuple(t.shape)}"
            self.loaded.append(name)


class StubTarget(_Runner):
    pass


class StubLlamaForCausalLMEagle3(_Runner):
    pass


def runners_for(model_path: str | None, draft_path: str | None) -> dict:
    """The target and draft stand-ins for a policy HF directory and an exported draft."""
    out = {}
    if model_path:
        with open(os.path.join(model_path, "config.json")) as f:
            archs = json.load(f).get("architectures") or ["Qwen3ForCausalLM"]
        out["target"] = StubTarget(archs, _shapes(sorted(glob(os.path.join(model_path, "*.safetensors")))))
    if draft_path:
        f = os.path.join(draft_path, "model.safetensors")
        with safe_open(f, framework="pt") as st:
            d2t = st.get_tensor("d2t")
        out["draft"] = StubLlamaForCausalLMEagle3(
            ["LlamaForCausalLMEagle3"],
            _shapes([f], skip=lambda n: n in ("d2t", "t2d") or n.endswith("embed_tokens.weight")),
            hot_token_id=d2t + torch.arange(d2t.numel()),
        )
    return out


class StubSGLang:
    """See the module docstring. ``fail_update``: SGLang answers success=false (a refusal
    it does report, e.g. its derived-weight-cache check); ``crash_versions``: pushes with
    these weight_version tags kill the server while loading (an OOM, say);
    ``hold_generate``: an Event that /generate waits on (``generate_entered`` is set when
    one arrives); ``meta``: meta_info overrides; ``model_path``/``draft_path``: the start
    files of the runners (no runner, no loader run); ``deterministic``: the server runs
    with enable_deterministic_inference (seeded sampling, seed 42 when none is sent)."""

    def __init__(
        self,
        fail_update=False,
        tp_size=1,
        model_path=None,
        draft_path=None,
        crash_versions=(),
        hold_generate=None,
        meta=None,
        deterministic=False,
    ):
        self.deterministic = deterministic
        self.calls, self.pushed = [], []
        self.version = "default"
        self.unhealthy = False
        self.dead: str | None = None
        self.tp_size = tp_size
        self.runners = runners_for(model_path, draft_path)
        self.offload_tags: set[str] = set()
        self.in_flight = 0
        self.hold_generate = hold_generate
        self.generate_entered = threading.Event()
        self.meta = dict(meta or {})
        self.fail_update_message = (
            "Online weight updates are not supported while the HPC-Ops bf16xfp32 GEMM optimization is enabled"
            if fail_update
            else ""
        )
        self.crash_versions = frozenset(crash_versions)
        self.hang = threading.Event()  # set: /generate never answers (until stop())
        self._released = threading.Event()
        self.client = None  # the HttpClient that a test's connect made for this stub
        stub = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _answer(self, status, body):
                raw = json.dumps(body).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(raw)))
                    self.end_headers()
                    self.wfile.write(raw)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up on a hung request

            def do_GET(self):
                stub.calls.append((self.path.strip("/"), None))
                self._answer(200, {})

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else None
                name = self.path.strip("/").split("?")[0]
                stub.calls.append((name, body))
                try:
                    status, answer = stub.handle(name, body)
                except Exception as e:  # the scheduler raised: SGLang's server goes down
                    stub.die(f"{name}: {type(e).__name__}: {e}")
                    self.close_connection = True
                    return
                self._answer(status, answer)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    # --- SGLang's behaviour ---------------------------------------------------------------

    def handle(self, name, body):
        ok = (200, {"success": True, "message": "Success"})
        if name == "generate":
            self.in_flight += 1
            try:
                self.generate_entered.set()
                if self.hold_generate is not None:
                    self.hold_generate.wait()
                if self.hang.is_set():
                    self._released.wait()
                if self.unhealthy:
                    return 503, {"message": "unhealthy"}
                return 200, [self.result(p, s) for p, s in zip(body["input_ids"], body["sampling_params"])]
            finally:
                self.in_flight -= 1
        if name == "update_weights_from_tensor":
            return self.update(body)
        if name == "release_memory_occupation":
            # The scheduler asserts it is idle before it releases anything.
            assert self.in_flight == 0, f"release_memory_occupation with {self.in_flight} request(s) in flight"
            self.offload_tags.update(body.get("tags") or MEMORY_TYPES)
            return ok
        if name == "resume_memory_occupation":
            for tag in body.get("tags") or MEMORY_TYPES:
                self.offload_tags.remove(tag)  # KeyError on a tag that was not released
            return ok
        return ok

    def update(self, body):
        if self.fail_update_message:
            return 400, {"success": False, "message": self.fail_update_message}
        payloads = body["serialized_named_tensors"]
        # Each TP rank opens its own payload (payload i -> rank i).
        per_rank = [pickle.loads(base64.b64decode(payloads[rank])) for rank in range(self.tp_size)]
        pairs = list(per_rank[0])
        if body["weight_version"] in self.crash_versions:
            raise RuntimeError(f"crashed while loading weight_version {body['weight_version']}")
        selector = body.get("selector")
        loader = body.get("load_format")
        for role, model in self.runners.items():
            if selector in (None, role):
                mod, attr = loader.rsplit(".", 1)
                getattr(importlib.import_module(mod), attr)(model, pairs)  # SGLang: dynamic_import(fmt)(model, tensors)
        self.pushed.append(dict(pairs))
        self.per_rank = [dict(p) for p in per_rank]
        self.version = body["weight_version"]
        return 200, {"success": True, "message": "Success"}

    def die(self, reason: str) -> None:
        """The server process is gone: no answer, and the port stops accepting."""
        self.dead = reason
        self.httpd.shutdown()
        self.httpd.server_close()

    def result(self, prompt, sp):
        n = min(sp["max_new_tokens"], 5)
        toks = [(prompt[-1] + j + 1) % V for j in range(n)]
        if self.deterministic and sp["temperature"] > 0:
            seed = sp.get("sampling_seed", 42)  # SGLang's default for an unseeded request
            pos = len(prompt)
            toks = [(t + random.Random(f"{seed}:{pos + j}").randrange(V)) % V for j, t in enumerate(toks)]
        meta = {
            "output_token_logprobs": [[-0.25 * (j + 1), t, None] for j, t in enumerate(toks)],
            "finish_reason": {"type": "length", "length": n},
            "completion_tokens": n,
            "spec_verify_ct": 2,
            "spec_num_correct_drafts": n - 3,
            "spec_accept_length": n / 2,
            "num_retractions": 0,
            "weight_version": self.version,
        }
        meta.update(self.meta)
        return {"output_ids": toks, "meta_info": meta}

    def names(self, endpoint=None):
        return [c[0] for c in self.calls if endpoint is None or c[0] == endpoint]

    def stop(self):
        self._released.set()  # a hung handler returns (its client gave up long ago)
        self.httpd.shutdown()
        self.httpd.server_close()
