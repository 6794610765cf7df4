# Benchmark: what one RL co-training step costs per rank at long context, and what the
# TapChannel costs inside a pipelined RL step.
#
# Shape suffix legend: S = tokens per sequence (one packed row = one document), P = prompts,
# G = group size.
#
# Part 1 (--seqlens, --cps): per-rank peak memory and time of one RL training step (the
# policy's PPO-clip loss + the EAGLE-3 draft co-trained from the same forward, activation
# checkpointing "full") at S tokens per sequence and context parallelism cp. Each (S, cp)
# runs in a fresh torchrun launch of cp processes (gloo, one thread each) that builds a REAL
# RLTrainer (as `python -m titan_spec.train` builds it: train_configs/long_context_cpu.toml,
# tiny_long policy from its init, a fresh draft) and drives its train_step with a FIXED
# rollout batch injected at the generate seam: P = 1 'records' prompt of S - 18 tokens, its
# G = 2 completions (the right answer and a wrong one: advantages +-0.71), rl.minibatches = 2
# (one document of ~S tokens each), of which the step keeps the first (the real pack, its
# first minibatch): the measured step is ONE optimizer update on ONE S-token document. Per rank,
# peak memory = the RSS high-water mark during the step (VmHWM, reset through
# /proc/self/clear_refs right before it) minus the RSS before it (the built trainer, its
# weights and the rollout engine's copy exist already; the step's activations, gradients,
# optimizer states, logits, ring buffers and the draft's branch keys count), as
# bench/cp_memory.py counts; the table shows the largest rank. The workers run with a fixed
# MALLOC_MMAP_THRESHOLD_ (--mmap-threshold, 64 KiB): with glibc's dynamic threshold, freed
# heap blocks stay in the RSS and the peaks depend on tensor sizes (1.5-2x too high here).
# Time: the step's training phase (the update; push + the injected generate are ~0), wall
# seconds of the slowest rank, and the CPU seconds of all ranks (time.process_time summed).
#
# Part 2 (--pp-microbatches): the TapChannel's overhead inside the RL step at pp = 2, as
# bench/pp_taps.py measures it for SFT (same trainer, modes alternating in blocks: the real
# channel vs a control whose draft reads buffers the last stage already holds; CPU seconds
# of both ranks per step). Needs RL under pipeline parallelism (issue 14 item 2).
#
# Usage: PYTHONPATH=. python bench/rl_scale.py [--seqlens 4096,8192,16384,32768] [--cps 1,2,4]
#        PYTHONPATH=. python bench/rl_scale.py --seqlens '' --pp-microbatches 2,4
#        PYTHONPATH=. python bench/rl_scale.py --merge A.json,B.json   (print the step rows of earlier runs)

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
GIB = 1024**3
CONFIG = REPO_ROOT / "train_configs/long_context_cpu.toml"
COMPLETION = 18  # <bos> + the longest answer (16) + <eos>: a document of S - 18 prompt tokens fits S


def _parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="RL co-training step memory/time at long context; TapChannel in RL")
    p.add_argument("--seqlens", default="4096,8192,16384,32768", help="tokens per sequence ('' = skip part 1)")
    p.add_argument("--cps", default="1,2,4")
    p.add_argument("--steps", type=int, default=1, help="RL steps measured per (S, cp); time = the last one's")
    p.add_argument("--ttt-steps", type=int, default=3, help="the draft's TTT steps (long_context_cpu.toml: 3)")
    p.add_argument("--flavor", default="tiny_long")
    p.add_argument("--pp-microbatches", default="", help="part 2: microbatch counts at pp = 2 ('' = skip)")
    p.add_argument("--pp-seq-len", type=int, default=1024)
    p.add_argument("--pp-steps", type=int, default=16, help="part 2: measured steps per mode")
    p.add_argument("--pp-block", type=int, default=2)
    p.add_argument(
        "--mmap-threshold",
        type=int,
        default=65536,
        help="MALLOC_MMAP_THRESHOLD_ for the workers (bytes; 0 = glibc's dynamic default, whose "
        "freed heap blocks stay in the RSS): a fixed threshold returns every freed block "
        "over it to the OS, so the RSS tracks live tensors",
    )
    p.add_argument("--timeout", type=int, default=3600, help="seconds per (S, cp) launch")
    p.add_argument("--out", default=str(REPO_ROOT / "bench/results/rl_scale.json"))
    p.add_argument("--merge", default="", help="comma-separated result JSONs: print their step rows, run nothing")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    p.add_argument("--seqlen", type=int, default=4096, help=argparse.SUPPRESS)
    p.add_argument("--cp", type=int, default=1, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------
# Memory: the RSS high-water mark of one step
# ---------------------------------------------------------------------------


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    # Linux >= 4.0: writing 5 resets VmHWM to the current RSS (proc(5), clear_refs).
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


# ---------------------------------------------------------------------------
# The real RLTrainer with a fixed rollout batch
# ---------------------------------------------------------------------------


def _overrides(args, S: int, cp: int, pp: int = 1, n_micro: int = 0) -> list[str]:
    out = [
        "--model.hf_checkpoint",
        "",
        "--model.flavor",
        args.flavor,
        "--draft.init_from",
        "",
        "--draft.draft_vocab_size",
        "32",
        "--draft.eagle3.ttt_steps",
        str(args.ttt_steps),
        "--draft.vocab_count_batches",
        "1",
        "--task.generated.prompt_len",
        str(S - COMPLETION),
        "--training.seq_len",
        str(S),
        "--rl.prompts_per_step",
        "1",
        "--rl.group_size",
        "2",
        "--rl.minibatches",
        "2",
        "--rl.baseline_interval",
        "0",
        "--rl.max_new_tokens",
        str(COMPLETION - 1),
        "--parallelism.context_parallel_degree",
        str(cp),
        "--parallelism.data_parallel_shard_degree",
        "1",
        "--activation_checkpoint.mode",
        "full",
        "--checkpoint.enable",
        "false",
        "--metrics.log_freq",
        "1000000",
        "--metrics.enable_tensorboard",
        "false",
        "--job.dump_folder",
        f"/tmp/titan_spec_bench_rl_scale/{S}_{cp}_{pp}",
        "--training.steps",
        "1000000",
    ]
    if pp > 1:
        out += [
            "--model.name",
            "llama3",
            "--model.flavor",
            "tiny",
            "--parallelism.pipeline_parallel_degree",
            str(pp),
            "--parallelism.pipeline_parallel_microbatch_size",
            "1",
            "--parallelism.pipeline_parallel_schedule",
            "1F1B",
            "--rl.group_size",
            str(n_micro),
            "--rl.minibatches",
            "1",
            "--draft.eagle3.ttt_steps",
            "7",
            # One completion per row, one row per microbatch: n_micro microbatches per update.
            "--training.local_batch_size",
            str(n_micro),
        ]
    return out


def _fixed_batch(trainer, task_cfg, seed: int):
    """P = 1 problem of the 'records' task, its G = 2 completions: the right answer and one with
    the sum off by one (rewards 1, 0), behaviour log-probs -1.5 per token. Every rank builds the
    same batch (seeded)."""
    from titan_spec.data.tasks import build_task
    from titan_spec.rl.step_records import RolloutBatch
    from titan_spec.rl.worker import RolloutStats
    from titan_spec.rollout.base import Rollout

    tok, G = trainer.tokenizer, trainer.rl.group_size
    problem = build_task(task_cfg).sample(random.Random(seed))
    prompt = tok.encode(problem.prompt, add_bos=True)
    head, total = problem.answer.rsplit(",", 1)
    answers = [problem.answer] + [f"{head},{int(total) + 1 + g}" for g in range(G - 1)]
    rollouts = []
    for a in answers:
        out = tok.encode(a, add_eos=True)
        rollouts.append(Rollout(prompt, out, [-1.5] * len(out), "stop", verify_steps=len(out)))

    def generate(push_s: float):
        return RolloutBatch([problem], rollouts, RolloutStats.of(rollouts, 0.0), {}, trainer._policy_version(), push_s)

    return generate


def _build(argv_overrides, one_update: bool = False):
    import titan_spec  # noqa: F401  (CPU shims before torchtitan)
    from titan_spec.config import load_config
    from titan_spec.preflight import to_trainer_config

    cfg = load_config(str(CONFIG), argv_overrides)
    trainer = to_trainer_config(cfg).build()
    trainer.generate = _fixed_batch(trainer, cfg.task, cfg.task.seed)
    if one_update:
        # One optimizer update per step, on ONE document: the real pack, first minibatch only.
        pack = trainer.pack
        trainer.pack = lambda batch, advantages_PG: pack(batch, advantages_PG)[:1]
    return trainer


def _step_worker(args) -> None:
    import torch
    import torch.distributed as dist

    from titan_spec.platform import exit_process

    torch.set_num_threads(1)
    trainer = _build(_overrides(args, args.seqlen, args.cp), one_update=True)
    rows = []
    for step in range(1, args.steps + 1):
        trainer.step = step  # what torchtitan's train() does before each train_step
        dist.barrier()
        base = _status_kib("VmRSS")
        _reset_peak()
        t, c = time.perf_counter(), time.process_time()
        trainer.train_step(None)
        c = time.process_time() - c
        dist.barrier()
        wall = time.perf_counter() - t
        rows.append(
            {
                "peak_gib": (_status_kib("VmHWM") - base) * 1024 / GIB,
                "rss_before_gib": base * 1024 / GIB,
                "wall_s": wall,
                "train_s": trainer.last_step.train_s,
                "cpu_s": c,
                "loss": float(sum(float(u.loss) for u in trainer.last_step.updates)),
            }
        )
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(gathered), flush=True)
    trainer.close()
    exit_process(0)


def _pp_worker(args) -> None:
    """Part 2: pp = 2, the RL step's channel vs control (bench/pp_taps.py's modes)."""
    import torch
    import torch.distributed as dist

    from titan_spec.platform import exit_process

    sys.path.insert(0, str(Path(__file__).parent))
    from pp_taps import _LocalFeatures, _Timed, _use  # bench/pp_taps.py

    torch.set_num_threads(1)
    rows = []
    for n in [int(x) for x in args.pp_microbatches.split(",")]:
        trainer = _build(_overrides(args, args.pp_seq_len, 1, pp=2, n_micro=n))
        real = _Timed(trainer.pp_loss.channel)
        control = _LocalFeatures(real)
        cpu, wall, inside = {"channel": [], "control": []}, {"channel": [], "control": []}, []

        def run(mode, k, keep):
            _use(trainer, real if mode == "channel" else control)
            for _ in range(k):
                trainer.step += 1
                dist.barrier()
                t, c = time.perf_counter(), time.process_time()
                trainer.train_step(None)
                c = torch.tensor([time.process_time() - c], dtype=torch.float64)
                dist.all_reduce(c)  # both ranks' CPU seconds of the step
                if keep:
                    wall[mode].append(time.perf_counter() - t)
                    cpu[mode].append(float(c))
            if keep and mode == "channel":
                inside.append(real.seconds / k)
            real.seconds = 0.0

        run("channel", 2, False)
        run("control", 2, False)
        for i in range(0, args.pp_steps, args.pp_block):
            for mode in ("channel", "control") if i // args.pp_block % 2 == 0 else ("control", "channel"):
                run(mode, args.pp_block, True)
        spent = torch.tensor([statistics.median(inside)], dtype=torch.float64)
        dist.all_reduce(spent, op=dist.ReduceOp.MAX)
        med = {m: statistics.median(v) for m, v in cpu.items()}
        rows.append(
            {
                "microbatches": n,
                "cpu_channel_ms": 1e3 * med["channel"],
                "cpu_control_ms": 1e3 * med["control"],
                "cpu_overhead_pct": 100 * (med["channel"] - med["control"]) / med["control"],
                "channel_ms": 1e3 * statistics.median(wall["channel"]),
                "control_ms": 1e3 * statistics.median(wall["control"]),
                "in_channel_ms": 1e3 * float(spent),
                "in_channel_pct": 100 * float(spent) / statistics.median(wall["control"]),
            }
        )
        trainer.close()
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(rows), flush=True)
    exit_process(0)


# ---------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------


def _launch(nproc: int, worker_args: list[str], timeout: int, mmap_threshold: int = 0) -> tuple[object, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    if mmap_threshold:
        # glibc otherwise raises its threshold after the first large free (up to 32 MiB), and
        # freed heap blocks below it stay in the RSS: peaks then depend on tensor sizes.
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        __file__,
        *worker_args,
    ]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout} s"
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        errs = [line for line in (out.stderr + out.stdout).splitlines() if "Error" in line or "error" in line]
        return None, (errs[-1] if errs else f"exit {out.returncode}")[-300:]
    return json.loads(lines[-1][len("RESULT ") :]), ""


def _step_row(S: int, cp: int, args) -> dict:
    ranks, why = _launch(
        cp,
        [
            "--worker",
            "step",
            "--seqlen",
            str(S),
            "--cp",
            str(cp),
            "--ttt-steps",
            str(args.ttt_steps),
            "--flavor",
            args.flavor,
            "--steps",
            str(args.steps),
        ],
        args.timeout,
        args.mmap_threshold,
    )
    row = {"seqlen": S, "cp": cp}
    if ranks is None:
        return {**row, "status": "failed", "note": why}
    # Step 1 allocates the optimizers' states (they count); time is the last step's.
    per_rank = [max(s["peak_gib"] for s in steps) for steps in ranks]
    return {
        **row,
        "status": "ok",
        "peak_gib": max(per_rank),
        "peak_gib_per_rank": per_rank,
        "rss_before_gib": max(steps[0]["rss_before_gib"] for steps in ranks),
        "train_s": max(steps[-1]["train_s"] for steps in ranks),
        "cpu_s": sum(steps[-1]["cpu_s"] for steps in ranks),
        "train_s_per_step": [max(steps[i]["train_s"] for steps in ranks) for i in range(len(ranks[0]))],
        "loss_step1": sum(steps[0]["loss"] for steps in ranks),
        "kib_per_local_token": max(per_rank) * GIB / 1024 / (S / cp),
    }


def _print_steps(rows: list[dict], args) -> None:
    print(
        f"One RL co-training step (PPO-clip + EAGLE-3 draft, {args.ttt_steps} TTT steps, full AC), "
        f"{args.flavor} policy, one update on one S-token document, fp32, CPU, gloo, 1 thread/rank."
    )
    print(
        f"peak: max over ranks and the {args.steps} measured step(s) of (VmHWM - RSS before the step); "
        "train s: the slowest rank's training phase of the last step; CPU s: all ranks' CPU seconds of it"
    )
    ones = {r["seqlen"]: r for r in rows if r["cp"] == 1 and r["status"] == "ok"}
    header = (
        f"{'S':>6} {'cp':>2} {'peak GiB/rank':>13} {'vs cp=1':>7} {'KiB/local token':>15} {'train s':>8} "
        f"{'CPU s':>8} {'RSS before':>10}  note"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        ok = r["status"] == "ok"
        base = ones.get(r["seqlen"])
        ratio = f"{r['peak_gib'] / base['peak_gib']:.2f}x" if ok and base else "-"
        print(
            f"{r['seqlen']:>6} {r['cp']:>2} {r['peak_gib'] if ok else float('nan'):>13.3f} {ratio:>7} "
            f"{r.get('kib_per_local_token', float('nan')):>15.1f} "
            f"{r.get('train_s', float('nan')):>8.1f} {r.get('cpu_s', float('nan')):>8.1f} "
            f"{r.get('rss_before_gib', float('nan')):>10.2f}  {r.get('note', '')}"
        )


def main(argv=None) -> None:
    args = _parse_args(argv)
    if args.worker == "step":
        _step_worker(args)
        return
    if args.worker == "pp":
        _pp_worker(args)
        return
    if args.merge:
        # Later files win for the same (S, cp): reruns replace failed rows.
        merged = {}
        for path in args.merge.split(","):
            for r in json.loads(Path(path).read_text()).get("steps", []):
                merged[(r["seqlen"], r["cp"])] = r
        _print_steps([merged[k] for k in sorted(merged)], args)
        return
    report = {"config": vars(args), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "load_before": os.getloadavg()}
    if args.seqlens:
        rows = []
        for S in (int(s) for s in args.seqlens.split(",")):
            for cp in (int(c) for c in args.cps.split(",")):
                rows.append(_step_row(S, cp, args))
                print(
                    f"  done S={S} cp={cp}: {rows[-1]['status']} (load {os.getloadavg()[0]:.1f})",
                    file=sys.stderr,
                    flush=True,
                )
        _print_steps(rows, args)
        report["steps"] = rows
    if args.pp_microbatches:
        pp_rows, why = _launch(
            2,
            [
                "--worker",
                "pp",
                "--pp-microbatches",
                args.pp_microbatches,
                "--pp-seq-len",
                str(args.pp_seq_len),
                "--pp-steps",
                str(args.pp_steps),
                "--pp-block",
                str(args.pp_block),
            ],
            args.timeout,
        )
        if pp_rows is None:
            print(f"pp = 2 TapChannel part failed: {why}")
        else:
            print(
                "pp = 2, 1F1B, llama3/tiny, RL step (fixed batch, 1-document microbatches); "
                "CPU ms: both ranks per step, median"
            )
            print(
                f"{'microbatches':>12} {'CPU channel':>11} {'CPU control':>11} {'CPU overhead':>12} "
                f"{'wall channel':>12} {'wall control':>12} {'in-channel ms':>13} {'in-channel %':>12}"
            )
            for r in pp_rows:
                print(
                    f"{r['microbatches']:>12} {r['cpu_channel_ms']:>11.1f} {r['cpu_control_ms']:>11.1f} "
                    f"{r['cpu_overhead_pct']:>11.1f}% {r['channel_ms']:>12.1f} {r['control_ms']:>12.1f} "
                    f"{r['in_channel_ms']:>13.2f} {r['in_channel_pct']:>11.2f}%"
                )
        report["pp"] = pp_rows if pp_rows is not None else {"status": "failed", "note": why}
    report["load_after"] = os.getloadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"load average (1 min) before {report['load_before'][0]:.2f}, after {report['load_after'][0]:.2f}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
