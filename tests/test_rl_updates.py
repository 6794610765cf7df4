"""Several optimizer steps per rollout batch: rl.ppo_epochs = 2 x rl.minibatches = 2.

A real RLTrainer (tiny Qwen3, random EAGLE-3 draft, the built-in speculative engine) takes two
RL steps (tests/helpers/rl_updates.py) on a one-question task whose SFT demonstrations answer
"a" or "b" half the time each: the warm-started policy then answers either (a random one would
never score, and all-zero advantages give no gradient), and the reward, exact match with the
problem's own answer, varies inside every group. Checked against what the step must do:
- the importance ratio pi / pi_behaviour is 1 (up to the engine's and the trainer's
  different reduction orders) on the FIRST update after a weight push, because the policy
  then still is the policy that sampled the rollouts, and clearly not 1 on every later
  update, because each optimizer step moved the policy;
- four optimizer steps of the policy AND of the draft per rollout batch (AdamW's step count);
- the second step's rollouts come from the weights after those four steps (policy version 4,
  pushed to the engine).
"""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ON_POLICY = 1e-4
"""|ratio - 1| allowed on the first update: engine (KV-cached decode, fp32) and trainer (packed
forward, fp32) compute the same log-probs in different orders, ~1e-6 apart."""

MOVED = 1e-3
"""|ratio - 1| the later updates must exceed: one AdamW step at lr 1e-3 moves the policy's
log-probs by far more (measured ~1e-1; a missing optimizer step leaves ~1e-6)."""


def test_two_ppo_epochs_of_two_minibatches_take_four_optimizer_steps_on_one_rollout_batch(tmp_path):
    data = tmp_path / "ab.jsonl"
    data.write_text("".join(json.dumps({"question": "x", "answer": f"#### {c}"}) + "\n" for c in "ab"))
    common = ["--task.name", "jsonl", "--task.path", str(data), "--training.seq_len", "64",
              "--checkpoint.enable", "false", "--metrics.enable_tensorboard", "false"]
    sft = [
        "--config", os.path.join(ROOT, "train_configs", "debug_cpu_sft.toml"), *common,
        "--job.dump_folder", str(tmp_path / "sft"), "--training.steps", "30", "--lr_scheduler.warmup_steps", "2",
    ]
    rl = [
        "--config", os.path.join(ROOT, "train_configs", "debug_cpu.toml"), *common,
        "--job.dump_folder", str(tmp_path / "rl"), "--model.hf_checkpoint", str(tmp_path / "sft" / "hf"),
        "--draft.init_from", "", "--draft.export_dir", "", "--draft.vocab_count_batches", "1",
        "--training.steps", "2", "--rl.ppo_epochs", "2", "--rl.minibatches", "2", "--rl.prompts_per_step", "4",
        "--rl.group_size", "4", "--rl.max_new_tokens", "2", "--rl.baseline_interval", "0",
        "--rollout.progress", "false", "--optimizer.lr", "1e-3", "--lr_scheduler.warmup_steps", "0",
    ]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           os.path.join(ROOT, "tests/helpers/rl_updates.py"), json.dumps({"sft": sft, "rl": rl})]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    line = next(x for x in out.stdout.splitlines() if "rl_updates: " in x)
    first, second = json.loads(line.split("rl_updates: ", 1)[1])

    for step, adam_steps in ((first, 4.0), (second, 8.0)):
        dev = step["ratio_dev"]
        assert len(dev) == 4, dev  # 2 epochs x 2 minibatches
        assert dev[0] < ON_POLICY, dev
        assert all(d > MOVED for d in dev[1:]), dev
        assert step["policy_adam_steps"] == [adam_steps], step
        assert step["draft_adam_steps"] == [adam_steps], step
    assert (first["policy_version"], first["engine_version"]) == (0, 0)
    assert (second["policy_version"], second["engine_version"]) == (4, 4)
