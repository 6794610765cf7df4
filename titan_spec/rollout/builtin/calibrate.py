"""The measurement of adaptive depth's round-cost table (depth.py ``RoundCosts``): synthetic
rounds of the engine at each fixed K, per sampling mode and batch bucket, read on
``round_clock``; measured once per entry, on first use, then frozen.

The rounds are the engine's own (``BuiltinRolloutEngine._timed_rounds``: the decode loop's
prefill and rounds, at a fixed K, on scratch caches with a private RNG), so a call that
calibrates samples what the same call samples later with the table in place.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from titan_spec.rollout.base import SamplingParams
from titan_spec.rollout.builtin.depth import RoundCosts, batch_buckets, sampling_mode

__all__ = ["CALIBRATION_PASSES", "CALIBRATION_ROUNDS", "RunRounds", "calibrate", "round_clock"]

CALIBRATION_ROUNDS = 3
"""Rounds per (bucket, K) and pass when measuring costs (the first, which also extends
the draft over the prompt, is not timed; a pass keeps the fastest of the others)."""
CALIBRATION_PASSES = 9
"""Passes over every (bucket, K), interleaved: each pass times every K of a bucket back
to back, and the table keeps the median over passes of each K's ratio to K = 0, so a
burst of other load that hits some passes does not move a choice. (5 passes of one
timed round left ties and inversions between depths on this shared 2-core machine,
e.g. K = 1..3 all at one cost, which sends every round to K = 3.)"""

RunRounds = Callable[[list[list[int]], SamplingParams, torch.Generator, int, int, list[float]], object]
"""run(prompts, sampling, gen, k, rounds, round_s): ``rounds`` rounds of a fresh batch at
K = k on the engine's scratch caches, each round's seconds (``round_clock``) appended to
round_s; unfinished requests are dropped."""


def round_clock(device: torch.device) -> float:
    """The clock a round's cost is read on. CPU: the CPU time of the thread that runs
    the round, which other processes' load on a shared machine does not inflate (their
    wall time is what it is, but the ratio between two depths is what the choice
    needs); this thread takes part in every parallel region and waits for the others,
    so its CPU time follows the round's wall time. Not the process's CPU time: OpenMP's
    other threads spin through the small ops of a round and bill it for time nobody
    waits for, more for a plain step than for a deeper round, so deeper rounds would look
    cheaper relative to it than they are. The
    round ends with a host transfer, so all its work is done when the clock is read.
    GPU: wall time (the same transfer synchronizes the stream)."""
    return time.thread_time() if device.type == "cpu" else time.perf_counter()


def calibrate(
    costs: RoundCosts,
    run: RunRounds,
    batch: int,
    sp: SamplingParams,
    k_max: int,
    max_seq_len: int,
    vocab_size: int,
    device: torch.device,
) -> None:
    """Measures ``costs``' missing entries for ``sp``'s sampling mode and every batch bucket
    up to ``batch`` (batch_buckets): synthetic rounds at each fixed K through ``run``, with
    a private RNG. Touches nothing a generate call reads (the caches are rebuilt per
    batch), so whether a call calibrates does not change its rollouts. Cost:
    CALIBRATION_PASSES x CALIBRATION_ROUNDS x (k_max + 1) rounds per bucket. Entry
    (bucket, K) = median over passes of the K = 0 round, times the median over passes of
    K's ratio to K = 0 in the same pass; made non-decreasing in K by pooling adjacent
    inversions (a deeper round cannot really cost less: the least-squares monotone fit,
    which neither trusts the lower nor the higher of two inverted measurements), lowered
    where a larger batch measured cheaper, and frozen into ``costs``."""
    mode = sampling_mode(sp.greedy, sp.top_k, sp.top_p)
    todo = costs.missing(mode, batch_buckets(batch), k_max)
    if not todo:
        return
    R = CALIBRATION_ROUNDS
    new = max(2, R * (k_max + 1) + 1)  # enough budget for R rounds even if all drafts pass
    plen = max(1, min(16, max_seq_len - new - k_max - 1))
    cal_sp = SamplingParams(sp.temperature, top_p=sp.top_p, top_k=sp.top_k, max_new_tokens=new)
    gen = torch.Generator(device=device)
    gen.manual_seed(0)
    per_pass = {b: [] for b in todo}  # bucket -> per pass: fastest timed round of each K
    for _ in range(CALIBRATION_PASSES):
        for bucket in todo:
            prompts = [[(7 * i + 3 * b + 1) % vocab_size for i in range(plen)] for b in range(bucket)]
            row = []
            for k in range(k_max + 1):
                s: list[float] = []
                run(prompts, cal_sp, gen, k, R, s)
                row.append(max(min(s[1:]), 1e-7))
            per_pass[bucket].append(row)
    best = {}
    for bucket, rows in per_pass.items():
        base = _median([r[0] for r in rows])
        best[bucket] = [base * _median([r[k] / r[0] for r in rows]) for k in range(k_max + 1)]
    best = {bucket: _non_decreasing(row) for bucket, row in best.items()}
    for i in range(len(todo) - 2, -1, -1):  # a smaller batch costs at most a larger one
        best[todo[i]] = [min(a, b) for a, b in zip(best[todo[i]], best[todo[i + 1]])]
    for bucket in todo:
        costs.set(mode, bucket, best[bucket])


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
