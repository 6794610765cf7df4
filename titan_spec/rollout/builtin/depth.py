"""Adaptive speculation depth for the built-in engine: how many draft tokens (K in 0..K_max)
the next round proposes.

Before every round the engine picks the K that maximises expected tokens per second,

    K* = argmax_K  sum_b E_b[tokens | K] / cost(K, B)

with E_b from ``AcceptanceEstimate`` (decayed acceptance counts of past rounds over a Beta
prior, carried from call to call in ``AcceptanceState``) and cost from ``RoundCosts`` (the
engine's own round costs, measured once per sampling mode and batch bucket by calibrate.py,
then frozen). Invariant: the choice is a deterministic function of the frozen cost table,
the acceptance state the call starts from, the call's own outcomes and the budgets, and K is
fixed from the past only, so speculative sampling stays lossless for any choice. The
reference (probes, the table, what is reproducible): docs/rollout_engine.md, "Adaptive depth".
"""

from __future__ import annotations

import bisect
import copy

__all__ = [
    "AcceptanceEstimate",
    "AcceptanceState",
    "PROBE_DEPTH",
    "PROBE_EVERY",
    "RoundCosts",
    "batch_buckets",
    "choose_depth",
    "confidence_depth",
    "sampling_mode",
]

PROBE_EVERY = 64
"""While the choice is K = 0, one round in this many drafts PROBE_DEPTH tokens instead (a
probe, counted across calls; ``AcceptanceEstimate.depth``). A K = 0 round observes nothing,
so without probes an estimate that a bad draft drove to K = 0 would not see a better draft
or policy pushed later; half of the default run's 128-token call, so a draft pushed before
a call is tried within it (docs/rollout_engine.md, "Adaptive depth", says what probes cost)."""
PROBE_DEPTH = 1
"""K of a probe. Depth 1 is the estimate that puts a round at K = 0 (a bad draft's rows
are rejected at depth 1, so its deeper counts stay near the prior and return to it within a
few drafting rounds at their decay), and it is the cheapest probe round."""


def sampling_mode(greedy: bool, top_k: int, top_p: float) -> str:
    """The cost table's key for a sampling setting: the accept step's cost depends on it
    (greedy: argmax only; sampled: softmax, plus a top-k and a top-p sort when set)."""
    if greedy:
        return "greedy"
    return "sample" + ("_topk" if top_k > 0 else "") + ("_topp" if top_p < 1.0 else "")


def batch_buckets(batch: int) -> list[int]:
    """Batch sizes whose cost is measured for a batch of ``batch`` rows (the batch only
    shrinks while it decodes): the powers of two up to the first one >= batch."""
    out, b = [1], 1
    while b < batch:
        b *= 2
        out.append(b)
    return out


class RoundCosts:
    """Seconds of one round at K = 0..K_max, per sampling mode and batch bucket (on CPU the
    CPU seconds of the engine's thread: calibrate.py ``round_clock``).

    Measured once per entry by the engine (calibrate.py ``calibrate``), then never
    changed: ``cost`` reads it, interpolating linearly between buckets. Share one object
    between engines over the same models (the RL worker's main and frozen-draft engines and
    their rebuilds); ``state_dict`` / ``load_state_dict`` carry it to a resumed run.
    """

    def __init__(self, table: dict | None = None, pinned: bool = False):
        """table: a ``state_dict()``; pinned: never measure into this table (a batch size
        between or beyond its buckets reads the interpolation or the nearest bucket), e.g.
        a table carried from another run so that a fresh run makes that run's choices."""
        self.table: dict[str, dict[int, list[float]]] = {}
        self.pinned = pinned
        if table:
            self.load_state_dict(table)

    def missing(self, mode: str, buckets: list[int], k_max: int) -> list[int]:
        """The buckets to measure for ``mode`` (none when pinned and the mode is known)."""
        if self.pinned:
            if not any(self.has(mode, b, k_max) for b in self.table.get(mode, {})):
                raise ValueError(f"the pinned round-cost table has no {mode!r} entry for K up to {k_max}")
            return []
        return [b for b in buckets if not self.has(mode, b, k_max)]

    def has(self, mode: str, bucket: int, k_max: int) -> bool:
        row = self.table.get(mode, {}).get(bucket)
        return row is not None and len(row) >= k_max + 1

    def set(self, mode: str, bucket: int, seconds: list[float]) -> None:
        if self.has(mode, bucket, len(seconds) - 1):
            raise ValueError(f"round costs of {mode} at batch {bucket} are already measured (they are frozen)")
        if not seconds or min(seconds) <= 0:
            raise ValueError(f"round costs must be positive seconds, got {seconds}")
        self.table.setdefault(mode, {})[int(bucket)] = [float(s) for s in seconds]

    def costs(self, mode: str, batch: int, k_max: int) -> list[float]:
        """cost(K) for K = 0..k_max at ``batch`` rows: linear between the measured buckets
        around it (the nearest one outside them)."""
        rows = self.table[mode]
        sizes = sorted(b for b, r in rows.items() if len(r) >= k_max + 1)
        i = bisect.bisect_left(sizes, batch)
        if i < len(sizes) and sizes[i] == batch:
            return rows[batch][: k_max + 1]
        if i == 0 or i == len(sizes):
            return rows[sizes[min(i, len(sizes) - 1)]][: k_max + 1]
        lo, hi = sizes[i - 1], sizes[i]
        w = (batch - lo) / (hi - lo)
        return [(1 - w) * a + w * b for a, b in zip(rows[lo][: k_max + 1], rows[hi][: k_max + 1])]

    def price(self, mode: str, rounds: list[tuple[int, int]], k_max: int) -> float:
        """Seconds the table gives a call's decode ``rounds`` ((K, rows) each, an engine's
        ``last_rounds``): what the call would cost by this table, free of the machine's noise
        (the RL worker's ``RolloutStats.priced_s``); 0.0 without an entry for ``mode``."""
        if mode not in self.table:
            return 0.0
        return sum((self.costs(mode, rows, k_max)[k] for k, rows in rounds), 0.0)

    def state_dict(self) -> dict[str, dict[str, list[float]]]:
        """JSON-ready: {mode: {str(bucket): [seconds per K]}}."""
        return {m: {str(b): list(r) for b, r in rows.items()} for m, rows in self.table.items()}

    def load_state_dict(self, state: dict) -> None:
        self.table = {m: {int(b): [float(s) for s in r] for b, r in rows.items()} for m, rows in state.items()}

    def copy(self, pinned: bool | None = None) -> "RoundCosts":
        return RoundCosts(copy.deepcopy(self.state_dict()), self.pinned if pinned is None else pinned)

    def __len__(self) -> int:
        return sum(len(rows) for rows in self.table.values())


class AcceptanceEstimate:
    """Per-depth acceptance alpha_1..alpha_Kmax of the rounds seen so far (one sampling
    setting of one engine; ``AcceptanceState`` keeps them from call to call).

    Counts: reached_j (the fraction of a round's rows that drafted >= j tokens and accepted
    the first j-1) and accepted_j (those that also accepted draft j), decayed by ``decay``
    every round; alpha_j = (accepted_j + w m) / (reached_j + w), a Beta prior of mean
    ``prior`` and weight ``prior_weight`` (in rounds). The prior is optimistic (0.8), so an
    engine's first round speculates and outcomes decide the rest. A K = 0 round observes
    nothing and decays the counts by the slower ``idle_decay``, so the prior regains
    weight (at 0.98 a stale draft was re-probed by the prior in 2.3% of rounds, each a
    K = 3 round at 1.85 plain steps at batch 8 on CPU: ~2% of the call; at 0.995, 0.5% of
    rounds; simulated on the default RL run's table); ``idle`` counts those rounds, and
    ``depth`` turns the PROBE_EVERY-th of them into a probe.

    No reset on a weight push: the RL worker pushes the draft and policy before every call,
    changed a little, so a reset would throw away the carried estimate every call and bring
    back what ``AcceptanceState`` exists to avoid (a call deciding from its own first rounds,
    which kept K = 0 for whole calls at batch 64); a push cannot tell a small change from a
    large one, and the probes find either within PROBE_EVERY rounds. (A reset would also
    make a useless draft pay the prior's first rounds every call: K = 3, then K = 0, at the
    test pair's batch-8-like costs.)"""

    def __init__(
        self, k_max: int, prior: float = 0.8, prior_weight: float = 0.5, decay: float = 0.9, idle_decay: float = 0.995
    ):
        self.k_max, self.prior, self.w, self.decay, self.idle_decay = k_max, prior, prior_weight, decay, idle_decay
        self.reached = [0.0] * (k_max + 1)  # index j = 1..k_max (0 unused)
        self.accepted = [0.0] * (k_max + 1)
        self.idle = 0  # K = 0 rounds since the last drafting one (PROBE_EVERY)

    def depth(self, k: int) -> int:
        """The round's K given choose_depth's choice k: PROBE_DEPTH where k = 0 follows
        PROBE_EVERY - 1 K = 0 rounds in a row (a probe), else k. A function of the state
        only, so the choices stay reproducible (``idle`` is in ``state_dict``)."""
        return min(PROBE_DEPTH, self.k_max) if k == 0 and self.idle >= PROBE_EVERY - 1 else k

    def observe(self, k: int, accepted: list[int]) -> None:
        """One round at depth k, with each row's accepted draft count (before any stop or
        budget cut: what the draft achieved). Each of the round's rows counts 1 / (its rows),
        so every round weighs 1 whatever its batch size (the prior and the decays mean the
        same number of rounds at batch 1 and at batch 64), the last rounds of a batch, with
        few rows left, included: rows only leave a batch, so those rows are the ones the
        next rounds decode. (Weighing a row 1 / (the rows the batch started with), the
        decay scaled to match, speculates more in the next call, and loses where the
        longest rows of a batch are the ones the draft cannot predict, as at the default's
        start: docs/PERFORMANCE.md "Adaptive depth".)"""
        d = self.decay if k else self.idle_decay
        self.idle = 0 if k else self.idle + 1
        self.reached = [x * d for x in self.reached]
        self.accepted = [x * d for x in self.accepted]
        unit = 1.0 / max(len(accepted), 1)
        for a in accepted if k else ():
            for j in range(1, min(a + 1, k) + 1):  # reached depths 1..a+1 (<= k)
                self.reached[j] += unit
            for j in range(1, a + 1):
                self.accepted[j] += unit

    def alphas(self) -> list[float]:
        """[alpha_1, ..., alpha_Kmax]."""
        w, m = self.w, self.prior
        return [(self.accepted[j] + w * m) / (self.reached[j] + w) for j in range(1, self.k_max + 1)]

    def state_dict(self) -> dict:
        return {"reached": list(self.reached), "accepted": list(self.accepted), "idle": self.idle}

    def load_state_dict(self, state: dict) -> None:
        if len(state["reached"]) != self.k_max + 1 or len(state["accepted"]) != self.k_max + 1:
            raise ValueError(
                f"an acceptance estimate for K up to {len(state['reached']) - 1} cannot be loaded "
                f"into one for K up to {self.k_max}"
            )
        self.reached = [float(x) for x in state["reached"]]
        self.accepted = [float(x) for x in state["accepted"]]
        self.idle = int(state.get("idle", 0))  # absent in states saved before probes


class AcceptanceState:
    """An engine's acceptance estimates, one per sampling setting (greedy acceptance is not
    T = 1's), carried from generate call to generate call: RL calls the engine once per step
    with a draft that changes a little between them, so the last call's estimate is the
    best start for the next one; a call that had to learn it afresh would decide from its
    first round alone, which sees the completions' first tokens only (their acceptance is
    lower than the later rounds', enough to keep K = 0 for a whole call when a round is
    expensive).
    ``state_dict`` / ``load_state_dict``: JSON-ready, for a retried call and a resumed run."""

    def __init__(self, k_max: int):
        self.k_max = k_max
        self.estimates: dict[str, AcceptanceEstimate] = {}

    @staticmethod
    def key(sampling) -> str:
        mode = sampling_mode(sampling.greedy, sampling.top_k, sampling.top_p)
        return mode if sampling.greedy else f"{mode}@T={float(sampling.temperature):g}"

    def of(self, sampling) -> AcceptanceEstimate:
        """The estimate a call with these SamplingParams reads and updates."""
        return self.estimates.setdefault(self.key(sampling), AcceptanceEstimate(self.k_max))

    def state_dict(self) -> dict[str, dict]:
        return {k: e.state_dict() for k, e in self.estimates.items()}

    def load_state_dict(self, state: dict) -> None:
        self.estimates = {}
        for k, s in state.items():
            self.estimates[k] = AcceptanceEstimate(self.k_max)
            self.estimates[k].load_state_dict(s)


def choose_depth(alphas: list[float], remaining: list[int], costs: list[float]) -> int:
    """argmax_K sum_b E_b[tokens | K] / costs[K] over K = 0..len(costs)-1; ties go to the
    smaller K. remaining: each running request's token budget left (>= 1)."""
    k_max = len(costs) - 1
    # n_i = rows that can still use an i-th extra token (budget > i); P_i = alpha_1..alpha_i.
    n = [0] * (k_max + 1)
    for r in remaining:
        n[min(r, k_max + 1) - 1] += 1
    for i in range(k_max - 1, -1, -1):
        n[i] += n[i + 1]
    best_k, best, tokens, p = 0, n[0] / costs[0], float(n[0]), 1.0
    for k in range(1, k_max + 1):
        p *= alphas[k - 1]
        tokens += p * n[k]
        rate = tokens / costs[k]
        if rate > best:
            best_k, best = k, rate
    return best_k


def confidence_depth(conf_BK, threshold: float) -> int:
    """The round's K from a draft's confidence head (depth = "confidence"): conf_BK is each
    row's estimate that proposal j is accepted given the ones before it, so its running
    product s_Bj estimates that row reaching and accepting j. The round verifies j = 1 always
    (the block was paid for) and j > 1 while some row has s_Bj >= threshold.

    Each row's own depth is its count of s_Bj >= threshold; the batch verifies the deepest,
    since its rows share one verify forward (engine.py) and a shorter window would only lose
    tokens. Lossless: whether j is verified depends on the row's proposals before j (s_Bj
    reads d_1..d_{j-1}) and on other rows, never on d_j itself."""
    survive_K = conf_BK.float().cumprod(1).amax(0)
    return 1 + int((survive_K[1:] >= threshold).sum())
