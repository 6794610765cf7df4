"""The built-in PyTorch rollout engine: batched, KV-cached, lossless speculative decoding with a
chain draft (EAGLE-3) or a block draft (DFlash, DSpark).

One round for every active request: propose (the draft kind's cached proposer, after one
batched ``extend`` of the trunk rows committed since, trunk.py), verify (ONE target forward
over the pending token and d_1..d_K, cached_target.py, which also gives the next round's
taps), accept (speculative sampling, sampling.py), append (``_emit``: the round's one host
transfer). The round in full: docs/rollout_engine.md, "How one round works".

This is Leviathan et al. / Chen et al. speculative sampling, so the output follows the
target's (tempered, top-k/top-p filtered) distribution exactly, whatever the draft; the
draft only changes how many tokens one target forward yields. K = 0 is plain
autoregressive decoding in the same code path (verify a single token, no draft).

Depth: ``BuiltinEngineConfig.depth = "fixed"`` runs every round at K = num_draft_tokens;
"adaptive" picks K in 0..num_draft_tokens before each round (depth.py: live acceptance
estimates of the call and the engine's measured, then frozen, cost of a round at the
current batch size; calibrate.py measures it, ``_timed_rounds``: the same rounds at fixed K).
"confidence" (a DSpark draft) proposes K and verifies the first K' the confidence head's
estimates keep (depth.py ``confidence_depth``).
All rows of a round share its K: they share one verify forward,
whose cost is set by the longest window, so a shorter window for some rows would only
lose their tokens. After K = 0 rounds the draft has not seen the committed positions yet:
their trunk rows wait as pending segments and the next drafting round extends them all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from titan_spec.config import RolloutConfig, SpeculativeConfig
from titan_spec.models.draft import KINDS, DraftKind, draft_kind
from titan_spec.models.hf_io import load_hf_into, read_hf_arch
from titan_spec.models.registry import build_target_config
from titan_spec.rollout.base import NamedTensors, Rollout, SamplingParams, named_tensor_items
from titan_spec.rollout.builtin.cached_target import CachedTarget
from titan_spec.rollout.builtin.calibrate import calibrate, round_clock
from titan_spec.rollout.builtin.depth import (
    AcceptanceEstimate,
    AcceptanceState,
    RoundCosts,
    choose_depth,
    confidence_depth,
    sampling_mode,
)
from titan_spec.rollout.builtin.sampling import accept, behaviour_logprobs, sample
from titan_spec.rollout.builtin.trunk import PendingTrunk

__all__ = ["BuiltinEngineConfig", "BuiltinRolloutEngine"]


@dataclass
class BuiltinEngineConfig:
    """Settings of the built-in engine (sampling settings come per call, in SamplingParams)."""

    num_draft_tokens: int = 4
    """K: draft tokens proposed and verified per round (chain drafting); 0 = no speculation.
    With depth = "adaptive" the most a round proposes."""
    depth: Literal["fixed", "adaptive", "confidence"] = "fixed"
    """"fixed": every round proposes num_draft_tokens. "adaptive": each round picks K in
    0..num_draft_tokens maximising expected tokens per second (rollout/builtin/depth.py);
    its choices are a deterministic function of the cost table (``BuiltinRolloutEngine.costs``),
    so engines sharing a table make the same choices. "confidence": the draft's confidence
    head picks each round's K in 1..num_draft_tokens (depth.py ``confidence_depth``)."""
    confidence_threshold: float = 0.5
    """depth = "confidence": verify proposal j > 1 while some row's estimate of reaching and
    accepting it is at least this."""
    max_batch_size: int = 0
    """Requests decoded together; larger calls are split. 0 = the whole call at once."""
    compile: bool = False
    """torch.compile the target and draft forwards (dynamic shapes; index/mask building and
    sampling stay eager). Off by default: the first calls pay minutes of compile on CPU."""
    compile_backend: str = "inductor"
    """torch.compile backend ("aot_eager" traces without codegen: for tests)."""
    progress: bool = False
    """Show a tqdm bar per batch (tokens/s and the running acceptance length)."""

    @classmethod
    def from_sections(cls, rollout: RolloutConfig, speculative: SpeculativeConfig) -> "BuiltinEngineConfig":
        """The built-in engine's settings from the [rollout] and [speculative] sections
        (K = 0 when speculative.enabled is off)."""
        return cls(
            num_draft_tokens=speculative.num_draft_tokens if speculative.enabled else 0,
            depth=speculative.effective_depth(rollout.engine),
            confidence_threshold=speculative.confidence_threshold,
            max_batch_size=rollout.max_batch_size,
            compile=rollout.compile,
            progress=rollout.progress,
        )


class _Request:
    __slots__ = ("index", "prompt", "out", "logprobs", "verify_steps", "accepted", "drafted", "finish")

    def __init__(self, index: int, prompt: list[int]):
        self.index, self.prompt = index, prompt
        self.out: list[int] = []
        self.logprobs: list[float] = []
        self.verify_steps = self.accepted = self.drafted = 0
        self.finish: str | None = None


class _Batch:
    """One batch's decode state between rounds (``BuiltinRolloutEngine._start_batch`` makes it,
    ``_round`` advances it): the running and finished requests, the rows' positions on the
    device (c_B) and the host (c_host), the pending token y_B, the draft's pending trunk rows,
    the batch's fused weights and the rows ``_emit`` kept running (None: all)."""

    __slots__ = ("reqs", "done", "stop", "bar", "keep", "c_B", "c_host", "y_B", "trunk", "tw", "dw", "d2t_Vd")

    def __init__(self, reqs: list[_Request], stop: set[int], bar):
        self.reqs, self.stop, self.bar = reqs, stop, bar
        self.done: list[_Request] = []
        self.keep: list[int] | None = None


class BuiltinRolloutEngine:
    """Engine protocol (rollout/base.py) over a torchtitan target and a draft (EAGLE-3; any
    draft kind whose ``DraftKind.cached_proposer`` gives one, models/draft/base.py).

    The engine owns ``target`` and ``draft`` (pass copies if the trainer keeps training
    them; the trainer pushes new weights with update_*_weights). Both are put in eval mode.
    """

    def __init__(
        self,
        target: nn.Module,
        draft: nn.Module | None = None,
        config: BuiltinEngineConfig | None = None,
        costs: RoundCosts | None = None,
    ):
        """costs: the round-cost table of adaptive depth, shared with other engines over the
        same models (measured into on first use; a new, empty one when None)."""
        config = config or BuiltinEngineConfig()
        if int(config.num_draft_tokens) != config.num_draft_tokens or config.num_draft_tokens < 0:
            raise ValueError(
                f"num_draft_tokens = {config.num_draft_tokens!r} must be an integer >= 0 (0 = no speculation)"
            )
        if config.depth not in ("fixed", "adaptive", "confidence"):
            raise ValueError(f"depth = {config.depth!r} must be 'fixed', 'adaptive' or 'confidence'")
        if config.max_batch_size < 0:
            raise ValueError(f"max_batch_size = {config.max_batch_size} must be >= 0 (0 = no limit)")
        if config.num_draft_tokens > 0 and draft is None:
            raise ValueError(f"num_draft_tokens = {config.num_draft_tokens} needs a draft model (or set it to 0)")
        self.config = config
        self.K = int(config.num_draft_tokens)
        self.target = target.eval()
        # Taps cost a stack per forward; compute them only when a draft will read them.
        tap_ids = tuple(draft.arch.tap_layer_ids) if draft is not None and self.K else ()
        self._target = CachedTarget(self.target, tap_ids)
        self.device = self.target.tok_embeddings.weight.device
        self.draft: nn.Module | None = None
        self._draft = None  # the draft kind's cached proposer (DraftKind.cached_proposer)
        if draft is not None:
            self._check_draft_fits(draft)
            self.draft = draft.to(self.device).eval()
            self._draft = _cached_proposer(self.draft, self._target.embed)
            block = self._draft.block_size
            if block and self.K > self._draft.proposals:
                raise ValueError(
                    f"num_draft_tokens = {self.K} is more than the draft's block proposes: it must be "
                    f"<= {self._draft.proposals} (block_size {block}"
                    + (" - 1)" if self._draft.proposals < block else ")")
                )
        self.by_confidence = config.depth == "confidence" and self.K > 0
        if self.by_confidence and not getattr(self._draft, "has_confidence", False):
            raise ValueError(
                f"depth = 'confidence' needs a draft with a confidence head (a DSpark draft built with "
                f"draft.dspark.confidence_head = true); this draft is kind {self.draft.arch.kind!r}"
                + (" without one" if self.draft.arch.kind == "dspark" else "")
            )
        self.policy_version = 0
        self.draft_version = 0
        self.adaptive = config.depth == "adaptive" and self.K > 0
        self.costs = costs if costs is not None else RoundCosts()
        self.acceptance = AcceptanceState(self.K) if self.adaptive else None
        """Adaptive depth's acceptance estimates, carried from call to call (depth.py): the
        next call starts from what the last one saw. Part of the engine's state: copy it
        (``state_dict``) to repeat a call, e.g. a retried RL step or a resumed run."""
        self.last_depths: list[int] = []
        """K of every round of the last generate call, in order (all its batches)."""
        self.last_rounds: list[tuple[int, int]] = []
        """(K, rows) of the same rounds: what the call cost by any round-cost table
        (rl/baselines.py prices the baselines' calls with adaptive depth's, depth.RoundCosts)."""
        self._closed = False
        if config.compile:
            # Only the model math is compiled; index/mask building and sampling stay eager.
            self._target.compile(config.compile_backend)
            if self._draft is not None:
                self._draft.compile(config.compile_backend)

    @classmethod
    def from_pretrained(
        cls,
        policy_path: str,
        draft_path: str | None = None,
        config: BuiltinEngineConfig | None = None,
        max_seq_len: int | None = None,
        device: str | torch.device = "cpu",
        draft_kind_name: str = "eagle3",
    ) -> "BuiltinRolloutEngine":
        """An engine over an HF policy directory and a draft directory of kind ``draft_kind_name``
        (EAGLE-3: SpecForge/SGLang's format)."""
        kind = draft_kind(draft_kind_name)
        arch = read_hf_arch(policy_path)
        draft_arch = kind.read_arch(draft_path) if draft_path else None
        # The target keeps the draft's tap ids, so its training forward returns the same taps.
        taps = tuple(draft_arch.tap_layer_ids) if draft_arch is not None else ()
        with torch.device(device):
            target = build_target_config(arch, tap_layer_ids=taps, max_seq_len=max_seq_len).build()
            target.init_weights(buffer_device=None)
        load_hf_into(target, policy_path, arch)
        draft = None
        if draft_arch is not None:
            draft = kind.build(draft_arch).to(device)
            kind.load_into(draft, draft_path, policy_path)
        return cls(target, draft, config)

    # --- validation ---------------------------------------------------------------------

    def _check_draft_fits(self, draft: nn.Module) -> None:
        t = self._target
        bad = draft.arch.misfits(t.vocab_size, t.dim)
        if not bad and not _d2t_ok(draft.d2t, t.vocab_size):
            bad.append("its d2t maps draft ids outside the target vocabulary or onto repeated ids")
        if bad:
            raise ValueError(f"the draft does not fit the target: {'; '.join(bad)}")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this rollout engine is closed")

    def _check_prompts(self, prompts, sampling: SamplingParams) -> list[list[int]]:
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        V, max_len = self._target.vocab_size, self._target.max_seq_len
        out = []
        for i, p in enumerate(prompts):
            p = [int(t) for t in p]
            if not p:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
            if min(p) < 0 or max(p) >= V:
                raise ValueError(f"prompt {i} has token ids outside the vocabulary 0..{V - 1}")
            if len(p) + sampling.max_new_tokens > max_len:
                raise ValueError(
                    f"prompt {i} has {len(p)} tokens; with max_new_tokens = {sampling.max_new_tokens} that is "
                    f"{len(p) + sampling.max_new_tokens} > the model's max length {max_len}"
                )
            out.append(p)
        return out

    # --- protocol -----------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Rollout]:
        self._check_open()
        prompts = self._check_prompts(prompts, sampling)
        if not prompts:
            return []
        gen = torch.Generator(device=self.device)
        if sampling.seed is None:
            gen.seed()
        else:
            gen.manual_seed(int(sampling.seed))
        chunk = self.config.max_batch_size or len(prompts)
        out: list[Rollout] = []
        self.last_depths, self.last_rounds = [], []
        with torch.inference_mode():
            est = None
            if self.adaptive:
                calibrate(
                    self.costs,
                    self._timed_rounds,
                    min(chunk, len(prompts)),
                    sampling,
                    self.K,
                    self._target.max_seq_len,
                    self._target.vocab_size,
                    self.device,
                )
                est = self.acceptance.of(sampling)
            for s in range(0, len(prompts), chunk):
                out += self._generate_batch(prompts[s : s + chunk], sampling, gen, est=est)
        return out

    def update_policy_weights(self, named_tensors: NamedTensors, version: int) -> None:
        self._check_open()
        _load_named(self.target, named_tensors, "policy")
        self.policy_version = int(version)

    def update_draft_weights(self, named_tensors: NamedTensors, version: int) -> None:
        self._check_open()
        if self.draft is None:
            raise ValueError("this engine has no draft (num_draft_tokens = 0); there are no draft weights to update")
        V = self._target.vocab_size

        def check(values: dict[str, torch.Tensor]) -> None:
            if "d2t" in values and not _d2t_ok(values["d2t"], V):
                raise ValueError("draft weights: d2t maps draft ids outside the target vocabulary or onto repeated ids")

        _load_named(self.draft, named_tensors, "draft", check)
        self.draft_version = int(version)

    def close(self) -> None:
        self._closed = True
        self._target.cache = None
        if self._draft is not None:
            self._draft.cache = None

    # --- one batch ----------------------------------------------------------------------

    def _generate_batch(
        self, prompts: list[list[int]], sp: SamplingParams, gen: torch.Generator, est: AcceptanceEstimate | None = None
    ) -> list[Rollout]:
        """One batch of a call, each round at the depth ``_depth`` picks (est: the call's
        acceptance estimate, adaptive depth; it observes every round)."""
        bar = self._progress_bar(len(prompts) * sp.max_new_tokens)
        try:
            batch = self._start_batch(prompts, sp, gen, bar)
            while self._running(batch):
                K, a_host = self._round(batch, self._depth(batch.reqs, sp, est), sp, gen)
                if est is not None:
                    est.observe(K, a_host)
                self.last_depths.append(K)
                self.last_rounds.append((K, len(batch.reqs)))
        finally:
            self._end_batch()
            if bar is not None:
                bar.close()
        return self._rollouts(batch.done)

    def _timed_rounds(self, prompts, sp: SamplingParams, gen, k: int, rounds: int, round_s: list[float]) -> None:
        """calibrate.py's measurement (``calibrate.RunRounds``): ``rounds`` rounds of a fresh
        batch at fixed K = k, each round's seconds on ``round_clock`` appended to round_s
        (the prefill untimed; unfinished requests are dropped). The rounds are
        ``_generate_batch``'s, on the same scratch caches; no call state is touched."""
        try:
            batch = self._start_batch(prompts, sp, gen, None)
            for _ in range(rounds):
                if not self._running(batch):
                    break
                t0 = round_clock(self.device)
                self._round(batch, k, sp, gen)
                round_s.append(round_clock(self.device) - t0)
        finally:
            self._end_batch()

    # --- a batch's rounds: prefill, drop finished rows, one round, caches released ---------

    def _start_batch(self, prompts: list[list[int]], sp: SamplingParams, gen: torch.Generator, bar) -> "_Batch":
        """Fresh caches and the prefill: the whole prompt, logits at its last token -> each
        row's first completion token."""
        dev, K_max, B = self.device, self.K, len(prompts)
        batch = _Batch([_Request(i, p) for i, p in enumerate(prompts)], set(sp.stop_token_ids or ()), bar)
        P_B = torch.tensor([len(p) for p in prompts], device=dev)
        Lp = int(max(len(p) for p in prompts))
        # Slots: prompt + completion, plus room for a final verify window (or a draft block) that overshoots.
        ahead = max(K_max, self._draft.block_size - 1) if K_max else 0
        slots = Lp + sp.max_new_tokens + ahead + 1
        batch.tw, batch.dw, batch.d2t_Vd = self._new_batch(B, slots)
        tokens_BLp = torch.zeros(B, Lp, dtype=torch.long, device=dev)  # right-padded
        for b, p in enumerate(prompts):
            tokens_BLp[b, : len(p)] = torch.tensor(p, device=dev)
        logits_BV, taps_BLpCD = self._target.forward(
            tokens_BLp, torch.zeros_like(P_B), P_B - 1, n_slots=Lp, fused=batch.tw
        )
        y_B = sample(logits_BV, sp, gen)[0]
        lp_B1 = behaviour_logprobs(logits_BV[:, None], y_B[:, None], sp)
        batch.keep, _ = self._emit(
            batch.reqs, batch.done, y_B[:, None], torch.zeros_like(P_B), lp_B1, batch.stop, sp, bar, 0
        )
        # Positions live twice: on the device (index math) and on the host (slot counts,
        # so no forward needs a sync); the host copy advances from _emit's one transfer.
        batch.c_B, batch.c_host = P_B, [len(p) for p in prompts]  # target positions processed; y_B sits at c_B
        batch.y_B = y_B
        batch.trunk = PendingTrunk(taps_BLpCD, tokens_BLp, P_B, y_B, Lp) if K_max else None
        return batch

    def _running(self, batch: "_Batch") -> bool:
        """Drops the rows the last round finished (``_drop_finished``); whether any remain."""
        if batch.keep is not None:
            batch.reqs, batch.c_host, batch.c_B, batch.y_B = self._drop_finished(
                batch.keep, batch.reqs, batch.c_host, batch.c_B, batch.y_B, batch.trunk
            )
            batch.keep = None
        return bool(batch.reqs)

    def _round(self, batch: "_Batch", K: int, sp: SamplingParams, gen: torch.Generator) -> tuple[int, list[int]]:
        """One round at depth K for every running row: propose K tokens, verify [y, d_1..d_K]
        in ONE target forward, accept a of them, append the a+1 committed tokens (their taps
        feed the draft's next extend). Returns (the K verified: depth = "confidence" may
        verify fewer than proposed, each row's accepted draft count)."""
        c_max = max(batch.c_host)
        d_BK = d_idx_BK = q_BKVd = None
        if K:
            d_BK, d_idx_BK, q_BKVd = self._propose(
                batch.trunk, batch.y_B, batch.c_B, c_max, K, sp, gen, batch.dw, batch.d2t_Vd
            )
            K = d_BK.shape[1]
        verify_BL = torch.cat([batch.y_B[:, None], d_BK], dim=1) if K else batch.y_B[:, None]
        logits_BLV, taps_BLCD = self._target.forward(verify_BL, batch.c_B, n_slots=c_max + K + 1, fused=batch.tw)
        a_B, new_BL = accept(logits_BLV, d_BK, d_idx_BK, q_BKVd, batch.d2t_Vd, sp, gen)
        lp_BL = behaviour_logprobs(logits_BLV, new_BL, sp)
        batch.keep, a_host = self._emit(batch.reqs, batch.done, new_BL, a_B, lp_BL, batch.stop, sp, batch.bar, K)
        if batch.trunk is not None:
            batch.trunk.add((taps_BLCD, new_BL, batch.c_B, a_B + 1), K, c_max)
        batch.y_B = new_BL.gather(1, a_B[:, None])[:, 0]
        batch.c_B, batch.c_host = batch.c_B + a_B + 1, [c + a + 1 for c, a in zip(batch.c_host, a_host)]
        return K, a_host

    def _end_batch(self) -> None:
        """Releases the batch's caches (also after an error)."""
        self._target.cache = None
        if self.K:
            self._draft.cache = None

    # --- the batch's parts: caches, depth, proposals, emitted tokens ------------------------

    def _new_batch(self, batch: int, slots: int):
        """Fresh caches; the fused weights, rotary tables and d2t, current for this batch
        (weights cannot change mid-call) -> (target weights, draft weights, d2t_Vd)."""
        self._target.new_cache(batch, slots)
        if not self.K:
            return self._target.fused_weights(), None, None
        self._draft.new_cache(batch, slots)
        return self._target.fused_weights(), self._draft.weights(), self.draft.draft_to_target_ids()

    def _drop_finished(self, keep: list[int], reqs, c_host, c_B, y_B, trunk: PendingTrunk | None):
        """The running rows ``keep`` of the batch's state, their cache rows and pending trunk rows."""
        keep_B = torch.tensor(keep, dtype=torch.long, device=self.device)
        self._target.cache.keep(keep_B)
        if trunk is not None:
            trunk.keep(keep_B)
            self._draft.cache.keep(keep_B)
        return [reqs[i] for i in keep], [c_host[i] for i in keep], c_B[keep_B], y_B[keep_B]

    def _rollouts(self, done: list[_Request]) -> list[Rollout]:
        done.sort(key=lambda r: r.index)
        return [
            Rollout(
                prompt_ids=r.prompt,
                output_ids=r.out,
                logprobs=r.logprobs,
                finish_reason=r.finish,
                verify_steps=r.verify_steps,
                accepted_tokens=r.accepted,
                drafted_tokens=r.drafted,
                policy_version=self.policy_version,
                draft_version=self.draft_version if self.K else 0,
            )
            for r in done
        ]

    def _depth(self, reqs, sp: SamplingParams, est: AcceptanceEstimate | None) -> int:
        """This round's K: adaptive depth's choice (depth.py) or K_max."""
        if est is None:
            return self.K
        costs = self.costs.costs(sampling_mode(sp.greedy, sp.top_k, sp.top_p), len(reqs), self.K)
        # est.depth: now and then a probe at K_max where the choice is K = 0 (depth.PROBE_EVERY).
        return est.depth(choose_depth(est.alphas(), [sp.max_new_tokens - len(r.out) for r in reqs], costs))

    def _propose(self, trunk: PendingTrunk, y_B, c_B, c_max: int, K: int, sp: SamplingParams, gen, dw, d2t_Vd):
        """K draft tokens per row (target ids), their draft-vocab ids and q (None when greedy).
        c_max, trunk.slots: host-side slot bounds (no sync); dw: the draft's batch weights.
        A chain proposes token j from token j-1; a block (DFlash) all K from one forward, each
        sampled from its own q_j given the tokens before it (DSpark's rows read the previous
        one; DFlash's do not), so the acceptance rule is exact."""
        block = self._draft.block_size
        if block:
            self._draft.extend(*trunk.joined(), n_slots=trunk.slots, weights=dw)
            out_BJ = self._draft.propose(y_B, c_B, n_slots=c_max + block, weights=dw)
        else:
            h_BH, logits_BVd = self._draft.extend(*trunk.joined(), n_slots=trunk.slots, weights=dw)
        d, d_idx, q, conf = [], [], [], []
        for j in range(K):
            if block:
                logits_BVd, conf_B = self._draft.row(out_BJ, j, d[-1] if j else y_B, self.by_confidence)
                if conf_B is not None:
                    conf.append(conf_B)
            elif j:
                # Step j of the row at c-1 sits at position c-1+j (its branch slot).
                h_BH, logits_BVd = self._draft.step(h_BH, d[-1], c_B - 1 + j, n_slots=c_max + j, weights=dw)
            idx_B, q_BVd = sample(logits_BVd, sp, gen)
            if q_BVd is not None:
                q.append(q_BVd)
            d_idx.append(idx_B)
            d.append(d2t_Vd[idx_B])
        if conf:
            # depth.py confidence_depth: a host sync before the verify, which then runs K' <= K.
            K = confidence_depth(torch.stack(conf, 1), self.config.confidence_threshold)
            d, d_idx, q = d[:K], d_idx[:K], q[:K]
        return torch.stack(d, 1), torch.stack(d_idx, 1), (torch.stack(q, 1) if q else None)

    def _emit(self, reqs, done, new_BL, a_B, lp_BL, stop: set[int], sp: SamplingParams, bar, k: int):
        """Appends each row's committed tokens (cut after a stop token or at the budget).
        Returns (the rows still running, or None when all are; accepted drafts per row).

        The round's one device->host transfer: tokens, accepted counts and log-probs travel
        together (as float64, exact for token ids and float32 log-probs); the stop and budget
        logic then runs on the host."""
        L = new_BL.shape[1]
        host = torch.cat([new_BL.double(), a_B[:, None].double(), lp_BL.double()], dim=1).tolist()
        running, a_host, emitted = [], [], 0
        for b, r in enumerate(reqs):
            row = host[b]
            a = int(row[L])
            n = min(a + 1, sp.max_new_tokens - len(r.out))
            toks = [int(t) for t in row[:n]]
            cut = next((i for i, t in enumerate(toks) if t in stop), None) if stop else None
            if cut is not None:
                n, toks = cut + 1, toks[: cut + 1]
            r.out += toks
            r.logprobs += row[L + 1 : L + 1 + n]
            r.verify_steps += 1
            # n <= a + 1 always; a verify step counts one emitted token as the target's own
            # (a step cut at a stop token or the budget too): completion = verify_steps +
            # accepted, as vLLM and SGLang count it (rollout/vllm/engine.py, sglang/engine.py).
            r.accepted += n - 1
            r.drafted += k
            emitted += n
            a_host.append(a)
            if cut is not None or len(r.out) >= sp.max_new_tokens:
                r.finish = "stop" if cut is not None else "length"
                done.append(r)
            else:
                running.append(b)
        if bar is not None:
            bar.update(emitted)
            steps = sum(r.verify_steps for r in reqs)
            toks_total = sum(len(r.out) for r in reqs)
            bar.set_postfix(accept_len=f"{toks_total / max(steps, 1):.2f}", refresh=False)
        return (None if len(running) == len(reqs) else running), a_host

    def _progress_bar(self, total: int):
        if not self.config.progress:
            return None
        from tqdm.auto import tqdm

        return tqdm(total=total, unit="tok", desc="rollout", dynamic_ncols=True)


def _cached_proposer(draft: nn.Module, embed):
    """The draft kind's cached proposer (models/draft/base.CachedProposer); ValueError (one
    line) naming the kinds that have one when this draft's kind has none."""
    kind = KINDS.get(draft.arch.kind)
    proposer = kind.cached_proposer(draft, embed) if kind is not None else None
    if proposer is None:
        serving = [n for n, k in KINDS.items() if type(k).cached_proposer is not DraftKind.cached_proposer]
        raise ValueError(
            f"the built-in engine has no cached proposer for draft kind {draft.arch.kind!r} "
            f"(it has {', '.join(map(repr, serving))}; DraftKind.cached_proposer)"
        )
    return proposer


def _d2t_ok(d2t: torch.Tensor, vocab_size: int) -> bool:
    ids = torch.arange(d2t.numel(), device=d2t.device) + d2t
    return bool(ids.min() >= 0 and ids.max() < vocab_size and ids.unique().numel() == ids.numel())


def _load_named(module: nn.Module, named_tensors: NamedTensors, what: str, check=None) -> None:
    """Copy full tensors into ``module`` by state-dict name, all-or-nothing: every name and
    shape is checked before the first copy, so a bad push leaves the old weights in place."""
    own = module.state_dict()
    items = named_tensor_items(named_tensors)
    unknown = [k for k, _ in items if k not in own]
    if unknown:
        raise ValueError(f"{what} weights: unknown name(s) {unknown[:4]}{'...' if len(unknown) > 4 else ''}")
    values = {}
    for k, v in items:
        v = v.full_tensor() if isinstance(v, DTensor) else v
        if tuple(v.shape) != tuple(own[k].shape):
            raise ValueError(f"{what} weights: {k} has shape {tuple(v.shape)}, the engine's is {tuple(own[k].shape)}")
        values[k] = v
    if check is not None:
        check(values)
    with torch.no_grad():
        for k, v in values.items():
            own[k].copy_(v.to(device=own[k].device, dtype=own[k].dtype))
