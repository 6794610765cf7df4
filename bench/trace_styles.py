# Benchmark: how well each draft predicts each answer style of the default's trace task.
#
# The embedded default's claim rests on this: the offline draft predicts the warm start's
# guess style and not the step-by-step trace that RL moves the policy to, and co-training
# teaches it the trace. For a policy and some drafts, one generate call of --prompts task
# prompts (train_configs/debug_cpu_sft.toml's [task]) per draft and temperature, at FIXED
# depth K = --num-draft-tokens (so acceptance measures the draft, not a depth choice), split
# by the style of each completion (a trace has '/'): completions, mean tokens, acceptance
# length (completion tokens / target forwards, prefill included) and how many are right.
# The same prompts and seed for every draft; greedy completions are the policy's own whatever
# the draft (lossless and token-identical), sampled ones follow the policy's distribution
# whatever the draft but differ token by token, so the style counts at T = 1 vary a little.
# Default drafts: the embedded default's offline draft and its co-trained one (after
# ./run_train.sh).
#
# Usage: PYTHONPATH=. python bench/trace_styles.py --policy outputs/debug_cpu/sft/hf \
#            --draft offline=outputs/debug_cpu/draft/draft --draft cotrained=outputs/debug_cpu/rl/draft

import argparse
import json
import os
import random
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO_ROOT))

import torch  # noqa: E402

from bench.rollout import task_of, tokenizer_for  # noqa: E402
from titan_spec.data.rewards import exact_match  # noqa: E402
from titan_spec.rollout import SamplingParams, BuiltinEngineConfig, BuiltinRolloutEngine  # noqa: E402


def _parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--policy", default=str(REPO_ROOT / "outputs/debug_cpu/sft/hf"))
    p.add_argument(
        "--draft",
        action="append",
        default=[],
        help="NAME=DIR (repeatable; default: the default run's offline and co-trained drafts)",
    )
    p.add_argument("--task-config", default=str(REPO_ROOT / "train_configs/debug_cpu_sft.toml"))
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=123)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(REPO_ROOT / "bench/results/trace_styles.json"))
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse_args(argv)
    torch.set_num_threads(args.threads)
    tok, task = tokenizer_for(args.policy), task_of(args.task_config)
    rng = random.Random(args.seed)
    problems = [task.sample(rng) for _ in range(args.prompts)]
    prompts = [tok.encode(p.prompt, add_bos=True) for p in problems]
    rows = []
    drafts = args.draft or [
        f"offline={REPO_ROOT / 'outputs/debug_cpu/draft/draft'}",
        f"co-trained={REPO_ROOT / 'outputs/debug_cpu/rl/draft'}",
    ]
    for spec in drafts:
        name, path = spec.split("=", 1)
        engine = BuiltinRolloutEngine.from_pretrained(
            args.policy, path, BuiltinEngineConfig(num_draft_tokens=args.num_draft_tokens), max_seq_len=512
        )
        for T in (float(t) for t in args.temperatures.split(",")):
            sp = SamplingParams(T, max_new_tokens=args.max_new_tokens, stop_token_ids=tok.stop_ids, seed=args.seed)
            by = {"guess": [0, 0, 0, 0], "trace": [0, 0, 0, 0]}  # completions, tokens, target forwards, right
            for p, r in zip(problems, engine.generate(prompts, sp)):
                text = tok.decode(r.output_ids)
                s = by["trace" if "/" in text else "guess"]
                s[0] += 1
                s[1] += len(r.output_ids)
                s[2] += r.verify_steps
                s[3] += int(exact_match(text, p.answer) == 1.0)
            for style, (n, tokens, forwards, right) in by.items():
                rows.append(
                    {
                        "draft": name,
                        "temperature": T,
                        "style": style,
                        "completions": n,
                        "mean_tokens": tokens / n if n else None,
                        "accept_len": tokens / forwards if forwards else None,
                        "right": right,
                    }
                )
    print(f"policy {args.policy}, {args.prompts} prompts, fixed K = {args.num_draft_tokens}")
    print("| draft | T | style | completions | mean tokens | acceptance length | right |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        f = lambda x, spec: "-" if x is None else format(x, spec)
        print(
            f"| {r['draft']} | {r['temperature']:g} | {r['style']} | {r['completions']} | {f(r['mean_tokens'], '.1f')} "
            f"| {f(r['accept_len'], '.2f')} | {r['right']} |"
        )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(
            {
                "benchmark": "trace_styles",
                "policy": args.policy,
                "drafts": drafts,
                "prompts": args.prompts,
                "num_draft_tokens": args.num_draft_tokens,
                "rows": rows,
            },
            fh,
            indent=2,
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
