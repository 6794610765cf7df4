"""SGLang as a rollout engine: EAGLE-3 speculative serving behind the engine protocol.

    engine = SGLangRolloutEngine.from_config(cfg)           # rollout.engine = "sglang"
    out = engine.generate(prompts, SamplingParams(...))     # list[Rollout], as TorchRolloutEngine
    engine.update_policy_weights(model.state_dict(), version=step)   # torchtitan names
    engine.update_draft_weights(draft.state_dict(), version=step)    # export names

The server is started from the policy's HF directory and an exported draft directory
(``speculative_algorithm = "EAGLE3"``); after that both weight sets are pushed live with
``update_weights_from_tensor``. Each push is one bracket:

    pause_generation("retract") -> begin_weight_update(selector) ->
    update_weights_from_tensor(load_format = our loader, weight_version, selector) ->
    end_weight_update -> flush_cache -> continue_generation

The policy goes with selector "target" and ``load_target_weights``, the draft with
selector "draft" and ``load_draft_weights`` (sglang_loaders.py says why both guards).
sglang 0.5.23 has no ``disable_draft_model`` argument; the request's ``selector`` is
what it offers instead (io_struct.UpdateWeightsFromTensorReqInput).

Faults: a server that exits or stops answering is restarted and both weight sets are
pushed again from host copies of the last pushes, then the call is retried; the trainer
only sees an error after ``max_restarts`` failed restarts in a row.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import tempfile
from collections.abc import Callable

import torch
from safetensors.torch import load_file

from titan_spec.models.hf_io import read_hf_arch
from titan_spec.rl.rollout.base import NamedTensors, Rollout, SamplingParams
from titan_spec.rl.rollout.sglang_client import EngineDied, InProcessClient, SGLangError, launch_server
from titan_spec.rl.rollout.sglang_loaders import DRAFT_LOADER, TARGET_LOADER
from titan_spec.rl.rollout.sglang_names import check_draft_fits_policy, draft_to_export_names, policy_to_hf_names

__all__ = ["SGLangRolloutEngine", "sglang_server_args", "sampling_to_sglang", "rollout_from_result", "MANAGED_SERVER_ARGS"]

logger = logging.getLogger(__name__)

# Fields this module sets; rollout.sglang.server_args may add any other ServerArgs field.
MANAGED_SERVER_ARGS = (
    "model_path", "host", "port", "tp_size", "dtype", "mem_fraction_static", "skip_tokenizer_init",
    "custom_weight_loader", "enable_memory_saver", "speculative_algorithm", "speculative_draft_model_path",
    "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens",
    "enable_draft_weights_cpu_backup",
)

# meta_info keys across sglang versions (0.5.23 first). Verify steps exclude the prefill.
_VERIFY_KEYS = ("spec_verify_ct",)
_ACCEPTED_KEYS = ("spec_num_correct_drafts", "spec_accept_token_num", "spec_accepted_tokens")
_VERSION_RE = re.compile(r"policy-(\d+)\.draft-(\d+)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sglang_server_args(cfg, policy_path: str, draft_path: str | None, num_draft_tokens: int) -> dict:
    """[rollout.sglang] + paths + K -> sglang ServerArgs fields (sglang/srt/arg_groups/fields/).

    K draft tokens in a chain are SGLang's ``speculative_num_steps = K`` with
    ``eagle_topk = 1`` and ``num_draft_tokens = K + 1`` (it counts the verified root).
    """
    clash = sorted(set(cfg.server_args) & set(MANAGED_SERVER_ARGS))
    if clash:
        raise ValueError(f"rollout.sglang.server_args sets {clash}, which titan_spec sets itself; use the [rollout.sglang] keys")
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
    }
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


def sampling_to_sglang(sp: SamplingParams, n: int) -> list[dict]:
    """SamplingParams -> one SGLang sampling_params dict per request
    (sglang/srt/sampling/sampling_params.py). Seeds differ per request so that G copies of
    one prompt give G different samples. Without stop ids SGLang must not stop at the
    model's EOS either (``ignore_eos``), as the built-in engine does not."""
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
    out = []
    for i in range(n):
        d = dict(base)
        if sp.seed is not None:
            d["sampling_seed"] = int(sp.seed) + i
        out.append(d)
    return out


def _first(meta: dict, keys) -> int | None:
    for k in keys:
        if meta.get(k) is not None:
            return int(meta[k])
    return None


def rollout_from_result(prompt: list[int], result: dict, spec: bool, versions: tuple[int, int]) -> Rollout:
    """One SGLang /generate result -> Rollout.

    Tokens and behaviour log-probs both come from ``meta_info.output_token_logprobs``
    ((logprob, token_id, text) per output token), so they pair up exactly. SGLang's
    logprobs are log_softmax(logits / T) before top-k/top-p (T = 1 when greedy), the
    protocol's definition. Verify steps are ``spec_verify_ct`` plus the prefill (the
    protocol counts it); accepted drafts are ``spec_num_correct_drafts`` (older names
    accepted), else completion - 1 - spec_verify_ct (each verify emits accepted + 1).
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
    if not spec:
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
        acc = _first(meta, _ACCEPTED_KEYS)
        verify, accepted = 1 + vct, acc if acc is not None else max(n - 1 - vct, 0)
    pv, dv = versions
    m = _VERSION_RE.search(str(meta.get("weight_version", "")))
    if m:
        pv, dv = int(m.group(1)), int(m.group(2))
    return Rollout(
        prompt_ids=list(prompt), output_ids=ids, logprobs=logprobs, finish_reason=kind,
        verify_steps=verify, accepted_tokens=accepted, policy_version=pv, draft_version=dv,
    )


_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class SGLangRolloutEngine:
    """Engine protocol (rl/rollout/base.py) over an SGLang server with an EAGLE-3 draft.

    ``connect(server_args)`` returns a client (sglang_client.py); by default it launches
    ``python -m sglang.launch_server`` (config mode "server") or builds ``sglang.Engine``
    in this process (mode "engine"). It is called again for every restart.
    """

    def __init__(self, config, policy_path: str, draft_path: str | None, num_draft_tokens: int,
                 connect: Callable[[dict], object] | None = None):
        if int(num_draft_tokens) != num_draft_tokens or num_draft_tokens < 0:
            raise ValueError(f"num_draft_tokens = {num_draft_tokens!r} must be an integer >= 0 (0 = no speculation)")
        self.config = config
        self.K = int(num_draft_tokens)
        self.arch = read_hf_arch(policy_path)
        if self.K:
            if not draft_path:
                raise ValueError(f"num_draft_tokens = {self.K} needs a draft directory (or set it to 0)")
            check_draft_fits_policy(policy_path, draft_path)
        self.server_args = sglang_server_args(config, policy_path, draft_path, self.K)
        self._dtype = _DTYPES.get(config.dtype)
        self._connect = connect or self._launch
        self.policy_version = 0
        self.draft_version = 0
        self.restarts = 0
        # Host copies of what the server holds beyond its start files, to push again after a
        # restart or a memory release. The draft starts from its directory (small); the
        # policy only from its first push (the server loads the rest from policy_path).
        self._policy: dict[str, torch.Tensor] = {}
        self._draft: dict[str, torch.Tensor] = {}
        if self.K:
            self._draft = self._cast(draft_to_export_names(load_file(os.path.join(draft_path, "model.safetensors"))))
        self._policy_released = False
        self._lost = False
        self._closed = False
        self._client = self._connect(self.server_args)

    @classmethod
    def from_config(cls, cfg, draft_path: str | None = None, connect=None) -> "SGLangRolloutEngine":
        """From a TitanSpecConfig: policy = model.hf_checkpoint, draft = draft_path or
        draft.init_from, K = speculative.num_draft_tokens (0 when speculation is off)."""
        K = cfg.speculative.num_draft_tokens if cfg.speculative.enabled else 0
        return cls(cfg.rollout.sglang, cfg.model.hf_checkpoint, draft_path or cfg.draft.init_from or None, K, connect)

    def _launch(self, server_args: dict):
        c = self.config
        if c.mode == "engine":
            return InProcessClient(server_args)
        log_dir = c.log_dir or tempfile.gettempdir()
        os.makedirs(log_dir, exist_ok=True)
        log = os.path.join(log_dir, f"sglang-{server_args['port']}.log")
        return launch_server(server_args, c.start_timeout_s, c.request_timeout_s, log)

    # --- faults -------------------------------------------------------------------------

    def _call(self, fn):
        """fn(client), restarting the server (and pushing both weight sets again) when it
        died or hangs; gives up after max_restarts failed attempts in a row."""
        failures = 0
        while True:
            try:
                if self._lost:
                    self._restart()
                return fn(self._client)
            except EngineDied as e:
                failures += 1
                if failures > self.config.max_restarts:
                    raise EngineDied(f"{e}; gave up after {self.config.max_restarts} restart(s) (rollout.sglang.max_restarts)") from None
                logger.warning("SGLang engine lost (%s); restarting (%d/%d)", e, failures, self.config.max_restarts)
                self._lost = True

    def _restart(self) -> None:
        try:
            self._client.shutdown()
        except Exception as e:  # the old one is already broken; keep going
            logger.warning("shutting down the lost SGLang engine failed: %s", e)
        self.restarts += 1
        if not self.config.port:
            self.server_args["port"] = _free_port()
        self._client = self._connect(self.server_args)
        self._push_stored(self._client)
        self._lost = False

    def _push_stored(self, client) -> None:
        if self._policy:
            self._push(client, list(self._policy.items()), TARGET_LOADER, "target")
        if self._draft:
            self._push(client, list(self._draft.items()), DRAFT_LOADER, "draft")

    # --- pushes -------------------------------------------------------------------------

    def _version_tag(self) -> str:
        return f"policy-{self.policy_version}.draft-{self.draft_version}"

    def _push(self, client, pairs, loader: str, selector: str) -> None:
        pairs = [(n, t.cuda() if torch.cuda.is_available() and not t.is_cuda else t) for n, t in pairs]
        client.pause()
        done = False
        try:
            client.begin_update(selector)
            try:
                client.update_tensors(pairs, loader, self._version_tag(), selector)
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

    def _cast(self, pairs) -> dict[str, torch.Tensor]:
        dt = self._dtype
        return {n: (t.detach().to(dt) if dt is not None and t.is_floating_point() else t.detach()) for n, t in pairs}

    def _update(self, store: dict, pairs: dict, loader: str, selector: str, attr: str, version: int) -> None:
        saved = (dict(store), getattr(self, attr))
        # Copies: the trainer updates its tensors in place, and a re-push must send these.
        store.update({n: t.to("cpu", copy=True) for n, t in pairs.items()})
        setattr(self, attr, int(version))
        try:
            self._call(lambda c: self._push(c, list(pairs.items()), loader, selector))
        except SGLangError:
            store.clear()
            store.update(saved[0])
            setattr(self, attr, saved[1])
            raise

    def update_policy_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """torchtitan names, full tensors. DTensors are gathered here with full_tensor(), a
        collective: under FSDP gather on every rank and let the engine's owner push."""
        self._check_open()
        pairs = self._cast(policy_to_hf_names(named_tensors, self.arch))
        self._update(self._policy, pairs, TARGET_LOADER, "target", "policy_version", version)
        self._policy_released = False

    def update_draft_weights(self, named_tensors: NamedTensors, version: int) -> None:
        self._check_open()
        if not self.K:
            raise ValueError("this engine has no draft (num_draft_tokens = 0); there are no draft weights to update")
        pairs = self._cast(draft_to_export_names(named_tensors))
        self._update(self._draft, pairs, DRAFT_LOADER, "draft", "draft_version", version)

    # --- memory (colocated training) ----------------------------------------------------

    def release_memory(self, tags: list[str] | None = None) -> None:
        """Free the server's GPU memory while the trainer runs (needs enable_memory_saver)."""
        self._check_open()
        self._call(lambda c: c.release_memory(tags))

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Take the memory back. Released weights come back as garbage unless SGLang kept a
        CPU backup, so the draft is pushed again at once; the policy is pushed again before
        the next generate unless the trainer pushes a new one first (it usually does)."""
        self._check_open()
        self._call(lambda c: c.resume_memory(tags))
        if tags is None or "weights" in tags:
            if self._draft:
                self._call(lambda c: self._push(c, list(self._draft.items()), DRAFT_LOADER, "draft"))
            self._policy_released = not self.server_args.get("enable_weights_cpu_backup")

    # --- protocol -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this rollout engine is closed")

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Rollout]:
        self._check_open()
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        V = self.arch.vocab_size
        prompts = [[int(t) for t in p] for p in prompts]
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
            if min(p) < 0 or max(p) >= V:
                raise ValueError(f"prompt {i} has token ids outside the vocabulary 0..{V - 1}")
        if not prompts:
            return []
        if self._policy_released:
            if not self._policy:
                raise RuntimeError(
                    "the policy's weights were released and none was pushed since: call "
                    "update_policy_weights first (or set enable_weights_cpu_backup in rollout.sglang.server_args)"
                )
            self._call(lambda c: self._push(c, list(self._policy.items()), TARGET_LOADER, "target"))
            self._policy_released = False
        params = sampling_to_sglang(sampling, len(prompts))
        results = self._call(lambda c: c.generate(prompts, params))
        if len(results) != len(prompts):
            raise SGLangError(f"SGLang answered {len(results)} results for {len(prompts)} prompts")
        versions = (self.policy_version, self.draft_version)
        return [rollout_from_result(p, r, self.K > 0, versions) for p, r in zip(prompts, results)]

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._client.shutdown()
