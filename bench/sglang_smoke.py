# Smoke benchmark of the SGLang rollout engine (GPU + sglang 0.5.23 only).
#
# On a GPU machine with `pip install -e '.[sglang]'` it:
#   1. takes a small policy (HF dir) and its exported EAGLE-3 draft (defaults: the CPU
#      default's outputs/debug_cpu/hf and outputs/offline_draft/draft, trained by
#      bench/rollout.py's recipe when missing),
#   2. launches SGLang with speculative_algorithm=EAGLE3 from them and generates
#      (greedy and T = 1): acceptance length and tokens/s "before",
#   3. fine-tunes the draft on the policy's own rollouts (TTT, --distill-steps) and pushes
#      it live with update_draft_weights (custom loader, selector "draft", versioned):
#      acceptance length and tokens/s "after", from the same running server,
#   4. launches SGLang without speculation on the same policy: plain tokens/s,
# and prints a table and writes bench/results/sglang_smoke.json.
# Without sglang (or without a GPU) it exits with status 2 and one line saying what to install.
#
# Usage: PYTHONPATH=. python bench/sglang_smoke.py [--policy DIR --draft DIR] [--num-draft-tokens 3]
#        [--distill-steps 300] [--server-args '{"attention_backend": "triton"}']

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "bench"))

from titan_spec.rollout.sglang.client import INSTALL_HINT  # noqa: E402


def _parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="SGLang rollout engine: EAGLE3 serving and a live draft push")
    p.add_argument("--policy", default="", help="HF policy dir (default: outputs/debug_cpu/hf, else train one)")
    p.add_argument("--draft", default="", help="draft dir (default: outputs/offline_draft/draft, else train one)")
    p.add_argument("--num-draft-tokens", type=int, default=3, help="K (SGLang speculative_num_steps)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--distill-steps", type=int, default=300, help="TTT steps of the pushed draft on policy rollouts")
    # The CPU default's tiny models have head_dim 16, below what FlashInfer's kernels take.
    p.add_argument("--server-args", default='{"attention_backend": "triton"}', help="extra ServerArgs as JSON")
    p.add_argument("--mem-fraction", type=float, default=0.3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO_ROOT / "bench/results/sglang_smoke.json"))
    return p.parse_args(argv)


def _measure(engine, prompts, sp) -> dict:
    engine.generate(prompts[:2], sp)  # warm-up (CUDA graphs, caches)
    t0 = time.perf_counter()
    out = engine.generate(prompts, sp)
    dt = time.perf_counter() - t0
    tokens = sum(len(r.output_ids) for r in out)
    return {
        "tokens": tokens,
        "seconds": dt,
        "tok_s": tokens / dt,
        "accept_len": tokens / max(sum(r.verify_steps for r in out), 1),
        "versions": sorted({(r.policy_version, r.draft_version) for r in out}),
    }


def main(argv=None) -> int:
    args = _parse_args(argv)
    try:
        import sglang  # noqa: F401
    except ImportError:
        print(f"sglang_smoke: {INSTALL_HINT}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("sglang_smoke: SGLang needs a CUDA GPU; none is visible", file=sys.stderr)
        return 2

    import titan_spec  # noqa: F401
    from rollout import default_task, distill, resolve_models, tokenizer_for
    from titan_spec.config import load_config
    from titan_spec.rollout import SamplingParams, BuiltinEngineConfig, BuiltinRolloutEngine
    from titan_spec.rollout.sglang.engine import SGLangRolloutEngine

    policy, draft_dir = resolve_models(args)
    tok = tokenizer_for(policy)
    task, rng = default_task(), random.Random(args.seed)
    prompts = [tok.encode(task.sample(rng).prompt, add_bos=True) for _ in range(args.batch)]
    K = args.num_draft_tokens
    cfg = load_config(
        None,
        [
            "--rollout.sglang.mem_fraction_static",
            str(args.mem_fraction),
            "--rollout.sglang.server_args",
            _toml_table(json.loads(args.server_args)),
        ],
    ).rollout.sglang
    temps = (0.0, 1.0)
    rows = []

    spec = SGLangRolloutEngine(cfg, policy, draft_dir, K)
    try:
        for T in temps:
            sp = SamplingParams(T, max_new_tokens=args.max_new_tokens, seed=args.seed)
            rows.append({"engine": "EAGLE3, start draft", "temperature": T, **_measure(spec, prompts, sp)})
        t0 = time.perf_counter()
        local = BuiltinRolloutEngine.from_pretrained(policy, draft_dir, BuiltinEngineConfig(num_draft_tokens=K))
        new_draft = distill(local, tok, args.distill_steps, args.seed)
        t_distill = time.perf_counter() - t0
        t0 = time.perf_counter()
        spec.update_draft_weights(new_draft, version=1)
        t_push = time.perf_counter() - t0
        for T in temps:
            sp = SamplingParams(T, max_new_tokens=args.max_new_tokens, seed=args.seed)
            rows.append({"engine": "EAGLE3, pushed draft", "temperature": T, **_measure(spec, prompts, sp)})
    finally:
        spec.close()
    plain = SGLangRolloutEngine(cfg, policy, None, 0)
    try:
        for T in temps:
            sp = SamplingParams(T, max_new_tokens=args.max_new_tokens, seed=args.seed)
            rows.append({"engine": "no speculation", "temperature": T, **_measure(plain, prompts, sp)})
    finally:
        plain.close()

    base = {r["temperature"]: r["tok_s"] for r in rows if r["engine"] == "no speculation"}
    print("| engine               |    T | accept len |    tok/s | vs plain |")
    print("|----------------------|------|------------|----------|----------|")
    for r in rows:
        r["speedup"] = r["tok_s"] / base[r["temperature"]]
        print(
            f"| {r['engine']:<20} | {r['temperature']:>4g} | {r['accept_len']:>10.2f} | {r['tok_s']:>8.1f} | {r['speedup']:>7.2f}x |"
        )
    print(f"draft distilled in {t_distill:.1f}s ({args.distill_steps} steps), pushed in {t_push:.2f}s")
    result = {
        "benchmark": "sglang_smoke",
        "policy": policy,
        "draft": draft_dir,
        "num_draft_tokens": K,
        "batch": args.batch,
        "max_new_tokens": args.max_new_tokens,
        "distill_steps": args.distill_steps,
        "distill_s": t_distill,
        "push_s": t_push,
        "gpu": torch.cuda.get_device_name(),
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "sglang": sglang.__version__,
        "torch": torch.__version__,
        "rows": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2, default=list)
    print(f"wrote {args.out}")
    return 0


def _toml_table(d: dict) -> str:
    return "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in d.items()) + "}"


if __name__ == "__main__":
    sys.exit(main())
