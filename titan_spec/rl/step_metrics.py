"""The RL step's metrics (phase 8 of rl/step.py): what ``RLTrainer.step_metrics`` adds to
torchtitan's and the draft's for the step just trained, from its ``StepRecord``.

Rollout counts are the same on every rank of a data-parallel rank (its CP ranks hold the
group's exchanged rollouts), so they are summed over the batch mesh; the PPO statistics are
per token of a rank's shard, summed over every rank that trains on data (the loss mesh); the
seconds are the slowest rank's. Every reduction is one float64 collective (``_reduce``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from titan_spec.rl.baselines import baseline_maxes, baseline_metrics, baseline_sums
from titan_spec.rl.drift import percentile_from_counts
from titan_spec.rl.mismatch import MismatchSums
from titan_spec.rl.step_records import StepRecord

__all__ = ["rl_step_metrics"]


def _length_counts(rollouts, max_new_tokens: int) -> dict[str, float]:
    """len_<n>: completions of n tokens (a histogram summed over ranks: the p90 length)."""
    counts = {f"len_{n}": 0.0 for n in range(max_new_tokens + 1)}
    for r in rollouts:
        counts[f"len_{min(len(r.output_ids), max_new_tokens)}"] += 1.0
    return counts


def rl_step_metrics(record: StepRecord, cfg, mode, pd) -> dict[str, float]:
    """The metrics of the RL step ``record`` (collective over ``pd``'s batch and loss meshes:
    every rank calls it). ``cfg``: the trainer's config (its rl, speculative and rollout
    sections); ``mode``: its RunMode (the
    trainer's, read once); ``pd``: torchtitan's ParallelDims."""
    rl = cfg.rl
    out: dict[str, float] = {}
    K = cfg.speculative.num_draft_tokens
    b = record.batch
    stats = b.stats
    # The rollouts are the same on every rank of a data-parallel rank (its CP ranks hold
    # the group's exchanged rollouts): counted once, summed over the data-parallel ranks ...
    rollout_sums = {
        "reward": float(record.rewards_PG.sum()),
        "completions": len(b.rollouts),
        "stopped": sum(r.finish_reason == "stop" for r in b.rollouts),
        "tokens": stats.tokens,
        "verify": stats.verify_steps,
        "drafted": stats.drafted_tokens,
        "rounds": stats.rounds,
        **_length_counts(b.rollouts, rl.max_new_tokens),
    }
    if record.shaping_PG is not None:  # DAPO's soft overlong punishment (rl/dapo.py)
        rollout_sums["shaping"] = float(record.shaping_PG.sum())
        rollout_sums["shaped"] = float((record.shaping_PG < 0).sum())
    rollout_sums.update(baseline_sums(b.baselines, K))  # rl/baselines.py
    # ... the PPO stats are per token of this rank's shard: token-weighted, summed over
    # every rank that trains on data (dp x cp), means over all completion tokens ...
    # The engine/trainer mismatch at the step's starting weights (rl/mismatch.py): from the
    # recompute forward, or the first update's (it runs at those weights).
    mismatch = (
        MismatchSums(**record.mismatch) if record.mismatch is not None else MismatchSums.from_update(record.updates[0])
    )
    token_sums = {
        "policy_tokens": sum(u.policy_tokens for u in record.updates),
        "clip": sum(u.policy_tokens * u.clip_fraction for u in record.updates),
        "dual_clip": sum(u.policy_tokens * u.dual_clip_fraction for u in record.updates),
        "kl": sum(u.policy_tokens * u.kl for u in record.updates),
        "mismatch_tokens": mismatch.tokens,
        "mismatch_diff": mismatch.diff_sum,
        "mismatch_out": mismatch.out_of_band,
        **record.drift,  # per token of this rank's shard, like the PPO stats
    }
    # ... and the slowest rank's seconds.
    maxes = {
        "rollout": stats.seconds,
        "push": b.push_s,
        "train": record.train_s,
        "mismatch_max": mismatch.diff_max,
        "len_max": max((len(r.output_ids) for r in b.rollouts), default=0),
        "rollout_priced": stats.priced_s,
        **baseline_maxes(b.baselines, K),
    }
    sums = {
        **_reduce(rollout_sums, dist.ReduceOp.SUM, pd.get_optional_mesh("batch")),
        **_reduce(token_sums, dist.ReduceOp.SUM, pd.get_optional_mesh("loss")),
    }
    if record.wait_s is not None:  # rl.async_steps: push and rollouts overlapped earlier steps
        maxes["wait"] = record.wait_s
    maxes = _reduce(maxes, dist.ReduceOp.MAX, pd.get_optional_mesh("loss"))
    tokens, ppo_tokens = sums["tokens"], max(sums["policy_tokens"], 1.0)
    updates_per_step = rl.ppo_epochs * rl.minibatches  # versions count optimizer steps
    out.update(
        {
            "rl/reward": sums["reward"] / sums["completions"],
            "rl/stop_fraction": sums["stopped"] / sums["completions"],
            "rl/clip_fraction": sums["clip"] / ppo_tokens,
            "rl/logp_mismatch_mean": sums["mismatch_diff"] / max(sums["mismatch_tokens"], 1.0),
            "rl/logp_mismatch_max": maxes["mismatch_max"],
            "rl/logp_mismatch_out_of_band": sums["mismatch_out"] / max(sums["mismatch_tokens"], 1.0),
            "rl/kl": sums["kl"] / ppo_tokens,
            "rl/policy_version": b.policy_version,
            # Staleness in RL steps: 0 synchronous, rl.async_steps once the queue is full.
            "rl/policy_lag": (record.policy_version - b.policy_version) / updates_per_step,
            "rollout/tokens": tokens,
            "rollout/accept_len": tokens / max(sums["verify"], 1),
            "rollout/tokens_per_s": tokens / max(maxes["rollout"], 1e-9),
            "time/push_s": maxes["push"],
            "time/rollout_s": maxes["rollout"],
            "time/train_s": maxes["train"],
            "time/step_s": maxes["push"] + maxes["rollout"] + maxes["train"],
        }
    )
    if "wait" in maxes:
        out["time/rollout_wait_s"] = maxes["wait"]
        out["time/step_s"] = maxes["wait"] + maxes["train"]
    if mode.trains_draft:
        drafted_by = min((r.draft_version for r in b.rollouts), default=record.policy_version)
        out["rl/draft_lag"] = (record.policy_version - drafted_by) / updates_per_step
    if cfg.rollout.engine != "sglang":  # SGLang does not report its rounds' depths
        # Mean draft tokens proposed per verify round (speculative.depth = "adaptive" varies it).
        out["rollout/draft_k"] = sums["drafted"] / max(sums["rounds"], 1)
    if len(record.updates) > 1:
        out["rl/updates"] = len(record.updates)
    if "shaping" in sums:  # per completion; rl/reward stays the task's reward
        out["rl/overlong_penalty"] = sums["shaping"] / sums["completions"]
        out["rl/overlong_fraction"] = sums["shaped"] / sums["completions"]
    if rl.dual_clip:
        out["rl/dual_clip_fraction"] = sums["dual_clip"] / ppo_tokens
    counts = [sums[f"len_{n}"] for n in range(rl.max_new_tokens + 1)]
    out.update(
        {
            "rollout/completion_len": tokens / sums["completions"],
            "rollout/completion_len_p90": percentile_from_counts(counts, 0.9),
            "rollout/completion_len_max": maxes["len_max"],
        }
    )
    if sums.get("drift_tokens"):
        out["drift/kl"] = sums["drift_k1"] / sums["drift_tokens"]
        out["drift/kl_k3"] = sums["drift_k3"] / sums["drift_tokens"]
    # The baselines (rl/baselines.py): the frozen draft's, no-spec's and fixed K's speed and
    # acceptance, adaptive depth's regret.
    out.update(
        baseline_metrics(b.baselines, sums, maxes, K, tokens, out["rollout/tokens_per_s"], maxes["rollout_priced"])
    )
    # --- rl.dynamic_sampling (rl/dynamic_sampling.py) ------------------------------------
    # rl/reward above is the kept batch's (the groups trained on); the rollout/ speed and
    # token metrics count every round's generation (its real cost), so the mean completion
    # length is retaken on the kept completions. Counted once per data-parallel rank (its CP
    # ranks hold the same batch): groups summed over the batch mesh, rounds the most any
    # data-parallel rank used (the step waited for it).
    if b.dynamic is not None:
        d, batch_mesh = b.dynamic, pd.get_optional_mesh("batch")
        ds = _reduce(
            {
                "dropped": d.dropped,
                "topped_up": d.topped_up,
                "generated": d.generated,
                "kept_tokens": sum(len(r.output_ids) for r in b.rollouts),
            },
            dist.ReduceOp.SUM,
            batch_mesh,
        )
        out.update(
            {
                "rl/dynamic_groups_dropped": ds["dropped"],
                "rl/dynamic_topped_up": ds["topped_up"],
                "rl/dynamic_groups_generated": ds["generated"],
                "rl/dynamic_rounds": _reduce({"rounds": d.rounds}, dist.ReduceOp.MAX, batch_mesh)["rounds"],
                "rollout/completion_len": ds["kept_tokens"] / sums["completions"],
            }
        )
    return out


def _reduce(values: dict[str, float], op, mesh) -> dict[str, float]:
    """``values`` reduced over ``mesh`` (float64, one collective; None: this rank alone)."""
    t = torch.tensor(list(values.values()), dtype=torch.float64)
    if mesh is not None:
        dist.all_reduce(t, op=op, group=mesh.get_group())
    return dict(zip(values, t.tolist()))
