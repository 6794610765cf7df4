# Benchmark: the cost of one round of the built-in rollout engine, split by phase.
#
# A round = draft extend + K-1 draft steps + one target verify forward + accept + behaviour
# log-probs + emit (the one host transfer). Models are random (tiny Qwen3 flavor by default,
# EAGLE-3 draft with a 32-token draft vocab), so only cost is measured, not acceptance:
# every generate runs --max-new-tokens rounds-worth of tokens with no stop token.
# Reported per engine (K = 0 plain decoding, K = --num-draft-tokens speculative):
# ms per round, min and median over --repeats generate calls (the min is the least
# disturbed by other load on a shared machine), and the per-phase split of the best call;
# the engines are called in turn, and the ratio K round / plain round is the median over
# those back-to-back pairs (the number to compare between checkouts: load cancels in it).
#
# Usage: PYTHONPATH=. python bench/rollout_round.py [--batch 1] [--temperature 0] [--flavor tiny]
# The phases are timed by wrapping the engine's methods and engine.py's ``accept`` by name,
# so the same script measures an older checkout that has those names:
# PYTHONPATH=/path/to/old/checkout python bench/rollout_round.py

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

# Appended, not prepended: a PYTHONPATH checkout (an older one, for before/after) wins.
sys.path.append(str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import titan_spec.rollout.builtin.engine as torch_engine  # noqa: E402
from titan_spec.models.draft.eagle3.model import DraftArch, Eagle3Draft  # noqa: E402
from titan_spec.models.draft.vocab import build_vocab_mapping  # noqa: E402
from titan_spec.models.registry import build_target_config, flavor_arch  # noqa: E402
from titan_spec.rollout import SamplingParams, BuiltinEngineConfig, BuiltinRolloutEngine  # noqa: E402


def _parse_args(argv=None):
    p = argparse.ArgumentParser(description="rollout engine: ms per round, by phase")
    p.add_argument("--family", default="qwen3")
    p.add_argument("--flavor", default="tiny")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--compile", action="store_true", help="BuiltinEngineConfig(compile=True) (minutes of compile on CPU)"
    )
    return p.parse_args(argv)


def build(args):
    torch.manual_seed(0)
    arch = flavor_arch(args.family, args.flavor)
    L = arch.n_layers
    taps = (1, L // 2 - 1, L - 4)
    target = build_target_config(arch, tap_layer_ids=taps, max_seq_len=1024).build()
    target.init_weights(buffer_device=None)
    draft = Eagle3Draft(DraftArch.from_target(arch, taps, 32))
    draft.reset_parameters()
    counts = torch.zeros(arch.vocab_size)
    counts[:64] = torch.arange(64, 0, -1).float()
    draft.set_vocab_mapping(*build_vocab_mapping(counts, 32))
    return target.eval(), draft.eval()


class Timers:
    """Wall time per wrapped method, accumulated until reset."""

    active: "Timers | None" = None
    """The timers of the engine being called, for the functions every engine shares."""

    def __init__(self):
        self.s = collections.defaultdict(float)

    def wrap(self, obj, name: str, label: str) -> None:
        f = getattr(obj, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            out = f(*a, **k)
            self.s[label] += time.perf_counter() - t0
            return out

        setattr(obj, name, timed)

    @staticmethod
    def wrap_shared(module, name: str, label: str) -> None:
        """A module function the engines call (the accept step, rollout/builtin/sampling.py
        ``accept`` as engine.py names it), timed into the active engine's timers."""
        f = getattr(module, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            out = f(*a, **k)
            if Timers.active is not None:
                Timers.active.s[label] += time.perf_counter() - t0
            return out

        setattr(module, name, timed)


def measure(engines: dict, timers: dict, prompts, sp, repeats: int) -> dict:
    """Per engine: [(ms per round, {phase: ms per round})] over ``repeats`` generate calls,
    the engines called in turn (call i of every engine back to back), so that load which
    comes and goes hits them alike and the per-call ratios cancel it."""
    for e in engines.values():
        e.generate(prompts, sp)  # warm-up
    runs = {k: [] for k in engines}
    for _ in range(repeats):
        for k, engine in engines.items():
            t = Timers.active = timers[k]
            t.s.clear()
            t0 = time.perf_counter()
            out = engine.generate(prompts, sp)
            dt = time.perf_counter() - t0
            rounds = max(r.verify_steps for r in out)
            runs[k].append((dt / rounds * 1e3, {n: v / rounds * 1e3 for n, v in t.s.items()}))
    return runs


def main(argv=None) -> int:
    args = _parse_args(argv)
    torch.set_num_threads(args.threads)
    target, draft = build(args)
    K = args.num_draft_tokens
    prompts = [[1 + (7 * i + b) % 60 for i in range(args.prompt_len)] for b in range(args.batch)]
    sp = SamplingParams(args.temperature, max_new_tokens=args.max_new_tokens, seed=0)
    engines, timers = {}, {}
    for k in (0, K):
        t = timers[k] = Timers()
        e = engines[k] = BuiltinRolloutEngine(
            target, draft if k else None, BuiltinEngineConfig(num_draft_tokens=k, compile=args.compile)
        )
        t.wrap(e._target, "forward", "target forward")
        if k:
            t.wrap(e._draft, "extend", "draft extend")
            t.wrap(e._draft, "step", "draft steps")
        t.wrap(e, "_emit", "emit")
    Timers.wrap_shared(torch_engine, "accept", "accept")
    with torch.inference_mode():
        results = measure(engines, timers, prompts, sp, args.repeats)
    print(
        f"{args.family}/{args.flavor}, batch {args.batch}, T = {args.temperature:g}, "
        f"{args.max_new_tokens} new tokens, {args.repeats} repeats, {torch.get_num_threads()} thread(s), "
        f"{'compiled' if args.compile else 'eager'}, "
        f"engine from {Path(torch_engine.__file__).parents[3]}"
    )
    for k, runs in results.items():
        ms = [r[0] for r in runs]
        best = min(runs, key=lambda r: r[0])
        split = ", ".join(f"{name} {v:.2f}" for name, v in best[1].items())
        print(f"K = {k}: ms/round min {min(ms):.2f} median {statistics.median(ms):.2f} | best call: {split}")
    ratios = [a[0] / b[0] for a, b in zip(results[K], results[0])]
    print(
        f"K = {K} round / K = 0 round, per pair of back-to-back calls: median {statistics.median(ratios):.3f} "
        f"(min {min(ratios):.3f}, max {max(ratios):.3f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
