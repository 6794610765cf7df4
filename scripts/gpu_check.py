"""The prepared GPU check (scripts/gpu_check.sh runs this; issue 18): every path of titan_spec
that only runs on a CUDA GPU, in one go, within a fixed time budget (default 440 s), then ONE
JSON of results and a table. Each step is an existing entry point (pytest, titan_spec.train
under torchrun, bench/*.py) with its own CLI; this file only runs them, bounds their time,
and reads the numbers they print or write. The steps, and what each measures, are listed in
docs/PERFORMANCE.md ("The GPU check").

Usage (from the repository root, on a CUDA machine):
    scripts/gpu_check.sh [--out-dir DIR] [--budget-s 440] [--only step,step]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
TORCHRUN = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m", "titan_spec.train"]
_ANSI = re.compile(r"\x1b\[[0-9;]*m")

# The existing CLIs' arguments each step passes (tests/test_gpu_check.py parses every one of
# them with its own parser, so a renamed flag or config key fails on CPU, not on the GPU).
TTT_ARGS = [
    "--device",
    "cuda",
    "--dtype",
    "bfloat16",
    "--variants",
    "ttt,causal_x_T,causal_fa2_x_T",
    "--seqlens",
    "8192,32768",
    "--heads",
    "32",
    "--kv-heads",
    "8",
    "--head-dim",
    "128",
    "--steps",
    "7",
    "--iters",
    "3",
    "--mem-limit-gib",
    "120",
]
ROLLOUT_ARGS = [
    "--device",
    "cuda",
    "--batch-sizes",
    "1,32",
    "--temperatures",
    "0",
    "--repeats",
    "1",
    "--requests",
    "32",
    "--threads",
    "0",
]
TRAIN_COMMON = [
    "--metrics.log_freq",
    "1",
    "--metrics.enable_tensorboard",
    "false",
    "--checkpoint.enable",
    "false",
    "--job.export_hf",
    "",
]
COTRAIN_ARGS = [
    "--model.flavor",
    "0.6B",
    "--draft.enable",
    "true",
    "--training.seq_len",
    "32768",
    "--training.local_batch_size",
    "1",
    "--activation_checkpoint.mode",
    "full",
    "--training.dtype",
    "bfloat16",
    "--training.mixed_precision_param",
    "bfloat16",
    "--training.steps",
    "3",
    "--lr_scheduler.warmup_steps",
    "1",
]
COMPILE_ARGS = ["--draft.enable", "true", "--training.steps", "6", "--lr_scheduler.warmup_steps", "2"]
TRAIN_CONFIG = "debug_cpu_sft.toml"


@dataclass
class Result:
    name: str
    what: str
    status: str = "not run"  # ok | failed | timeout | skipped | not run
    seconds: float = 0.0
    metrics: dict = field(default_factory=dict)
    note: str = ""


class Runner:
    def __init__(self, out: Path, budget_s: float):
        self.out = out
        self.deadline = time.monotonic() + budget_s
        (out / "logs").mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, tag: str, cmd: list[str], limit_s: float, **env) -> tuple[int | None, str]:
        """Run cmd with at most min(limit_s, time left) seconds; its output goes to
        logs/<tag>.log and is returned. rc None = timed out."""
        limit = max(min(limit_s, self.left()), 1.0)
        e = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            HF_HUB_OFFLINE="1",
            **env,
        )
        e.pop("TITAN_SPEC_DEVICE", None)  # the GPU path, not the forced CPU one
        log = self.out / "logs" / f"{tag}.log"
        try:
            p = subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=limit)
            rc, text = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired as t:
            rc = None
            text = "".join(
                x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (t.stdout, t.stderr)
            )
            text += f"\n[gpu_check] timed out after {limit:.0f}s"
        log.write_text(" ".join(cmd) + "\n\n" + text)
        return rc, _ANSI.sub("", text)


def _fail(r: Result, rc, text: str) -> Result:
    r.status = "timeout" if rc is None else "failed"
    tail = [ln for ln in text.strip().splitlines() if ln.strip()][-1:] or ["?"]
    r.note = f"rc={rc}: {tail[0][:150]}"
    return r


def _train(run: Runner, tag: str, dump: Path, overrides: list[str], limit_s: float):
    cmd = [
        *TORCHRUN,
        "--config",
        str(ROOT / "train_configs" / TRAIN_CONFIG),
        "--job.dump_folder",
        str(dump),
        *TRAIN_COMMON,
        *overrides,
    ]
    rc, text = run.run(tag, cmd, limit_s)
    rows = []
    if (dump / "metrics.jsonl").is_file():
        rows = [json.loads(ln) for ln in (dump / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return rc, text, rows


# --- the steps ------------------------------------------------------------------------------


def gpu_tests(run: Runner) -> Result:
    r = Result("gpu_tests", "every test marked gpu (pytest -m gpu), on CUDA")
    rc, text = run.run(
        "gpu_tests", [PY, "-m", "pytest", "-q", "-rs", "-m", "gpu", "-p", "no:cacheprovider", "tests"], 90
    )
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors|deselected)", text)}
    r.metrics = counts
    if rc == 5:
        r.status, r.note = "skipped", "no test is marked gpu"
    elif rc == 0:
        r.status = "ok"
    else:
        _fail(r, rc, text)
    return r


def ttt_attention(run: Runner) -> Result:
    r = Result(
        "ttt_attention",
        "TTT attention fwd+bwd (7-step unroll, bf16) vs 7 x causal SDPA (its pick, and FA2, "
        "the trunk's kernel); goal <= 1.1x",
    )
    out = run.out / "ttt_attention.json"
    cmd = [PY, "bench/ttt_attention.py", *TTT_ARGS, "--out", str(out)]
    rc, text = run.run("ttt_attention", cmd, 100)
    if rc != 0 or not out.is_file():
        return _fail(r, rc, text)
    rows = json.loads(out.read_text())["results"]
    by = {(x["variant"], x["seqlen"]): x for x in rows if x.get("status") == "ok"}
    for S in sorted({x["seqlen"] for x in rows}):
        t, c, f = by.get(("ttt", S)), by.get(("causal_x_T", S)), by.get(("causal_fa2_x_T", S))
        if t and c:
            r.metrics[f"S{S}_ratio"] = round(t["time_s"] / c["time_s"], 3)
            r.metrics[f"S{S}_ttt_ms"] = round(1e3 * t["time_s"], 2)
            r.metrics[f"S{S}_peak_gib"] = round(t["peak_mem_gib"], 2)
        if t and f:  # at equal trunk kernel: what the branch and the merge cost
            r.metrics[f"S{S}_ratio_fa2"] = round(t["time_s"] / f["time_s"], 3)
    ratios = [v for k, v in r.metrics.items() if k.endswith("_ratio")]
    fa2 = [v for k, v in r.metrics.items() if k.endswith("_ratio_fa2")]
    r.status = "ok" if ratios else "failed"
    r.note = (
        f"worst {max(ratios):.2f}x of the causal cost ({'within' if max(ratios) <= 1.1 else 'OVER'} the 1.1x goal)"
        + (f", {max(fa2):.2f}x of causal on FA2" if fa2 else "")
        if ratios
        else "no row ran"
    )
    return r


def cotrain_32k(run: Runner) -> Result:
    r = Result(
        "cotrain_32k", "policy + draft co-training step, 32K tokens, Qwen3-0.6B shape, full AC, bf16: peak memory"
    )
    dump = run.out / "cotrain_32k"
    rc, text, rows = _train(run, "cotrain_32k", dump, COTRAIN_ARGS, 90)
    mem = [float(m) for m in re.findall(r"memory:\s*([\d.]+)\s*GiB", text)]
    if rc != 0 or not rows:
        return _fail(r, rc, text)
    r.status = "ok"
    r.metrics = {"steps": len(rows), "last_loss": rows[-1]["loss"], "peak_reserved_gib": max(mem) if mem else None}
    r.metrics.update({k: v for k, v in rows[-1].items() if k.startswith("draft/")})
    return r


def compile_train_step(run: Runner) -> Result:
    r = Result("compile", "torch.compile of the training step (policy + draft) vs eager: same losses, time")
    common = COMPILE_ARGS
    t0 = time.monotonic()
    rc_e, text_e, eager = _train(run, "compile_eager", run.out / "compile_eager", common, 40)
    t_eager = time.monotonic() - t0
    t0 = time.monotonic()
    rc_c, text_c, comp = _train(run, "compile_on", run.out / "compile_on", [*common, "--compile.enable", "true"], 90)
    t_comp = time.monotonic() - t0
    if rc_e != 0 or not eager:
        return _fail(r, rc_e, text_e)
    if rc_c != 0 or not comp:
        return _fail(r, rc_c, text_c)
    diffs = [abs(a["loss"] - b["loss"]) / max(abs(a["loss"]), 1e-12) for a, b in zip(eager, comp)]
    r.metrics = {
        "eager_s": round(t_eager, 1),
        "compiled_s": round(t_comp, 1),
        "max_rel_loss_diff": max(diffs),
        "steps": len(comp),
    }
    r.status = "ok" if len(comp) == len(eager) and all(d == d for d in diffs) else "failed"
    return r


def engine_cuda(run: Runner) -> Result:
    r = Result("engine_cuda", "built-in engine on CUDA: speculative (K=4) vs plain, greedy, batch 1 and 32")
    policy, draft = ROOT / "outputs/debug_cpu/sft/hf", ROOT / "outputs/debug_cpu/draft/draft"
    if not ((policy / "config.json").is_file() and (draft / "config.json").is_file()):
        # The default policy and its offline draft (train_configs/debug_cpu_draft.toml and
        # the runs it requires), trained here by titan_spec.train itself.
        rc, text = run.run(
            "engine_plan",
            [PY, "-m", "titan_spec.train", "--plan", "--config", str(ROOT / "train_configs/debug_cpu_draft.toml")],
            60,
        )
        if rc != 0:
            return _fail(r, rc, text)
        for i, cfg in enumerate(ln.strip() for ln in text.splitlines() if ln.strip().endswith(".toml")):
            rc, text = run.run(f"engine_train_{i}", [*TORCHRUN, "--config", cfg], 120)
            if rc != 0:
                return _fail(r, rc, text)
    out = run.out / "rollout.json"
    rc, text = run.run("engine_cuda", [PY, "bench/rollout.py", *ROLLOUT_ARGS, "--out", str(out)], 150)
    if rc != 0 or not out.is_file():
        return _fail(r, rc, text)
    result = json.loads(out.read_text())
    deepest = f"fixed_{result['num_draft_tokens']}"  # the trained draft at K = K_max
    for row in result["rows"]:
        if row["engine"] in ("plain", deepest, "adaptive"):
            key = f"b{row['batch']}_{row['engine']}"
            r.metrics[f"{key}_tok_s"] = round(row["tok_s"], 1)
            if row["engine"] != "plain":
                r.metrics[f"{key}_speedup"] = round(row["speedup"], 2)
                r.metrics[f"{key}_accept"] = round(row["accept_len"], 2)
    r.status = "ok"
    return r


def vllm_cuda(run: Runner) -> Result:
    r = Result(
        "vllm_cuda",
        "vLLM 0.33.0 on CUDA (tests/test_vllm_engine.py): EAGLE-3 greedy = plain greedy, "
        "policy and draft pushes by CUDA IPC, acceptance of a pushed draft, kill -9 and re-push",
    )
    # The module builds the GPU vLLM environment itself (scripts/ensure_vllm_env.sh: vllm 0.33.0
    # from the registry) and skips with the reason where it cannot.
    rc, text = run.run(
        "vllm_cuda",
        [
            PY,
            "-m",
            "pytest",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            "tests/test_vllm_engine.py",
            "-k",
            "not rl_steps_through_vllm",
        ],
        240,
    )
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors|deselected)", text)}
    r.metrics = counts
    if rc == 0 and not counts.get("passed"):
        reason = [ln for ln in text.splitlines() if ln.startswith("SKIPPED")][:1] or ["?"]
        r.status, r.note = "skipped", reason[0][:150]
    elif rc == 0:
        r.status = "ok"
    else:
        _fail(r, rc, text)
    return r


STEPS = {f.__name__: f for f in (gpu_tests, ttt_attention, cotrain_32k, compile_train_step, engine_cuda, vllm_cuda)}


def _fmt(metrics: dict) -> str:
    flat = {k: v for k, v in metrics.items() if isinstance(v, (int, float, str))}
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in list(flat.items())[:8])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", default=str(ROOT / "bench/results/gpu_check"))
    p.add_argument(
        "--budget-s",
        type=float,
        default=440.0,
        help="all steps together (with the installs and starts, the check must end within 8 min)",
    )
    p.add_argument("--only", default="", help=f"comma-separated subset of {','.join(STEPS)}")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: needs a CUDA GPU (torch.cuda.is_available() is False on this machine)", file=sys.stderr)
        return 2
    out = Path(args.out_dir)
    run = Runner(out, args.budget_s)
    chosen = [s for s in (args.only.split(",") if args.only else STEPS) if s]
    unknown = [s for s in chosen if s not in STEPS]
    if unknown:
        print(f"gpu_check: unknown step(s) {unknown}; steps: {', '.join(STEPS)}", file=sys.stderr)
        return 2
    t_all = time.monotonic()
    results = []
    for name in chosen:
        if run.left() < 5:
            results.append(Result(name, "", "not run", note="time budget spent"))
            continue
        t0 = time.monotonic()
        try:
            res = STEPS[name](run)
        except Exception as e:  # a broken step must not hide the others' numbers
            res = Result(name, "", "failed", note=f"{type(e).__name__}: {e}"[:160])
        res.seconds = round(time.monotonic() - t0, 1)
        results.append(res)
        print(f"  {name}: {res.status} ({res.seconds:.0f}s)", file=sys.stderr, flush=True)
    report = {
        "check": "gpu_check",
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "seconds": round(time.monotonic() - t_all, 1),
        "budget_s": args.budget_s,
        "steps": [r.__dict__ for r in results],
    }
    site = ROOT / ".gpu_site" / "site.json"  # what scripts/gpu_site.py installed for this run
    if site.is_file() and str(site.parent) in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        report["site"] = json.loads(site.read_text())
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    print(
        f"GPU check on {report['device']} (torch {report['torch']}), {report['seconds']:.0f}s of {args.budget_s:.0f}s"
    )
    if "site" in report:
        s = report["site"]
        print(
            f"installed from .gpu_wheels: {len(s['installed'])} wheels ({len(s['present'])} already on the image)"
            + (f"; placeholders: {', '.join(s['placeholders'])}" if s["placeholders"] else "")
        )
    print(f"{'step':<14} {'status':<8} {'s':>5}  numbers / note")
    for r in results:
        print(f"{r.name:<14} {r.status:<8} {r.seconds:>5.0f}  {_fmt(r.metrics)} {r.note}".rstrip())
    print(f"wrote {out / 'gpu_check.json'}")
    return 0 if all(r.status in ("ok", "skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
