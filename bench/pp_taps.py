# Benchmark: what the TapChannel costs a pipelined co-training step.
#
# pp = 2 (2 processes, gloo on CPU), llama3/tiny target, EAGLE-3 draft on the last stage,
# schedule 1F1B. For each microbatch count the SAME trainer alternates blocks of steps
# between two modes, so both are measured side by side under the same machine load:
#
#   channel  the real thing: stage 0 sends the embeddings and its tapped layers of every
#            microbatch over the side groups; the last stage receives them before the draft
#            loss of that microbatch (tap 4 is on the last stage and used in place)
#   control  the same pipeline, hooks and draft loss, but nothing is sent: the draft reads
#            features the last stage already has (fixed buffers of the taps' shape)
#
# overhead = (channel - control) / control, from the median (and the min) step times; and,
# less noisy on a shared machine: the CPU seconds both ranks spend on a step (other
# processes' load does not add to them; waiting is not counted, so the wall-clock column
# still has to show that nothing waits), and the time spent inside the channel's calls
# per step (the slower rank; it includes waiting for taps that are still in flight).
#
# Usage: PYTHONPATH=. python bench/pp_taps.py [--microbatches 2,4,8] [--steps 8] [--out PATH]

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]


def _parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="TapChannel overhead in a pp=2 co-training step")
    p.add_argument("--microbatches", default="2,4,8", help="microbatch counts (1 row each)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=16, help="measured steps per mode and microbatch count")
    p.add_argument("--block", type=int, default=2, help="steps per block; modes alternate by block")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=str(REPO_ROOT / "bench/results/pp_taps.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


class _LocalFeatures:
    """The control: the TapChannel's interface, but taps stay where they are computed and the
    draft reads fixed buffers the last stage already holds."""

    def __init__(self, channel):
        L = channel.layout
        self.layout, self.received = L, 0
        self.features = {k: 0.02 * torch.randn(L.shape_BLD, dtype=L.dtype) for k in L.keys}

    def begin_step(self, n):
        self.received = 0

    def put(self, stage, mb, taps):
        pass

    def take(self, mb):
        self.received += len(self.features)
        return dict(self.features)

    def end_step(self):
        pass


class _Timed:
    """The real channel, with the time spent inside its calls summed (what the channel itself
    costs a rank, apart from the noise of the whole step)."""

    def __init__(self, channel):
        self.channel, self.layout, self.seconds = channel, channel.layout, 0.0

    @property
    def received(self):
        return self.channel.received

    def _timed(name):
        def call(self, *args):
            t = time.perf_counter()
            try:
                return getattr(self.channel, name)(*args)
            finally:
                self.seconds += time.perf_counter() - t

        return call

    begin_step, put, take, end_step = _timed("begin_step"), _timed("put"), _timed("take"), _timed("end_step")


def _use(trainer, channel):
    # Stages are private to torch's schedules; the benchmark swaps what they talk to.
    sched = trainer.pp_schedule
    for stage in getattr(sched, "_stages", None) or [sched._stage]:
        stage.channel = channel
    trainer.pp_loss.channel = channel


def _worker(args) -> None:
    import titan_spec  # noqa: F401
    import torch.distributed as dist

    from titan_spec.config import load_config
    from titan_spec.platform import exit_process
    from titan_spec.preflight import to_trainer_config

    rows = []
    for n in [int(x) for x in args.microbatches.split(",")]:
        cfg = load_config(
            str(REPO_ROOT / "train_configs/debug_cpu_pp.toml"),
            [
                "--model.name",
                "llama3",
                "--training.seq_len",
                str(args.seq_len),
                "--training.local_batch_size",
                str(n),
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.data_parallel_shard_degree",
                "1",
                "--parallelism.pipeline_parallel_microbatch_size",
                "1",
                "--parallelism.pipeline_parallel_schedule",
                "1F1B",
                "--draft.enable",
                "true",
                "--draft.eagle3.ttt_steps",
                "7",
                "--draft.draft_vocab_size",
                "0",
                "--checkpoint.enable",
                "false",
                "--metrics.log_freq",
                "1000000",
                "--metrics.enable_tensorboard",
                "false",
                "--job.dump_folder",
                f"/tmp/titan_spec_bench_pp_taps/{n}",
                "--training.steps",
                str(10**6),
            ],
        )
        trainer = to_trainer_config(cfg).build()
        real = _Timed(trainer.pp_loss.channel)
        control = _LocalFeatures(real)
        data = trainer.batch_generator(trainer.dataloader)
        times = {"channel": [], "control": []}
        cpu = {"channel": [], "control": []}
        in_channel = []

        def run(mode, k, keep):
            _use(trainer, real if mode == "channel" else control)
            for _ in range(k):
                trainer.step += 1
                dist.barrier()
                t, c = time.perf_counter(), time.process_time()
                trainer.train_step(data)
                c = torch.tensor([time.process_time() - c], dtype=torch.float64)
                dist.all_reduce(c)  # both ranks' CPU seconds of the step (the barrier after it)
                if keep:
                    times[mode].append(time.perf_counter() - t)
                    cpu[mode].append(float(c))
            if keep and mode == "channel":
                in_channel.append(real.seconds / k)
            real.seconds = 0.0

        run("channel", args.warmup, False)
        run("control", args.warmup, False)
        for i in range(0, args.steps, args.block):
            for mode in ("channel", "control") if i // args.block % 2 == 0 else ("control", "channel"):
                run(mode, args.block, True)
        # Time inside channel calls per step, on the slower of the two ranks.
        spent = torch.tensor([statistics.median(in_channel)], dtype=torch.float64)
        dist.all_reduce(spent, op=dist.ReduceOp.MAX)
        if dist.get_rank() == 0:
            ch, ct = statistics.median(times["channel"]), statistics.median(times["control"])
            rows.append(
                {
                    "microbatches": n,
                    "channel_ms": 1e3 * ch,
                    "control_ms": 1e3 * ct,
                    "overhead_pct": 100 * (ch - ct) / ct,
                    "channel_min_ms": 1e3 * min(times["channel"]),
                    "control_min_ms": 1e3 * min(times["control"]),
                    "min_overhead_pct": 100 * (min(times["channel"]) - min(times["control"])) / min(times["control"]),
                    "cpu_channel_ms": 1e3 * statistics.median(cpu["channel"]),
                    "cpu_control_ms": 1e3 * statistics.median(cpu["control"]),
                    "cpu_overhead_pct": 100
                    * (statistics.median(cpu["channel"]) - statistics.median(cpu["control"]))
                    / statistics.median(cpu["control"]),
                    "in_channel_ms": 1e3 * float(spent),
                    "in_channel_pct": 100 * float(spent) / ct,
                    "tap_bytes_per_step": n * len(real.layout.keys) * args.seq_len * real.layout.shape_BLD[2] * 4,
                    "channel_all_ms": [1e3 * t for t in times["channel"]],
                    "control_all_ms": [1e3 * t for t in times["control"]],
                }
            )
        trainer.close()
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(rows), flush=True)
    exit_process(0)


def main(argv=None) -> None:
    args = _parse_args(argv)
    if args.worker:
        _worker(args)
        return
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    load_before = os.getloadavg()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        __file__,
        "--worker",
        *(argv if argv is not None else sys.argv[1:]),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO_ROOT)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        sys.exit(f"benchmark failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}")
    rows = json.loads(lines[-1][len("RESULT ") :])
    load_after = os.getloadavg()

    print(f"pp=2, 1F1B, llama3/tiny, seq_len {args.seq_len}, 1-row microbatches, 2 gloo processes on CPU")
    print("step ms: median (min) over the measured steps; CPU: both ranks' CPU ms per step, median;")
    print("in-channel: time inside TapChannel calls per step")
    print(
        f"{'microbatches':>12} {'channel ms':>16} {'control ms':>16} {'overhead med (min)':>19} "
        f"{'CPU channel':>11} {'CPU control':>11} {'CPU overhead':>12} "
        f"{'in-channel ms':>14} {'in-channel %':>13} {'tap MB/step':>11}"
    )
    for r in rows:
        print(
            f"{r['microbatches']:>12} {r['channel_ms']:>8.1f} ({r['channel_min_ms']:>5.0f}) "
            f"{r['control_ms']:>8.1f} ({r['control_min_ms']:>5.0f}) "
            f"{r['overhead_pct']:>9.1f}% ({r['min_overhead_pct']:>5.1f}%) "
            f"{r['cpu_channel_ms']:>11.1f} {r['cpu_control_ms']:>11.1f} {r['cpu_overhead_pct']:>11.1f}% "
            f"{r['in_channel_ms']:>14.2f} {r['in_channel_pct']:>12.2f}% {r['tap_bytes_per_step'] / 1e6:>11.2f}"
        )
    print(f"load average (1 min) before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    report = {
        "config": vars(args),
        "load_avg_before": load_before,
        "load_avg_after": load_after,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "results": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
