"""SGLang as a rollout engine: EAGLE-3 speculative serving behind the engine protocol.

    engine = SGLangRolloutEngine.from_config(cfg)           # rollout.engine = "sglang"
    out = engine.generate(prompts, SamplingParams(...))     # list[Rollout], as BuiltinRolloutEngine
    engine.update_policy_weights(model.state_dict(), version=step)   # torchtitan names
    engine.update_draft_weights(draft.state_dict(), version=step)    # export names

The server is started from the policy's HF directory and an exported draft directory
(``speculative_algorithm = "EAGLE3"``); after that both weight sets are pushed live with
``update_weights_from_tensor``, the policy with selector "target", the draft with "draft",
each push one pause / update / flush / continue bracket.

Invariants: every push is checked here first against the names, shapes and dtypes of the
server's start files (SGLang's scheduler dies on an exception in a custom loader, so a push
its loaders would refuse is never sent); a push becomes the engine's host copy and version
only once SGLang has taken it, and a server that exits or stops answering is restarted with
the last good weights before the call is retried (``max_restarts``). The bracket, the
checks and the faults in full: docs/rollout_engine.md, "SGLang engine".

One server per trainer rank (docs/rollout_engine.md, "One server per rank"): each rank's
server runs on that rank's GPU (``base_gpu_id`` = LOCAL_RANK), so its pushes are CUDA IPC
handles of tensors on the same GPU (on CPU, named shared-memory files: client.py);
``tp_size`` > 1 is for single-process runs. The server runs in SGLang's own environment
(serving.py); this process never imports sglang.
"""

from __future__ import annotations

import glob
import logging
import os
import random
import re
import tempfile
from collections.abc import Callable

import torch
from safetensors.torch import load_file

from titan_spec.models.safetensors_header import tensor_table
from titan_spec.rollout.base import Rollout, SamplingParams
from titan_spec.platform import on_cpu
from titan_spec.rollout.server_engine import ServerRolloutEngine, _free_port, resolve_python
from titan_spec.rollout.sglang.client import EngineDied, SGLangError, SGLangStartError, launch_server
from titan_spec.rollout.sglang.server.titan_spec_sglang_loaders import DRAFT_LOADER, TARGET_LOADER
from titan_spec.rollout.sglang.serving import cpu_server_args, server_env
from titan_spec.rollout.weight_names import (
    check_draft_fits_policy,
    draft_to_export_names,
)

__all__ = [
    "SGLangRolloutEngine",
    "sglang_server_args",
    "sampling_to_sglang",
    "rollout_from_result",
    "MANAGED_SERVER_ARGS",
    "MEMORY_TAGS",
    "SEEDS_IGNORED",
    "SEED_MIX",
]

logger = logging.getLogger(__name__)

# Fields this module sets; rollout.sglang.server_args may add any other ServerArgs field.
MANAGED_SERVER_ARGS = (
    "model_path",
    "host",
    "port",
    "tp_size",
    "dtype",
    "mem_fraction_static",
    "skip_tokenizer_init",
    "custom_weight_loader",
    "enable_memory_saver",
    "speculative_algorithm",
    "speculative_draft_model_path",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
    "enable_draft_weights_cpu_backup",
    "max_running_requests",
    "enable_deterministic_inference",
    "base_gpu_id",
)

# SGLang's memory kinds (GPU_MEMORY_ALL_TYPES); tags=None releases or resumes all of them.
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")

SEEDS_IGNORED = (
    "SGLang ignores sampling_seed unless the server runs with enable_deterministic_inference, so these "
    "seeded rollouts are not reproducible; set rollout.sglang.deterministic = true to honour seeds "
    "(SGLang 0.5.23 then forces batch-invariant ops and the pytorch sampler: slower decoding; attention "
    "backend ascend, fa3, fa4, flashinfer, intel_xpu or triton only; with flashinfer the radix cache is disabled)"
)

# Request i of a call seeded s gets sampling_seed (s * SEED_MIX + i) mod 2**62. Guarantee:
# two calls whose seeds differ by d, 0 < |d| < 2**62 / SEED_MIX (~4.4e12), never share a
# request seed for request indices below SEED_MIX (> 2**20): a collision needs
# d * SEED_MIX == i' - i (mod 2**62), but |d| * SEED_MIX lies in [SEED_MIX, 2**62) while
# |i' - i| < SEED_MIX. So the RL loop's adjacent ranks (seed base * 4096 + rank) and steps
# never collide, where seed + i would (rank r's request 1 == rank r+1's request 0).
SEED_MIX = 2**20 + 7  # odd: s -> s * SEED_MIX is a bijection mod 2**62
_SEED_MOD = 2**62

# meta_info keys across sglang versions (0.5.23 first). Verify steps exclude the prefill.
_VERIFY_KEYS = ("spec_verify_ct",)
_ACCEPTED_KEYS = ("spec_num_correct_drafts", "spec_accept_token_num", "spec_accepted_tokens")
_VERSION_RE = re.compile(r"policy-(\d+)\.draft-(\d+)")


def sglang_server_args(
    cfg, policy_path: str, draft_path: str | None, num_draft_tokens: int, max_running_requests: int = 0
) -> dict:
    """[rollout.sglang] + paths + K -> sglang ServerArgs fields (sglang/srt/arg_groups/fields/).

    K draft tokens in a chain are SGLang's ``speculative_num_steps = K`` with
    ``eagle_topk = 1`` and ``num_draft_tokens = K + 1`` (it counts the verified root).
    ``max_running_requests`` is always set (cfg's, else the caller's RL batch): left unset,
    SGLang resets it to 48 under speculation, which throttles an RL batch of G x prompts.
    """
    clash = sorted(set(cfg.server_args) & set(MANAGED_SERVER_ARGS))
    if clash:
        raise ValueError(
            f"rollout.sglang.server_args sets {clash}, which titan_spec sets itself; use the [rollout.sglang] keys"
        )
    args = {
        "model_path": policy_path,
        "host": cfg.host,
        "port": cfg.port or _free_port(),
        "tp_size": cfg.tp_size,
        "dtype": cfg.dtype,
        "mem_fraction_static": cfg.mem_fraction_static,
        "skip_tokenizer_init": True,  # token ids in, token ids out
        "custom_weight_loader": [TARGET_LOADER, DRAFT_LOADER],
        "enable_memory_saver": cfg.enable_memory_saver,
        # One server per rank, on the rank's own GPU (torchrun sets LOCAL_RANK).
        "base_gpu_id": int(os.environ.get("LOCAL_RANK", "0")),
    }
    if cfg.max_running_requests or max_running_requests:
        args["max_running_requests"] = int(cfg.max_running_requests or max_running_requests)
    if cfg.deterministic:
        args["enable_deterministic_inference"] = True
    if on_cpu():
        args.update(cpu_server_args(speculates=num_draft_tokens > 0))
    if num_draft_tokens > 0:
        if not draft_path:
            raise ValueError(f"num_draft_tokens = {num_draft_tokens} needs a draft directory (or set it to 0)")
        args.update(
            speculative_algorithm="EAGLE3",
            speculative_draft_model_path=draft_path,
            speculative_num_steps=num_draft_tokens,
            speculative_eagle_topk=cfg.eagle_topk,
            speculative_num_draft_tokens=cfg.num_verify_tokens or num_draft_tokens + 1,
            enable_draft_weights_cpu_backup=cfg.enable_draft_weights_cpu_backup,
        )
    args.update(cfg.server_args)
    return args


def sampling_to_sglang(sp: SamplingParams, n: int, seeded: bool = True) -> list[dict]:
    """SamplingParams -> one SGLang sampling_params dict per request
    (sglang/srt/sampling/sampling_params.py). Seeds differ per request so that G copies of
    one prompt give G different samples; they are sent only when ``seeded`` (the server
    runs deterministic inference: otherwise SGLang ignores them), then always (a fresh
    random base when ``sp.seed`` is None). Without stop ids SGLang
    must not stop at the model's EOS either (``ignore_eos``), as the built-in engine does not."""
    base = {
        "max_new_tokens": sp.max_new_tokens,
        "temperature": float(sp.temperature),  # 0 = greedy in SGLang too
        "top_p": float(sp.top_p),
        "top_k": sp.top_k if sp.top_k > 0 else -1,
    }
    if sp.stop_token_ids:
        base["stop_token_ids"] = list(sp.stop_token_ids)
    else:
        base["ignore_eos"] = True
    # Under deterministic inference SGLang 0.5.23 samples a request WITHOUT sampling_seed
    # with seed 42 (sampling/sampling_batch_info.py) and hashes only (seed, position): G
    # unseeded copies of a prompt would be identical. An unseeded call gets a fresh base.
    seed = None
    if seeded:
        seed = int(sp.seed) if sp.seed is not None else random.SystemRandom().getrandbits(62)
    out = []
    for i in range(n):
        d = dict(base)
        if seed is not None:
            d["sampling_seed"] = (seed * SEED_MIX + i) % _SEED_MOD  # SEED_MIX: no cross-rank collision
        out.append(d)
    return out


def _first(meta: dict, keys) -> int | None:
    for k in keys:
        if meta.get(k) is not None:
            return int(meta[k])
    return None


def rollout_from_result(prompt: list[int], result: dict, speculates: bool, versions: tuple[int, int]) -> Rollout:
    """One SGLang /generate result -> Rollout.

    Tokens and behaviour log-probs both come from ``meta_info.output_token_logprobs``
    ((logprob, token_id, text) per output token), so they pair up exactly. SGLang's
    logprobs are log_softmax(logits / T) before top-k/top-p (T = 1 when greedy), the
    protocol's definition.

    Counts. Every target forward that emits tokens for the request counts as a verify
    step: the prefill, each re-prefill after a retraction (``num_retractions``; SGLang's
    ``spec_verify_ct`` counts neither) and each verify. Every such forward emits at least
    one token, so accepted drafts = completion - verify steps, and SGLang's own
    ``spec_num_correct_drafts`` is only an upper bound: it also counts the drafts its final
    verify accepted past a stop token or the length budget, which are not emitted. The
    parsed counts satisfy completion = verify_steps + accepted_tokens (unless SGLang reports
    fewer accepted drafts than that, which is logged and its count used).
    """
    meta = result.get("meta_info") or {}
    lp = meta.get("output_token_logprobs")
    if lp is None:
        raise SGLangError("SGLang result has no meta_info.output_token_logprobs (was return_logprob dropped?)")
    ids = [int(t[1]) for t in lp]
    logprobs = [float(t[0]) for t in lp]
    fin = meta.get("finish_reason")
    kind = fin.get("type") if isinstance(fin, dict) else fin
    if kind not in ("stop", "length"):
        msg = fin.get("message") if isinstance(fin, dict) else fin
        raise SGLangError(f"SGLang did not finish a request (finish_reason {kind!r}: {msg})")
    n = int(meta.get("completion_tokens", len(ids)))
    if not speculates:
        verify, accepted = n, 0
    else:
        vct = _first(meta, _VERIFY_KEYS)
        if vct is None and meta.get("spec_accept_length"):
            vct = round(n / float(meta["spec_accept_length"]))
        if vct is None and n > 1:
            # SGLang leaves the spec keys out only when no verify ran (a 1-token completion).
            logger.warning("SGLang meta_info has no speculative stats (%s); acceptance reads as 1.0", sorted(meta))
            vct = n - 1
        vct = vct or 0
        verify = min(1 + vct + int(meta.get("num_retractions") or 0), n) if n else 0
        accepted = n - verify
        acc = _first(meta, _ACCEPTED_KEYS)
        if acc is not None and acc < accepted:  # SGLang counted fewer: a forward we do not know of
            logger.warning(
                "SGLang reports %d accepted drafts for %d tokens in %d verify steps; using its count", acc, n, verify
            )
            accepted = acc
    pv, dv = versions
    m = _VERSION_RE.search(str(meta.get("weight_version", "")))
    if m:
        pv, dv = int(m.group(1)), int(m.group(2))
    return Rollout(
        prompt_ids=list(prompt),
        output_ids=ids,
        logprobs=logprobs,
        finish_reason=kind,
        verify_steps=verify,
        accepted_tokens=accepted,
        policy_version=pv,
        draft_version=dv,
    )


class SGLangRolloutEngine(ServerRolloutEngine):
    """Engine protocol (rollout/base.py) over an SGLang server with an EAGLE-3 draft.

    ``connect(server_args)`` returns a client (client.py); by default it launches the
    titan_spec SGLang server with the SGLang environment's python (serving.py). It is
    called again for every restart.

    State the engine tracks so that it never sends SGLang a request that crashes it:
    the start files' tensor table (every push is checked against it), the last good host
    copies and versions (what a restart pushes; server_engine.py keeps these), and which
    memory tags are released (SGLang's resume of a tag it did not release raises KeyError
    in its scheduler). One lock serializes generate, pushes and memory calls: SGLang
    asserts that no request is in flight when it releases memory.
    """

    _server = "SGLang"
    _lost_what = "SGLang engine"
    _section = "sglang"
    _died = (EngineDied,)
    _died_error = EngineDied
    _refusal = "SGLang's scheduler would die on it"
    _log = logger

    def __init__(
        self,
        config,
        policy_path: str,
        draft_path: str | None,
        num_draft_tokens: int,
        connect: Callable[[dict], object] | None = None,
        max_running_requests: int = 0,
    ):
        # The server runs in its log folder: relative directories would be resolved there.
        policy_path = os.path.abspath(policy_path)
        draft_path = os.path.abspath(draft_path) if draft_path else draft_path
        self._init_engine(config, policy_path, num_draft_tokens)
        if self.K:
            if not draft_path:
                raise ValueError(f"num_draft_tokens = {self.K} needs a draft directory (or set it to 0)")
            check_draft_fits_policy(policy_path, draft_path)
        self.server_args = sglang_server_args(config, policy_path, draft_path, self.K, max_running_requests)
        self._init_bookkeeping(tensor_table(sorted(glob.glob(os.path.join(policy_path, "*.safetensors")))), connect)
        if self.K:
            # The draft's host copy starts from its directory (small); the policy's only
            # from its first push (the server loads the rest from policy_path).
            start = load_file(os.path.join(draft_path, "model.safetensors"))
            self._draft = self._cast(draft_to_export_names(start))
            # SGLang copies the draft->target map once at start; a push must not change it.
            self._set_draft_start(self._draft)
        self._released: set[str] = set()
        self._policy_released = False
        self._python = resolve_python(config.python, "sglang", SGLangStartError) if connect is None else ""
        self._client = self._connect(self.server_args)

    def _launch(self, server_args: dict):
        """The titan_spec SGLang server (serving.py), with the SGLang environment's interpreter."""
        c = self.config
        log_dir = c.log_dir or tempfile.gettempdir()
        os.makedirs(log_dir, exist_ok=True)
        log = os.path.join(log_dir, f"sglang-{server_args['port']}.log")
        env = server_env(self._python)
        return launch_server(self._python, server_args, env, c.start_timeout_s, c.request_timeout_s, log)

    # --- faults -------------------------------------------------------------------------

    def _reconnect(self):
        """A fresh server, on a fresh port unless the config pins one."""
        if not self.config.port:
            self.server_args["port"] = _free_port()
        client = self._connect(self.server_args)
        # A fresh server holds all its memory and its start weights.
        self._released.clear()
        self._policy_released = False
        return client

    # --- pushes -------------------------------------------------------------------------

    def _push(self, client, kind: str, pairs: dict[str, torch.Tensor], tag: str) -> None:
        """One bracket (module docstring): the policy with selector "target" and the
        target loader, the draft with "draft" and the draft loader."""
        loader, selector = (TARGET_LOADER, "target") if kind == "policy" else (DRAFT_LOADER, "draft")
        pairs = [(n, t.cuda() if torch.cuda.is_available() and not t.is_cuda else t) for n, t in pairs.items()]
        client.pause()
        done = False
        try:
            client.begin_update(selector)
            try:
                client.update_tensors(pairs, loader, tag, selector)
            except SGLangError:
                client.end_update()  # close the session so that the next push can open one
                raise
            client.end_update()
            client.flush_cache()  # the cached prefixes were computed by the old weights
            done = True
        finally:
            try:
                client.unpause()
            except (EngineDied, SGLangError):
                if done:
                    raise

    def _check_pushable(self) -> None:
        """RuntimeError while the server's weights are released."""
        if "weights" in self._released:
            raise RuntimeError("the server's weights are released: call resume_memory() before pushing weights")

    def _update(self, kind: str, pairs: dict, version: int) -> None:
        """ServerRolloutEngine._update; a taken policy push also ends a policy release."""
        super()._update(kind, pairs, version)
        if kind == "policy":
            self._policy_released = False

    # --- memory (colocated training) ----------------------------------------------------

    def release_memory(self, tags: list[str] | None = None) -> None:
        """Free the server's GPU memory while the trainer runs (needs enable_memory_saver).
        Tags already released are skipped; waits for a generate in flight to finish."""
        self._check_open()
        wanted = self._memory_tags(tags)
        with self._lock:
            # Inside the retried call: a restarted server holds everything again.
            def release(c):
                todo = [t for t in wanted if t not in self._released]
                if todo:
                    c.release_memory(todo)
                    self._released.update(todo)

            self._call(release)

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Take the memory back; only tags that are released are resumed (nothing at all
        on a server that was never released or was restarted since). Released weights come
        back as garbage unless SGLang kept a CPU backup, so the draft is pushed again at
        once; the policy is pushed again before the next generate unless the trainer pushes
        a new one first (it usually does)."""
        self._check_open()
        wanted = self._memory_tags(tags)
        with self._lock:
            resumed: list[str] = []

            def resume(c):
                resumed.clear()
                todo = [t for t in wanted if t in self._released]
                if todo:
                    c.resume_memory(todo)
                    self._released.difference_update(todo)
                    resumed.extend(todo)

            self._call(resume)
            if "weights" in resumed:
                if self._draft:
                    self._call(lambda c: self._push(c, "draft", self._draft, self._version_tag()))
                self._policy_released = not self.server_args.get("enable_weights_cpu_backup")

    @staticmethod
    def _memory_tags(tags) -> list[str]:
        """None or [] -> all of SGLang's memory kinds; unknown tags are a ValueError."""
        if tags is None or len(tags) == 0:
            return list(MEMORY_TAGS)
        unknown = [t for t in tags if t not in MEMORY_TAGS]
        if unknown:
            raise ValueError(f"memory tags {unknown} are not SGLang's; use {list(MEMORY_TAGS)} (or None for all)")
        return list(dict.fromkeys(tags))

    def server_info(self) -> dict:
        """SGLang's /server_info (its arguments and state; on CPU ``titan_spec_cpu`` lists the
        sgl_kernel stand-ins and patches the server loaded)."""
        self._check_open()
        with self._lock:
            return self._call(lambda c: c.server_info())

    # --- protocol -----------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Rollout]:
        """One Rollout per prompt; a policy whose weights were released is pushed again first."""
        prompts = self._checked_prompts(prompts, sampling)
        if not prompts:
            return []
        seeded = bool(self.config.deterministic)
        if sampling.seed is not None and not seeded and not self._seed_warned:
            logger.warning(SEEDS_IGNORED)
            self._seed_warned = True
        params = sampling_to_sglang(sampling, len(prompts), seeded)
        with self._lock:
            if self._released:
                raise RuntimeError(
                    f"the server's memory {sorted(self._released)} is released: call resume_memory() before generate"
                )
            if self._policy_released:
                if not self._policy:
                    raise RuntimeError(
                        "the policy's weights were released and none was pushed since: call "
                        "update_policy_weights first (or set enable_weights_cpu_backup in rollout.sglang.server_args)"
                    )
                self._call(lambda c: self._push(c, "policy", self._policy, self._version_tag()))
                self._policy_released = False
            results = self._call(lambda c: c.generate(prompts, params))
            versions = (self.policy_version, self.draft_version)
        if len(results) != len(prompts):
            raise SGLangError(f"SGLang answered {len(results)} results for {len(prompts)} prompts")
        return [rollout_from_result(p, r, self.K > 0, versions) for p, r in zip(prompts, results)]
