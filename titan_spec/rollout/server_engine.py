"""What the SGLang and vLLM rollout engines share: the bookkeeping of a served model.

Both engines serve the policy and its EAGLE-3 draft from a separate server process and
keep, on the trainer's side, exactly the same state:

    versions       policy_version, draft_version (the last GOOD push of each), restarts
    start tables   name -> (shape, dtype) of what the server loaded at start; every push
                   is checked against them before anything is sent
    host copies    the last good pushes (_policy, _draft) and the draft's start d2t/t2d
                   (_draft_maps): what a restarted server is brought back to
    faults         _call retries a call on a fresh server when the old one died or hangs,
                   pushing both host copies again, up to max_restarts in a row

What differs stays in each engine: how a server is launched and reached (``_launch``,
``_reconnect``), how one push is sent (``_push``), and ``generate``.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import threading
from collections.abc import Callable
from typing import Self

import torch

from titan_spec.config.engine_env import env_script
from titan_spec.models.hf_io import read_hf_arch
from titan_spec.rollout.base import NamedTensors, SamplingParams
from titan_spec.rollout.weight_names import draft_to_export_names, policy_to_hf_names

__all__ = ["ServerRolloutEngine", "resolve_python"]

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_python(explicit: str, engine: str, error: type[Exception]) -> str:
    """The engine environment's interpreter: ``explicit`` (rollout.<engine>.python), else the
    one scripts/ensure_<engine>_env.sh builds on first use (idempotent: reused while its pins
    are unchanged, shared by every clone on the machine). A failed build raises ``error``
    with the script's last lines."""
    if explicit:
        return explicit
    script = env_script(engine)
    try:
        out = subprocess.run(["bash", script], check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as e:
        lines = [ln for ln in (e.stderr or "").splitlines() if "is ignored" not in ln]
        raise error(f"{script} could not build the {engine} environment: {' | '.join(lines[-4:])}") from None
    return out.stdout.strip().splitlines()[-1]


def _free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerRolloutEngine:
    """Base of the engines (rollout/base.py protocol) that talk to a rollout server.

    A subclass sets the class attributes below, calls ``_init_engine`` and
    ``_init_bookkeeping`` in its ``__init__`` (in that order, with its own checks around
    them) and provides ``_launch``, ``_reconnect``, ``_push`` and ``generate``. Pushes,
    restarts and close are done here, identically for every server.
    """

    _server = "server"
    """The server's name in messages ("SGLang", "vLLM")."""
    _lost_what = "server"
    """What is lost in log lines ("SGLang engine", "vLLM server")."""
    _section = ""
    """The config table under [rollout] ("sglang", "vllm"): cfg.rollout.<section>."""
    _died: tuple[type[BaseException], ...] = ()
    """Exceptions that mean the server is lost (restart it and retry the call)."""
    _died_error: type[BaseException] = RuntimeError
    """Raised once max_restarts restarts in a row failed."""
    _refusal = ""
    """Why a push that fails the checks is never sent, for the ValueError."""
    _host_device: str | None = None
    """Where _cast puts the tensors of a push (None: where the trainer has them)."""
    _log = logger
    """The subclass's module logger, so that its log lines keep their logger name."""

    # --- construction -------------------------------------------------------------------

    def _init_engine(self, config, policy_path: str, num_draft_tokens) -> None:
        """Check K and read the policy's architecture: the first step of every engine."""
        if int(num_draft_tokens) != num_draft_tokens or num_draft_tokens < 0:
            raise ValueError(f"num_draft_tokens = {num_draft_tokens!r} must be an integer >= 0 (0 = no speculation)")
        self.config = config
        self.K = int(num_draft_tokens)
        self.arch = read_hf_arch(policy_path)

    def _init_bookkeeping(self, policy_table: dict, connect: Callable[[dict], object] | None) -> None:
        """Versions, start tables, empty host copies, the lock and the flags. The draft's
        start table and maps are set afterwards by the subclass (``_set_draft_start``)."""
        self._dtype = _DTYPES.get(self.config.dtype)
        self._connect = connect or self._launch
        self.policy_version = 0
        self.draft_version = 0
        self.restarts = 0
        # What the server's models hold, by name: the start files' tensors. A push is
        # checked against these before it is sent.
        self._policy_table = policy_table
        self._draft_table: dict = {}
        # Host copies of the last GOOD pushes, to push again after a restart. The policy
        # starts empty: a fresh server loads its start weights from policy_path itself.
        self._policy: dict[str, torch.Tensor] = {}
        self._draft: dict[str, torch.Tensor] = {}
        self._draft_maps: dict[str, torch.Tensor] = {}
        self._seed_warned = False
        # One lock serializes generate and pushes: no request is in flight during a push.
        self._lock = threading.RLock()
        self._lost = False
        self._closed = False

    def _set_draft_start(self, start: dict[str, torch.Tensor]) -> None:
        """The draft's start tensors (export names) -> its table and its d2t/t2d, which
        the server reads once at start, so a push must not change them."""
        self._draft_table = {n: (tuple(t.shape), t.dtype) for n, t in start.items()}
        self._draft_maps = {n: start[n] for n in ("d2t", "t2d") if n in start}

    @classmethod
    def from_config(cls, cfg, draft_path: str | None = None, connect=None) -> Self:
        """From the run's config sections (a TitanSpecConfig or the trainer's config): config = rollout.<section>, policy = model.hf_checkpoint,
        draft = draft_path or draft.init_from, K = speculative.num_draft_tokens (0 when
        speculation is off); the server's batch limit (SGLang's max_running_requests, vLLM's
        max_num_seqs) defaults to one step's requests, rl.prompts_per_step x rl.group_size."""
        K = cfg.speculative.num_draft_tokens if cfg.speculative.enabled else 0
        batch = cfg.rl.prompts_per_step * cfg.rl.group_size
        section = getattr(cfg.rollout, cls._section)
        return cls(section, cfg.model.hf_checkpoint, draft_path or cfg.draft.init_from or None, K, connect, batch)

    # --- what each engine provides ------------------------------------------------------

    def _launch(self, args: dict):
        """Start a server from these arguments and return its client."""
        raise NotImplementedError

    def _reconnect(self):
        """A fresh server after a loss (``self._connect`` of the engine's arguments), with
        whatever the engine resets for a server that holds only its start weights."""
        raise NotImplementedError

    def _push(self, client, kind: str, pairs: dict[str, torch.Tensor], tag: str) -> None:
        """Send one checked weight set ("policy" or "draft") to the server; ``tag`` is the
        version string the weights are served under."""
        raise NotImplementedError

    def _check_pushable(self) -> None:
        """Raise if the server cannot take a push right now (default: it always can)."""

    def _extra_push_problems(self, pairs: dict[str, torch.Tensor]) -> list[str]:
        """The server's own reasons to refuse a push, beyond names, shapes and dtypes."""
        return []

    def _sendable_draft(self, pairs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The part of a checked draft push that is sent (default: all of it)."""
        return pairs

    def _draft_names(self, named_tensors: NamedTensors) -> list[tuple[str, torch.Tensor]]:
        """A draft push by the names the server loads (default: EAGLE-3's export names)."""
        return draft_to_export_names(named_tensors)

    def _after_close(self) -> None:
        """Clean up what the engine owns besides the server (default: nothing)."""

    # --- faults -------------------------------------------------------------------------

    def _call(self, fn):
        """fn(client), restarting the server (and pushing both last good weight sets again)
        when it died or hangs; gives up after max_restarts failed attempts in a row, leaving
        the engine marked lost so that the next call starts a fresh server."""
        failures = 0
        while True:
            try:
                if self._lost:
                    self._restart()
                return fn(self._client)
            except self._died as e:
                failures += 1
                self._lost = True
                n = self.config.max_restarts
                if failures > n:
                    raise self._died_error(
                        f"{e}; gave up after {n} restart(s) (rollout.{self._section}.max_restarts)"
                    ) from None
                self._log.warning(f"{self._lost_what} lost (%s); restarting (%d/%d)", e, failures, n)

    def _restart(self) -> None:
        """Shut the lost server down, start a fresh one and push the last good weights."""
        try:
            self._client.shutdown()
        except Exception as e:  # the old one is already broken; keep going
            self._log.warning(f"shutting down the lost {self._lost_what} failed: %s", e)
        self.restarts += 1
        self._client = self._reconnect()
        self._push_stored(self._client)
        self._lost = False

    def _push_stored(self, client) -> None:
        """A fresh server holds its start weights: bring it to the last good ones."""
        tag = self._version_tag()
        if self._policy:
            self._push(client, "policy", self._policy, tag)
        if self._draft:
            self._push(client, "draft", self._draft, tag)

    # --- pushes -------------------------------------------------------------------------

    def _version_tag(self, policy: int | None = None, draft: int | None = None) -> str:
        """The weight version string the server serves: "policy-P.draft-D"."""
        p = self.policy_version if policy is None else policy
        d = self.draft_version if draft is None else draft
        return f"policy-{p}.draft-{d}"

    def _cast(self, pairs) -> dict[str, torch.Tensor]:
        """(name, tensor) pairs -> detached tensors, floats in the serving dtype, on
        ``_host_device`` (or left where they are)."""
        dt, dev = self._dtype, self._host_device
        out = {}
        for n, t in pairs:
            t = t.detach()
            if dt is not None and t.is_floating_point():
                t = t.to(dev, dt) if dev else t.to(dt)
            elif dev:
                t = t.to(dev)
            out[n] = t
        return out

    def _check_push(self, what: str, pairs: dict[str, torch.Tensor], table: dict) -> None:
        """ValueError (one line) unless the server takes every tensor of this push: a known
        name, the served shape, a float for a float (cast to the serving dtype already) and
        the same integer dtype otherwise; the draft's d2t/t2d unchanged; and whatever the
        engine adds (``_extra_push_problems``)."""
        bad = []
        for name, t in pairs.items():
            if name not in table:
                bad.append(f"{name}: the server has no such tensor")
                continue
            shape, dtype = table[name]
            if tuple(t.shape) != shape:
                bad.append(f"{name}: shape {list(t.shape)} != served {list(shape)}")
            elif t.is_floating_point() != dtype.is_floating_point or (not dtype.is_floating_point and t.dtype != dtype):
                bad.append(f"{name}: dtype {t.dtype} where the server holds {dtype}")
            elif name in self._draft_maps and not torch.equal(t.cpu(), self._draft_maps[name].cpu()):
                bad.append(
                    f"{name} differs from the one {self._server} loaded at start (the draft vocabulary is fixed "
                    "for the server's lifetime; restart it to change it)"
                )
        bad += self._extra_push_problems(pairs)
        if bad:
            raise ValueError(
                f"{what} push refused before sending ({self._refusal}): "
                f"{'; '.join(bad[:3])}{'; ...' if len(bad) > 3 else ''}"
            )

    def _update(self, kind: str, pairs: dict, version: int) -> None:
        """Push one weight set; it becomes the host copy and its version the engine's only
        when the server has taken it. A failed push (refused, or the server died and did not
        come back within max_restarts) leaves the last good copy and version, which every
        restart pushes."""
        store = self._policy if kind == "policy" else self._draft
        tag = self._version_tag(**{kind: int(version)})
        self._call(lambda c: self._push(c, kind, pairs, tag))
        # Copies: the trainer updates its tensors in place, and a re-push must send these.
        store.update({n: t.to("cpu", copy=True) for n, t in pairs.items()})
        setattr(self, f"{kind}_version", int(version))

    def update_policy_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """torchtitan names, full tensors. DTensors are gathered here with full_tensor(), a
        collective: under FSDP gather on every rank and let the engine's owner push. Checked
        before anything is sent; a refused push leaves the last good weights and version."""
        self._check_open()
        pairs = self._cast(policy_to_hf_names(named_tensors, self.arch))
        self._check_push("policy", pairs, self._policy_table)
        with self._lock:
            self._check_pushable()
            self._update("policy", pairs, version)

    def update_draft_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """Export names (fc.weight, midlayer.*, ..., d2t, t2d); checked as the policy is."""
        self._check_open()
        if not self.K:
            raise ValueError("this engine has no draft (num_draft_tokens = 0); there are no draft weights to update")
        pairs = self._cast(self._draft_names(named_tensors))
        self._check_push("draft", pairs, self._draft_table)
        pairs = self._sendable_draft(pairs)
        with self._lock:
            self._check_pushable()
            self._update("draft", pairs, version)

    # --- protocol -----------------------------------------------------------------------

    def _check_open(self) -> None:
        """RuntimeError once the engine is closed."""
        if self._closed:
            raise RuntimeError("this rollout engine is closed")

    def _checked_prompts(self, prompts: list[list[int]], sampling: SamplingParams) -> list[list[int]]:
        """The start of every generate: the engine is open, ``sampling`` a SamplingParams,
        and the prompts (returned as lists of ints) each non-empty and inside the
        vocabulary, then the engine's own per-prompt check (``_check_prompt``), in order."""
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
            self._check_prompt(i, p, sampling)
        return prompts

    def _check_prompt(self, i: int, prompt: list[int], sampling) -> None:
        """The engine's own check of prompt i (default: none)."""

    @property
    def server_pid(self) -> int | None:
        """The server process's id, also its process group's (None for a client without one)."""
        return getattr(self._client, "pid", None)

    def close(self) -> None:
        """Shut the server down; the engine refuses every call afterwards."""
        if not self._closed:
            self._closed = True
            try:
                self._client.shutdown()
            finally:
                self._after_close()
