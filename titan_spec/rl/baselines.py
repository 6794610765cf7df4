"""The RL loop's measurements: at baseline steps the step's prompts and seed also go through
the draft as it was before RL, without speculation and at fixed depths; nothing trains on them.

Schedule: step 1 and every rl.baseline_interval-th step, on the step's first generation
round only (``is_baseline_step``; rl.dynamic_sampling's further rounds never). The calls run
back to back with the step's, and a call's place in such a sequence moves its time on CPU,
so the order turns over at every other baseline step (``turned_over``): the step's call,
frozen, no-spec; then no-spec, frozen, the step's. The fixed-depth calls follow the pair.

What measures (``build_baselines``):
  built-in engine (``EngineBaselines``): over the worker's ONE target module and the step's
      draft module, so a push reaches every engine:
    frozen        the policy + the draft before RL (co-training only)
    nospec        the policy alone, K = 0
    fixed, frozen_fixed   both drafts at fixed K = speculative.num_draft_tokens (the drafts'
                  quality at equal depth, whatever adaptive depth chose)
    fixed_k1 .. fixed_k{K-1}   the step's draft at every smaller fixed K (adaptive depth
                  only: with nospec and fixed, every fixed K, for the depth policy's regret)
  vLLM, SGLang (``ServerBaselines``): the step's draft, then the frozen one pushed into the same
      server for its call and the step's pushed back ("frozen_fixed" is that call);
  otherwise (``Baselines``): nothing, an empty dict.

Metrics: ``baseline_sums`` / ``baseline_maxes`` join the step's reductions (one collective
each, rl/step_metrics.py), ``baseline_metrics`` reads the reduced values.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable

import torch

from titan_spec.rl.rollout_stats import RolloutStats
from titan_spec.rollout.base import Rollout, SamplingParams
from titan_spec.rollout.builtin.depth import RoundCosts, sampling_mode
from titan_spec.rollout.builtin.engine import BuiltinRolloutEngine

__all__ = [
    "Baselines",
    "EngineBaselines",
    "ServerBaselines",
    "baseline_maxes",
    "baseline_metrics",
    "baseline_names",
    "baseline_sums",
    "build_baselines",
    "is_baseline_step",
    "turned_over",
]

Generate = Callable[[list[list[int]], SamplingParams], tuple[list[Rollout], RolloutStats]]


def is_baseline_step(step: int, interval: int) -> bool:
    """Whether step ``step``'s first generation round runs the baselines (0: never)."""
    return bool(interval and (step == 1 or step % interval == 0))


def turned_over(step: int, interval: int) -> bool:
    """Whether baseline step ``step`` runs the baselines before the step's call (every
    other baseline step)."""
    return (step // max(interval, 1)) % 2 == 1


class Baselines:
    """No baselines (no draft, rl.baseline_interval = 0): the step's call alone.
    The subclasses measure; ``run`` is the one entry point of a baseline step."""

    def __init__(self, interval: int):
        self.interval = interval

    def run(
        self, step: int, prompts: list[list[int]], sampling: SamplingParams, generate: Generate
    ) -> tuple[list[Rollout], RolloutStats, dict[str, RolloutStats]]:
        """Baseline step ``step``: the step's call (``generate``, the worker's, retried as
        usual) with the baselines around it in the step's order -> (its rollouts, its stats,
        the baselines' stats by name)."""
        turned = turned_over(step, self.interval)
        base = self.measure(prompts, sampling, reverse=True) if turned else {}
        rollouts, stats = generate(prompts, sampling)
        stats = dataclasses.replace(stats, priced_s=self.priced_main(sampling))
        if not turned:
            base = self.measure(prompts, sampling)
        return rollouts, stats, base

    def measure(
        self, prompts: list[list[int]], sampling: SamplingParams, reverse: bool = False
    ) -> dict[str, RolloutStats]:
        """The baselines' calls on these prompts and seed, by name (``reverse``: the pair's
        turned-over order)."""
        return {}

    def priced_main(self, sampling: SamplingParams) -> float:
        """The step's last call priced by the round-cost table (RolloutStats.priced_s)."""
        return 0.0

    def pushed(self, draft_state: dict[str, torch.Tensor], version: int) -> None:
        """The worker pushed the step's draft ``draft_state`` at ``version``."""

    def state_dict(self) -> dict:
        """The engines' carried acceptance estimates (checkpointed with the worker's)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def close(self) -> None:
        pass


class EngineBaselines(Baselines):
    """The built-in engine's baselines (the module docstring's table), sharing the worker's
    target and step's draft modules and its round-cost table."""

    def __init__(
        self,
        interval: int,
        engines: dict[str, BuiltinRolloutEngine],
        costs: RoundCosts,
        k_max: int,
        main: Callable[[], object],
        save_costs: Callable[[], None],
    ):
        """``engines``: by name, "frozen" and "nospec" first (the turned-over pair), then the
        fixed-depth ones in their call order; ``costs``: the table every call is priced by;
        ``main()``: the worker's current main engine (a retry may rebuild it);
        ``save_costs()``: persists the table when a call measured into it."""
        super().__init__(interval)
        self.engines = engines
        self.costs, self.k_max, self._main, self._save_costs = costs, k_max, main, save_costs

    @property
    def frozen(self) -> BuiltinRolloutEngine | None:
        return self.engines.get("frozen")

    def measure(self, prompts, sampling, reverse=False):
        out = {}
        pair = [n for n in ("frozen", "nospec") if n in self.engines]
        rest = [n for n in self.engines if n not in pair]
        for name in [*(reversed(pair) if reverse else pair), *rest]:
            engine = self.engines[name]
            t0 = time.perf_counter()
            rollouts = engine.generate(prompts, sampling)
            out[name] = RolloutStats.of(rollouts, time.perf_counter() - t0, self._priced(engine, sampling))
        self._save_costs()
        return out

    def priced_main(self, sampling):
        return self._priced(self._main(), sampling)

    def _priced(self, engine, sampling: SamplingParams) -> float:
        """``engine``'s last call's decode rounds priced by the shared round-cost table; 0
        without the table's entry for this sampling mode."""
        rounds = getattr(engine, "last_rounds", None)
        if not rounds:
            return 0.0
        return self.costs.price(sampling_mode(sampling.greedy, sampling.top_k, sampling.top_p), rounds, self.k_max)

    def state_dict(self):
        frozen = self.frozen
        if frozen is None or frozen.acceptance is None:  # not co-training, or fixed depth
            return {}
        return {"frozen": frozen.acceptance.state_dict()}

    def load_state_dict(self, state):
        frozen = self.frozen
        if frozen is not None and frozen.acceptance is not None and "frozen" in state:
            frozen.acceptance.load_state_dict(state["frozen"])

    def close(self):
        for engine in self.engines.values():
            engine.close()


class ServerBaselines(Baselines):
    """A server engine's (vLLM, SGLang) frozen-draft baseline on the step's own server (a second
    server would double its memory and start-up): the step's draft ("fixed"), then the draft
    before RL pushed in for its call ("frozen", also "frozen_fixed") and the step's pushed
    back, whatever the call did. Fixed depth only; ``reverse`` changes nothing."""

    def __init__(self, interval: int, main: Callable[[], object], frozen_draft: dict[str, torch.Tensor]):
        """``main()``: the worker's server engine; ``frozen_draft``: the draft before RL."""
        super().__init__(interval)
        self._main = main
        self.frozen_draft = {k: v.detach().to("cpu", copy=True) for k, v in frozen_draft.items()}
        self._pushed: tuple[dict[str, torch.Tensor], int] | None = None
        """This step's draft push (state, version), pushed back after the frozen call."""

    def pushed(self, draft_state, version):
        self._pushed = (draft_state, version)

    def measure(self, prompts, sampling, reverse=False):
        if self._pushed is None:  # no push yet: the server serves the frozen draft
            return {}
        engine, (state, version) = self._main(), self._pushed
        out = {}
        for name, push in (("fixed", None), ("frozen", self.frozen_draft)):
            if push is not None:
                engine.update_draft_weights(push, version)
            try:
                t0 = time.perf_counter()
                rollouts = engine.generate(prompts, sampling)
                out[name] = RolloutStats.of(rollouts, time.perf_counter() - t0)
            finally:
                if push is not None:
                    engine.update_draft_weights(state, version)
        out["frozen_fixed"] = out["frozen"]
        return out


def build_baselines(cfg, worker, draft: torch.nn.Module | None) -> Baselines:
    """The baselines of ``worker`` (rl/worker.py, after its main engine is built) for the
    run's config ``cfg``; ``draft``: the draft before RL (None without speculation)."""
    interval = cfg.rl.baseline_interval
    measures = cfg.mode.speculates and interval > 0
    if not measures:
        return Baselines(interval)
    if cfg.rollout.engine in ("vllm", "sglang"):
        if not cfg.mode.trains_draft:
            return Baselines(interval)
        return ServerBaselines(interval, lambda: worker.main, draft.state_dict())
    quiet = dataclasses.replace(worker.engine_config, progress=False)
    target, costs = worker.target, worker.costs
    engines: dict[str, BuiltinRolloutEngine] = {}
    # The frozen-draft engine shares the cost table: it makes the main engine's depth choices
    # from the same acceptance.
    if cfg.mode.trains_draft:
        engines["frozen"] = BuiltinRolloutEngine(target, copy.deepcopy(draft).to(worker.device), quiet, costs=costs)
    engines["nospec"] = BuiltinRolloutEngine(target, None, dataclasses.replace(quiet, num_draft_tokens=0))
    # At fixed depth the acceptance measures the drafts; under adaptive depth the main and
    # frozen engines' is the depth policy's result (a draft kept at K = 0 "accepts" 1.00).
    # The fused decode weights follow the shared modules' version counters (models/fused.py).
    fixed = dataclasses.replace(quiet, depth="fixed")
    engines["fixed"] = BuiltinRolloutEngine(target, worker.draft, fixed)
    if "frozen" in engines:
        engines["frozen_fixed"] = BuiltinRolloutEngine(target, engines["frozen"].draft, fixed)
    if cfg.speculative.depth == "adaptive":  # K = 0 is no-spec, K = K_max "fixed"
        for k in range(1, fixed.num_draft_tokens):
            engines[f"fixed_k{k}"] = BuiltinRolloutEngine(
                target, worker.draft, dataclasses.replace(fixed, num_draft_tokens=k)
            )
    return EngineBaselines(
        interval, engines, costs, worker.engine_config.num_draft_tokens, lambda: worker.main, worker.save_costs
    )


# --- metrics -------------------------------------------------------------------------------


def baseline_names(K: int) -> tuple[str, ...]:
    """Every baseline a run of K draft tokens may log, in the metrics' order."""
    return ("frozen", "nospec", "fixed", "frozen_fixed", *(f"fixed_k{k}" for k in range(1, K)))


def baseline_sums(baselines: dict[str, RolloutStats], K: int) -> dict[str, float]:
    """The baselines' counts, summed over the data-parallel ranks with the step's (0 where
    absent)."""
    out = {}
    for n in baseline_names(K):
        base = baselines.get(n)
        out[f"{n}_tokens"], out[f"{n}_verify"] = (base.tokens, base.verify_steps) if base is not None else (0, 0)
        out[f"{n}_drafted"], out[f"{n}_rounds"] = (base.drafted_tokens, base.rounds) if base is not None else (0, 0)
    return out


def baseline_maxes(baselines: dict[str, RolloutStats], K: int) -> dict[str, float]:
    """The baselines' wall and priced seconds, the slowest rank's with the step's."""
    names = baseline_names(K)
    return {
        **{n: baselines[n].seconds if n in baselines else 0.0 for n in names},
        **{f"{n}_priced": baselines[n].priced_s if n in baselines else 0.0 for n in names},
    }


def baseline_metrics(
    present,
    sums: dict[str, float],
    maxes: dict[str, float],
    K: int,
    tokens: float,
    tokens_per_s: float,
    priced_s: float,
) -> dict[str, float]:
    """The baseline metrics from the reduced ``sums`` and ``maxes`` (``baseline_sums`` /
    ``baseline_maxes`` keys); ``present``: the names measured; ``tokens``, ``tokens_per_s``,
    ``priced_s``: the step's call's (reduced)."""
    out = {}
    if "frozen" in present:
        out["rollout/accept_len_frozen"] = sums["frozen_tokens"] / max(sums["frozen_verify"], 1)
        out["rollout/tokens_per_s_frozen"] = sums["frozen_tokens"] / max(maxes["frozen"], 1e-9)
        out["rollout/draft_k_frozen"] = sums["frozen_drafted"] / max(sums["frozen_rounds"], 1)
        out["time/rollout_s_frozen"] = maxes["frozen"]
    if "nospec" in present:
        out["rollout/tokens_per_s_nospec"] = sums["nospec_tokens"] / max(maxes["nospec"], 1e-9)
        out["time/rollout_s_nospec"] = maxes["nospec"]
    # The drafts at equal depth: tokens per verify at fixed K, the drafts' quality.
    for n, key in (("fixed", "rollout/accept_len_fixed"), ("frozen_fixed", "rollout/accept_len_frozen_fixed")):
        if n in present:
            out[key] = sums[f"{n}_tokens"] / max(sums[f"{n}_verify"], 1)
    if "fixed" in present:
        out["rollout/fixed_k"] = K
    # Adaptive depth's regret on this call: its tokens per second against the best fixed
    # K in 0..K_max on the same prompts and seed (K = 0 is no-spec). Positive: the best
    # single depth would have been that much faster; negative: choosing per round beat
    # every single depth. Two clocks: the rounds priced by the engine's own round-cost
    # table (one clock for all, free of load; the headline) and wall seconds (what the
    # machine did; back-to-back calls on a shared CPU differ, so the best of K_max + 1
    # noisy calls is biased upward).
    sweep = {0: "nospec", **{k: f"fixed_k{k}" for k in range(1, K)}, K: "fixed"}
    if K >= 1 and all(n in present for n in sweep.values()):
        tps = {k: sums[f"{n}_tokens"] / max(maxes[n], 1e-9) for k, n in sweep.items()}
        out.update({f"rollout/tokens_per_s_fixed_k{k}": tps[k] for k in range(1, K + 1)})
        out["rollout/depth_regret_wall"] = 1.0 - tokens_per_s / max(tps.values())
        if priced_s > 0 and all(maxes[f"{n}_priced"] > 0 for n in sweep.values()):
            priced = {k: sums[f"{n}_tokens"] / maxes[f"{n}_priced"] for k, n in sweep.items()}
            best = max(priced, key=priced.get)
            out["rollout/best_fixed_k"] = best
            out["rollout/depth_regret"] = 1.0 - (tokens / priced_s) / priced[best]
    return out
