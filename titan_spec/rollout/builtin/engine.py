"""The built-in PyTorch rollout engine: batched, KV-cached, lossless EAGLE-3 speculative decoding.

Shape legend: B = active requests, P = longest prompt, K = draft tokens per round,
L = K + 1 verified tokens, V = target vocab, Vd = draft vocab, C = tap layers, D = dim.

One round for every active request (all requests of the batch together):

  1. draft: the trunk rows of the positions committed by the last round (one batched
     ``extend``), then K-1 chain ``step``s, proposing d_1..d_K with distributions q_1..q_K
  2. verify: ONE target forward over [y, d_1..d_K] (y = the pending, not yet processed
     token) gives p_1..p_{K+1} and the tap features of those positions
  3. accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection
     sample from normalize(max(0, p_i - q_i)); if all K pass, sample a bonus token from
     p_{K+1}. Greedy (T = 0) is the one-hot case: accept iff d_i == argmax p_i.
  4. commit a+1 tokens; the taps of the a+1 verified-and-kept positions feed the next
     round's draft trunk.

This is Leviathan et al. / Chen et al. speculative sampling, so the output follows the
target's (tempered, top-k/top-p filtered) distribution exactly, whatever the draft; the
draft only changes how many tokens one target forward yields. K = 0 is plain
autoregressive decoding in the same code path (verify a single token, no draft).

Depth: ``TorchEngineConfig.depth = "fixed"`` runs every round at K = num_draft_tokens;
"adaptive" picks K in 0..num_draft_tokens before each round (depth.py: live acceptance
estimates of the call and the engine's measured, then frozen, cost of a round at the
current batch size). All rows of a round share its K: they share one verify forward,
whose cost is set by the longest window, so a shorter window for some rows would only
lose their tokens. After K = 0 rounds the draft has not seen the committed positions yet:
their trunk rows wait as pending segments and the next drafting round extends them all.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from titan_spec.config import RolloutConfig, SpeculativeConfig
from titan_spec.models.draft import draft_kind
from titan_spec.models.hf_io import load_hf_into, read_hf_arch
from titan_spec.models.registry import build_target_config
from titan_spec.rollout.base import NamedTensors, Rollout, SamplingParams, named_tensor_items
from titan_spec.rollout.builtin.depth import (
    AcceptanceEstimate, AcceptanceState, RoundCosts, batch_buckets, choose_depth, sampling_mode,
)
from titan_spec.rollout.builtin.kv_cache import PROPOSERS, CachedTarget

__all__ = ["TorchEngineConfig", "TorchRolloutEngine", "filtered_probs", "sample_rows", "speculative_accept"]


@dataclass
class TorchEngineConfig:
    """Settings of the built-in engine (sampling settings come per call, in SamplingParams)."""

    num_draft_tokens: int = 4
    """K: draft tokens proposed and verified per round (chain drafting); 0 = no speculation.
    With depth = "adaptive" the most a round proposes."""
    depth: Literal["fixed", "adaptive"] = "fixed"
    """"fixed": every round proposes num_draft_tokens. "adaptive": each round picks K in
    0..num_draft_tokens maximising expected tokens per second (rollout/builtin/depth.py);
    its choices are a deterministic function of the cost table (``TorchRolloutEngine.costs``),
    so engines sharing a table make the same choices."""
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
    def from_sections(cls, rollout: RolloutConfig, speculative: SpeculativeConfig) -> "TorchEngineConfig":
        """The built-in engine's settings from the [rollout] and [speculative] sections
        (K = 0 when speculative.enabled is off)."""
        return cls(
            num_draft_tokens=speculative.num_draft_tokens if speculative.enabled else 0,
            depth=speculative.depth,
            max_batch_size=rollout.max_batch_size,
            compile=rollout.compile,
            progress=rollout.progress,
        )


def filtered_probs(logits_NV: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """The sampling distribution: softmax(logits / T) after top-k and top-p; one-hot at T = 0."""
    if sampling.greedy:
        return torch.zeros_like(logits_NV, dtype=torch.float32).scatter_(-1, logits_NV.argmax(-1, keepdim=True), 1.0)
    logits_NV = logits_NV.float() / sampling.temperature
    V = logits_NV.shape[-1]
    if 0 < sampling.top_k < V:
        kth_N1 = logits_NV.topk(sampling.top_k, dim=-1).values[..., -1:]
        logits_NV = logits_NV.masked_fill(logits_NV < kth_N1, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_NV, order_NV = logits_NV.sort(dim=-1, descending=True)
        p_sorted_NV = sorted_NV.softmax(-1)
        # Drop a token when the mass strictly before it already reaches top_p (the top one stays).
        drop_NV = (p_sorted_NV.cumsum(-1) - p_sorted_NV) >= sampling.top_p
        logits_NV = logits_NV.scatter(-1, order_NV, sorted_NV.masked_fill(drop_NV, float("-inf")))
    return logits_NV.softmax(-1)


def sample_rows(probs_NV: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    """One index per row, drawn with probability proportional to the row's (non-negative,
    not necessarily normalized) entries: the inverse CDF at one uniform per row.

    Why not torch.multinomial: on CPU it draws one exponential per vocabulary entry
    (74 vs 17 us at 8 rows of 256, 36 ms vs 1 ms at 8 rows of 151936), and a speculative
    round samples K + 1 times. The CDF is summed in float64 and the uniform is float32
    (< 1 - 2**-24), so u * total < total exactly: the index found is one whose entry is
    > 0 (a zero entry spans an empty interval of the CDF)."""
    cdf_NV = probs_NV.double().cumsum(-1)
    u_N1 = torch.rand(probs_NV.shape[0], 1, device=probs_NV.device, generator=gen) * cdf_NV[:, -1:]
    return torch.searchsorted(cdf_NV, u_N1, right=True)[:, 0]


def speculative_accept(
    p_BLV: torch.Tensor, d_BK: torch.Tensor, d_idx_BK: torch.Tensor, q_BKVd: torch.Tensor,
    d2t_Vd: torch.Tensor, gen: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampled acceptance rule (module docstring, step 3) on plain tensors, K >= 1.

    p_BLV: the target's sampling distributions p_1..p_{K+1} (filtered_probs of the verify
    logits); d_BK / d_idx_BK: the draft tokens as target / draft-vocab ids; q_BKVd: the
    draft distributions they were sampled from; d2t_Vd: target id of each draft id.
    Returns (a_B accepted draft tokens, new_BL: the a+1 committed tokens, left-aligned;
    entries past a+1 are filler). Draws u_BK first, then one sample_rows draw per row.
    """
    B, L, V = p_BLV.shape
    K = L - 1
    rows_B = torch.arange(B, device=p_BLV.device)
    p_d_BK = p_BLV[:, :K].gather(-1, d_BK[..., None])[..., 0]
    q_d_BK = q_BKVd.gather(-1, d_idx_BK[..., None])[..., 0]  # > 0: d was sampled from q
    u_BK = torch.rand(B, K, device=p_BLV.device, generator=gen)
    ok_BK = (u_BK * q_d_BK < p_d_BK).long()  # u < p/q, i.e. accept with prob min(1, p/q)
    a_B = ok_BK.cumprod(1).sum(1)
    # Residual at the first rejection a < K: max(0, p_a - q_a) with q mapped to target ids;
    # at a == K the padded q row is zero, so the residual is p_{K+1}: the bonus token.
    q_pad_BLVd = torch.cat([q_BKVd, q_BKVd.new_zeros(B, 1, q_BKVd.shape[-1])], dim=1)
    q_a_BV = torch.zeros(B, V, device=p_BLV.device, dtype=p_BLV.dtype)
    q_a_BV.scatter_(1, d2t_Vd.expand(B, -1), q_pad_BLVd[rows_B, a_B])
    p_a_BV = p_BLV[rows_B, a_B]
    r_BV = (p_a_BV - q_a_BV).clamp(min=0)
    # p == q up to rounding: a rejection (probability ~0) falls back to p itself.
    r_BV = torch.where(r_BV.sum(-1, keepdim=True) > 0, r_BV, p_a_BV)
    y_B = sample_rows(r_BV, gen)
    new_BL = torch.cat([d_BK, d_BK[:, :1]], dim=1)
    new_BL[rows_B, a_B] = y_B
    return a_B, new_BL


def _behaviour_logprobs(logits_NLV: torch.Tensor, tokens_NL: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    # log_softmax(logits / T); greedy uses T = 1 (a one-hot would give 0 / -inf, useless to RL).
    t = sampling.temperature if not sampling.greedy else 1.0
    logits_NLV = logits_NLV.float()
    logp_NLV = torch.log_softmax(logits_NLV / t if t != 1.0 else logits_NLV, dim=-1)
    return logp_NLV.gather(-1, tokens_NL[..., None])[..., 0]


class _Request:
    __slots__ = ("index", "prompt", "out", "logprobs", "verify_steps", "accepted", "drafted", "finish")

    def __init__(self, index: int, prompt: list[int]):
        self.index, self.prompt = index, prompt
        self.out: list[int] = []
        self.logprobs: list[float] = []
        self.verify_steps = self.accepted = self.drafted = 0
        self.finish: str | None = None


def _join_pending(segments: list[tuple]) -> tuple:
    """Pending draft trunk rows of several rounds as one (taps, tokens, start, n). Each
    segment's rows are contiguous positions that start where the previous segment's valid
    rows end; a stable sort moves every row's valid entries to the front, in order."""
    if len(segments) == 1:
        return segments[0]
    taps_BLCD = torch.cat([s[0] for s in segments], dim=1)
    tok_BL = torch.cat([s[1] for s in segments], dim=1)
    dev = tok_BL.device
    valid_BL = torch.cat([torch.arange(s[1].shape[1], device=dev)[None, :] < s[3][:, None] for s in segments], dim=1)
    order_BL = torch.sort((~valid_BL).long(), dim=1, stable=True).indices
    taps_BLCD = taps_BLCD.gather(1, order_BL[:, :, None, None].expand_as(taps_BLCD))
    return taps_BLCD, tok_BL.gather(1, order_BL), segments[0][2], sum(s[3] for s in segments)


class TorchRolloutEngine:
    """Engine protocol (rollout/base.py) over a torchtitan target and a draft (EAGLE-3; any
    draft kind with a cached proposer in kv_cache.PROPOSERS).

    The engine owns ``target`` and ``draft`` (pass copies if the trainer keeps training
    them; the trainer pushes new weights with update_*_weights). Both are put in eval mode.
    """

    def __init__(self, target: nn.Module, draft: nn.Module | None = None, config: TorchEngineConfig | None = None,
                 costs: RoundCosts | None = None):
        """costs: the round-cost table of adaptive depth, shared with other engines over the
        same models (measured into on first use; a new, empty one when None)."""
        config = config or TorchEngineConfig()
        if int(config.num_draft_tokens) != config.num_draft_tokens or config.num_draft_tokens < 0:
            raise ValueError(
                f"num_draft_tokens = {config.num_draft_tokens!r} must be an integer >= 0 (0 = no speculation)"
            )
        if config.depth not in ("fixed", "adaptive"):
            raise ValueError(f"depth = {config.depth!r} must be 'fixed' or 'adaptive'")
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
        self._draft = None  # the draft kind's cached proposer (kv_cache.PROPOSERS)
        if draft is not None:
            self._check_draft_fits(draft)
            self.draft = draft.to(self.device).eval()
            if draft.arch.kind not in PROPOSERS:
                raise ValueError(f"the built-in engine has no cached proposer for draft kind {draft.arch.kind!r} "
                                 f"(it has {', '.join(map(repr, PROPOSERS))}; rollout/builtin/kv_cache.PROPOSERS)")
            self._draft = PROPOSERS[draft.arch.kind](self.draft, self._target.embed)
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
        self._closed = False
        if config.compile:
            # Only the model math is compiled; index/mask building and sampling stay eager.
            self._target.compile(config.compile_backend)
            if self._draft is not None:
                self._draft.compile(config.compile_backend)

    @classmethod
    def from_pretrained(
        cls, policy_path: str, draft_path: str | None = None, config: TorchEngineConfig | None = None,
        max_seq_len: int | None = None, device: str | torch.device = "cpu", draft_kind_name: str = "eagle3",
    ) -> "TorchRolloutEngine":
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
            kind.load_into(draft, draft_path)
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
        self.last_depths = []
        with torch.inference_mode():
            est = None
            if self.adaptive:
                self._calibrate(min(chunk, len(prompts)), sampling)
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

    def _generate_batch(self, prompts: list[list[int]], sp: SamplingParams, gen: torch.Generator,
                        est: AcceptanceEstimate | None = None, fixed_k: int | None = None,
                        max_rounds: int = 0, round_s: list[float] | None = None) -> list[Rollout]:
        """est: the call's acceptance estimate (adaptive depth); fixed_k: every round at this
        K (calibration); max_rounds > 0: stop after that many rounds (calibration: the
        unfinished requests are dropped); round_s: receives each round's seconds."""
        dev, K_max, B = self.device, self.K, len(prompts)
        reqs = [_Request(i, p) for i, p in enumerate(prompts)]
        done: list[_Request] = []
        P_B = torch.tensor([len(p) for p in prompts], device=dev)
        P = int(max(len(p) for p in prompts))
        # Slots: prompt + completion, plus room for a final verify window that overshoots.
        slots = P + sp.max_new_tokens + K_max + 1
        self._target.new_cache(B, slots)
        # Fused weights and rotary tables, current for this batch (weights cannot change mid-call).
        tw = self._target.fused_weights()
        dw = None
        if K_max:
            self._draft.new_cache(B, slots)
            dw = self._draft.weights()
        mode = sampling_mode(sp.greedy, sp.top_k, sp.top_p)
        tokens_BP = torch.zeros(B, P, dtype=torch.long, device=dev)
        for b, p in enumerate(prompts):
            tokens_BP[b, : len(p)] = torch.tensor(p, device=dev)
        stop = set(sp.stop_token_ids or ())
        bar = self._progress_bar(B * sp.max_new_tokens) if round_s is None else None
        rounds = 0
        try:
            # Prefill: the whole prompt, logits at its last token -> the first completion token.
            logits_BV, taps_BPCD = self._target.forward(tokens_BP, torch.zeros_like(P_B), P_B - 1, n_slots=P, fused=tw)
            y_B = self._pick(logits_BV, sp, gen)
            lp_B1 = _behaviour_logprobs(logits_BV[:, None], y_B[:, None], sp)
            a_B = torch.zeros_like(P_B)
            keep, a_host = self._emit(reqs, done, y_B[:, None], a_B, lp_B1, stop, sp, bar, 0)
            # Positions live twice: on the device (index math) and on the host (slot counts,
            # so no forward needs a sync); the host copy advances from _emit's one transfer.
            c_B, c_host = P_B, [len(p) for p in prompts]  # target positions processed; y_B sits at c_B
            # Draft trunk rows not in the draft's cache yet: segments (taps, tokens, start, n),
            # one per round since the last drafting round (only K = 0 rounds make more than one).
            pend: list[tuple] = []
            if K_max:
                # The draft's pending trunk rows t = 0..P-1 read x[t+1]: the prompt shifted by one, then y.
                pend_tok_BP = torch.roll(tokens_BP, -1, dims=1)
                pend_tok_BP[torch.arange(B, device=dev), P_B - 1] = y_B
                pend = [(taps_BPCD, pend_tok_BP, torch.zeros_like(P_B), P_B)]
                pend_slots = P  # host bound on the pending rows' last position + 1
            while reqs:
                if keep is not None:
                    reqs = [reqs[i] for i in keep]
                    c_host = [c_host[i] for i in keep]
                    keep_B = torch.tensor(keep, dtype=torch.long, device=dev)
                    c_B, y_B = c_B[keep_B], y_B[keep_B]
                    self._target.cache.keep(keep_B)
                    if K_max:
                        pend = [tuple(x[keep_B] for x in _join_pending(pend))]
                        self._draft.cache.keep(keep_B)
                    if not reqs:
                        break
                if fixed_k is not None:
                    K = fixed_k
                elif est is not None:
                    K = choose_depth(est.alphas(), [sp.max_new_tokens - len(r.out) for r in reqs],
                                     self.costs.costs(mode, len(reqs), K_max))
                else:
                    K = K_max
                t0 = self._round_clock() if round_s is not None else 0.0
                c_max = max(c_host)
                d_BK = q_BKVd = d_idx_BK = None
                if K:
                    d_BK, d_idx_BK, q_BKVd = self._propose(_join_pending(pend), pend_slots, c_B, c_max, K, sp, gen, dw)
                    verify_BL = torch.cat([y_B[:, None], d_BK], dim=1)
                else:
                    verify_BL = y_B[:, None]
                    if len(pend) > 32:
                        pend = [_join_pending(pend)]  # a long K = 0 streak: keep the list short
                logits_BLV, taps_BLCD = self._target.forward(verify_BL, c_B, n_slots=c_max + K + 1, fused=tw)
                a_B, new_BL = self._accept(logits_BLV, d_BK, d_idx_BK, q_BKVd, sp, gen)
                lp_BL = _behaviour_logprobs(logits_BLV, new_BL, sp)
                keep, a_host = self._emit(reqs, done, new_BL, a_B, lp_BL, stop, sp, bar, K)
                if K_max:
                    seg = (taps_BLCD, new_BL, c_B, a_B + 1)
                    if K:
                        pend, pend_slots = [seg], c_max + K + 1
                    else:
                        pend.append(seg)
                        pend_slots = max(pend_slots, c_max + 1)
                y_B = new_BL.gather(1, a_B[:, None])[:, 0]
                c_B = c_B + a_B + 1
                c_host = [c + a + 1 for c, a in zip(c_host, a_host)]
                if est is not None:
                    est.observe(K, a_host)
                if round_s is not None:
                    round_s.append(self._round_clock() - t0)
                else:
                    self.last_depths.append(K)
                rounds += 1
                if max_rounds and rounds >= max_rounds:
                    break
        finally:
            self._target.cache = None
            if K_max:
                self._draft.cache = None
            if bar is not None:
                bar.close()
        done.sort(key=lambda r: r.index)
        return [
            Rollout(
                prompt_ids=r.prompt, output_ids=r.out, logprobs=r.logprobs, finish_reason=r.finish,
                verify_steps=r.verify_steps, accepted_tokens=r.accepted, drafted_tokens=r.drafted,
                policy_version=self.policy_version, draft_version=self.draft_version if K_max else 0,
            )
            for r in done
        ]

    # --- adaptive depth: the cost table -----------------------------------------------------

    CALIBRATION_ROUNDS = 3
    """Rounds per (bucket, K) and pass when measuring costs (the first, which also extends
    the draft over the prompt, is not timed; a pass keeps the fastest of the others)."""
    CALIBRATION_PASSES = 9
    """Passes over every (bucket, K), interleaved: each pass times every K of a bucket back
    to back, and the table keeps the median over passes of each K's ratio to K = 0, so a
    burst of other load that hits some passes does not move a choice. (5 passes of one
    timed round left ties and inversions between depths on this shared 2-core machine,
    e.g. K = 1..3 all at one cost, which sends every round to K = 3.)"""

    def _round_clock(self) -> float:
        """The clock a round's cost is read on. CPU: the CPU time of the thread that runs
        the round, which other processes' load on a shared machine does not inflate (their
        wall time is what it is, but the ratio between two depths is what the choice
        needs); this thread takes part in every parallel region and waits for the others,
        so its CPU time follows the round's wall time. Not the process's CPU time: OpenMP's
        other threads spin through the small ops of a round and bill it for time nobody
        waits for (at 2 threads, 8 rows: a plain step 7.6 ms of process time for 3.6 ms of
        wall time, so deeper rounds looked 15% cheaper relative to it than they are). The
        round ends with a host transfer, so all its work is done when the clock is read.
        GPU: wall time (the same transfer synchronizes the stream)."""
        return time.thread_time() if self.device.type == "cpu" else time.perf_counter()

    def _calibrate(self, batch: int, sp: SamplingParams) -> None:
        """Measures the cost table's missing entries for ``sp``'s sampling mode and every
        batch bucket up to ``batch`` (depth.batch_buckets): synthetic rounds at each fixed K
        on scratch caches, with a private RNG. Touches nothing a generate call reads (the
        caches are rebuilt per batch), so whether a call calibrates does not change its
        rollouts. Cost: CALIBRATION_PASSES x CALIBRATION_ROUNDS x (K_max + 1) rounds per
        bucket. Entry (bucket, K) = median over passes of the K = 0 round, times the median
        over passes of K's ratio to K = 0 in the same pass; made non-decreasing in K by
        pooling adjacent inversions (a deeper round cannot really cost less: the least-squares
        monotone fit, which neither trusts the lower nor the higher of two inverted
        measurements), lowered where a larger batch measured cheaper, and frozen into
        ``self.costs``."""
        mode = sampling_mode(sp.greedy, sp.top_k, sp.top_p)
        todo = self.costs.missing(mode, batch_buckets(batch), self.K)
        if not todo:
            return
        R = self.CALIBRATION_ROUNDS
        new = max(2, R * (self.K + 1) + 1)  # enough budget for R rounds even if all drafts pass
        plen = max(1, min(16, self._target.max_seq_len - new - self.K - 1))
        cal_sp = SamplingParams(sp.temperature, top_p=sp.top_p, top_k=sp.top_k, max_new_tokens=new)
        V = self._target.vocab_size
        gen = torch.Generator(device=self.device)
        gen.manual_seed(0)
        per_pass = {b: [] for b in todo}  # bucket -> per pass: fastest timed round of each K
        for _ in range(self.CALIBRATION_PASSES):
            for bucket in todo:
                prompts = [[(7 * i + 3 * b + 1) % V for i in range(plen)] for b in range(bucket)]
                row = []
                for k in range(self.K + 1):
                    s: list[float] = []
                    self._generate_batch(prompts, cal_sp, gen, fixed_k=k, max_rounds=R, round_s=s)
                    row.append(max(min(s[1:]), 1e-7))
                per_pass[bucket].append(row)
        best = {}
        for bucket, rows in per_pass.items():
            base = _median([r[0] for r in rows])
            best[bucket] = [base * _median([r[k] / r[0] for r in rows]) for k in range(self.K + 1)]
        best = {bucket: _non_decreasing(row) for bucket, row in best.items()}
        for i in range(len(todo) - 2, -1, -1):  # a smaller batch costs at most a larger one
            best[todo[i]] = [min(a, b) for a, b in zip(best[todo[i]], best[todo[i + 1]])]
        for bucket in todo:
            self.costs.set(mode, bucket, best[bucket])

    # --- draft, verify, emit --------------------------------------------------------------

    def _propose(self, pend, pend_slots: int, c_B, c_max: int, K: int, sp: SamplingParams, gen, dw):
        """K draft tokens per row (target ids), their draft-vocab ids and q (None when greedy).
        pend_slots, c_max: host-side slot bounds (no sync); dw: the draft's batch weights."""
        taps_BLCD, tok_BL, start_B, n_B = pend
        d2t_Vd = self.draft.draft_to_target_ids()
        h_BH, logits_BVd = self._draft.extend(taps_BLCD, tok_BL, start_B, n_B, n_slots=pend_slots, weights=dw)
        d, d_idx, q = [], [], []
        for j in range(K):
            if j:
                # Step j of the row at c-1 sits at position c-1+j (its branch slot).
                h_BH, logits_BVd = self._draft.step(h_BH, d[-1], c_B - 1 + j, n_slots=c_max + j, weights=dw)
            if sp.greedy:
                idx_B = logits_BVd.argmax(-1)
            else:
                q_BVd = filtered_probs(logits_BVd, sp)
                idx_B = sample_rows(q_BVd, gen)
                q.append(q_BVd)
            d_idx.append(idx_B)
            d.append(d2t_Vd[idx_B])
        return torch.stack(d, 1), torch.stack(d_idx, 1), (torch.stack(q, 1) if q else None)

    def _accept(self, logits_BLV, d_BK, d_idx_BK, q_BKVd, sp: SamplingParams, gen):
        """Returns (a_B accepted draft tokens, new_BL: the a+1 committed tokens, left-aligned)."""
        B, L, V = logits_BLV.shape
        K = L - 1
        if sp.greedy:
            arg_BL = logits_BLV.argmax(-1)
            if K == 0:
                return torch.zeros(B, dtype=torch.long, device=arg_BL.device), arg_BL
            # Accepted draft tokens equal the target's argmax, and so does the token after them.
            match_BK = (d_BK == arg_BL[:, :K]).long()
            return match_BK.cumprod(1).sum(1), arg_BL
        p_BLV = filtered_probs(logits_BLV, sp)
        if K == 0:
            return torch.zeros(B, dtype=torch.long, device=p_BLV.device), sample_rows(p_BLV[:, 0], gen)[:, None]
        return speculative_accept(p_BLV, d_BK, d_idx_BK, q_BKVd, self.draft.draft_to_target_ids(), gen)

    def _pick(self, logits_NV: torch.Tensor, sp: SamplingParams, gen) -> torch.Tensor:
        """One token per row from the sampling distribution (argmax when greedy)."""
        if sp.greedy:
            return logits_NV.argmax(-1)
        return sample_rows(filtered_probs(logits_NV, sp), gen)

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
            r.accepted += min(a, n)
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


def _non_decreasing(xs: list[float]) -> list[float]:
    """The least-squares non-decreasing fit of xs (pool adjacent violators: a run of
    values out of order becomes their mean)."""
    blocks: list[list[float]] = []  # [sum, count]
    for x in xs:
        blocks.append([x, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, n = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += n
    return [s / n for s, n in blocks for _ in range(int(n))]


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


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
