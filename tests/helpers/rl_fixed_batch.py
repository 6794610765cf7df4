"""ONE RL step of a REAL RLTrainer (built as `python -m titan_spec.train` builds it) on a FIXED
rollout batch, so that runs under different parallelisms train on the same completions and
sampling noise cannot hide a difference (tests/test_rl_scale.py):

    python -m torch.distributed.run --nproc_per_node=N tests/helpers/rl_fixed_batch.py \
        --batch FILE --out DIR [--record] ARGS...

ARGS: titan_spec CLI arguments (--config included) of the RL run.
--record  (one process) generate the step's rollouts for real first and write them to FILE:
          each group's answer is set to its first completion's text (so rewards, hence
          advantages, differ within every group) and the behaviour log-probs are shifted by
          a fixed pattern (so importance ratios move off 1 and the PPO clip is exercised).
Otherwise FILE is read and replaces the rollouts: each data-parallel rank takes its share of
the problems, in order, as the dataloader would hand them out.

--generate (with FILE read) first generates the step's rollouts for real (push included) and
          writes this rank's to DIR/rollouts_rank{R}.json, then trains on FILE as above.

Both models take ONE plain SGD step (lr 1, no schedule), so their new weights are the old ones
minus the clipped gradients element by element: comparing weights compares gradients. DIR gets
policy.safetensors and draft.safetensors (the full tensors, from global rank 0) and
draft_rank{R}.safetensors from every other rank that holds the draft (a replicated draft must
agree everywhere); the step's metrics row is in the run's metrics.jsonl (--metrics.log_freq 1).
"""

import json
import math
import os
import sys

import titan_spec  # noqa: F401  (CPU shims before torchtitan)
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torchtitan.tools.logging import init_logger

from titan_spec import platform
from titan_spec.config import load_config
from titan_spec.data.problem import Problem
from titan_spec.rl.step_records import RolloutBatch
from titan_spec.rl.worker import RolloutStats
from titan_spec.rollout.base import Rollout
from titan_spec.preflight import to_trainer_config


def _take(argv: list[str], flag: str, has_value: bool = True):
    if flag not in argv:
        return None
    i = argv.index(flag)
    value = argv[i + 1] if has_value else True
    del argv[i : i + 1 + has_value]
    return value


def record(trainer, path: str) -> None:
    """Generate this step's rollouts for real and write them, rigged as the module says."""
    batch = trainer.generation.generate(trainer.step, trainer._policy_version(), 0.0)
    G, tok = trainer.rl.group_size, trainer.tokenizer
    problems = [
        {"prompt": p.prompt, "answer": tok.decode(batch.rollouts[i * G].output_ids)}
        for i, p in enumerate(batch.problems)
    ]
    rollouts = [
        {
            "prompt_ids": r.prompt_ids,
            "output_ids": r.output_ids,
            "finish_reason": r.finish_reason,
            "logprobs": [lp + 0.3 * math.sin(1.7 * (i + 3 * t)) for t, lp in enumerate(r.logprobs)],
        }
        for i, r in enumerate(batch.rollouts)
    ]
    with open(path, "w") as f:
        json.dump({"group_size": G, "problems": problems, "rollouts": rollouts}, f)


def fixed_generate(trainer, path: str):
    """A replacement for RolloutGeneration.generate: this data-parallel rank's share of FILE."""
    with open(path) as f:
        data = json.load(f)
    G, dl = data["group_size"], trainer.dataloader
    assert G == trainer.rl.group_size, (G, trainer.rl.group_size)
    share = len(data["problems"]) // dl.dp_world_size
    lo, hi = dl.dp_rank * share, (dl.dp_rank + 1) * share
    problems = [Problem(p["prompt"], p["answer"]) for p in data["problems"][lo:hi]]
    rollouts = [
        Rollout(r["prompt_ids"], r["output_ids"], r["logprobs"], r["finish_reason"])
        for r in data["rollouts"][lo * G : hi * G]
    ]

    def generate(step: int, version: int, push_s: float) -> RolloutBatch:
        return RolloutBatch(problems, rollouts, RolloutStats.of(rollouts, 0.0), {}, version, push_s)

    return generate


def main() -> None:
    init_logger()
    argv = sys.argv[1:]
    path, out, rec = _take(argv, "--batch"), _take(argv, "--out"), _take(argv, "--record", has_value=False)
    gen = _take(argv, "--generate", has_value=False)
    i = argv.index("--config")
    trainer = to_trainer_config(load_config(argv[i + 1], argv[:i] + argv[i + 2 :])).build()
    try:
        # One plain SGD step of lr 1 for both: new weights = old - clipped gradient (the
        # configured AdamW and its LR schedule are set aside for this one step).
        opts = trainer.optimizers.optimizers
        assert len(opts) == len(trainer.model_parts), "one optimizer per model part"
        for i, part in enumerate(trainer.model_parts):
            opts[i] = torch.optim.SGD([p for p in part.parameters() if p.requires_grad], lr=1.0)
        if trainer.draft_training is not None:
            dt = trainer.draft_training
            dt.optimizer = torch.optim.SGD(dt.draft.parameters(), lr=1.0)
        trainer.step += 1  # what torchtitan's train() does before each train_step
        if rec:
            record(trainer, path)
        elif gen:
            batch = trainer.generation.generate(trainer.step, trainer._policy_version(), trainer.push_weights())
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, f"rollouts_rank{dist.get_rank()}.json"), "w") as f:
                json.dump([[r.prompt_ids, r.output_ids, r.logprobs, r.finish_reason] for r in batch.rollouts], f)
        trainer.generation.generate = fixed_generate(trainer, path)
        trainer.train_step(None)
        policy, draft = trainer.full_weights()
        if dist.get_rank() != 0 and draft is not None:
            os.makedirs(out, exist_ok=True)
            save_file(
                {k: v.detach().cpu().clone() for k, v in draft.items()},
                os.path.join(out, f"draft_rank{dist.get_rank()}.safetensors"),
            )
        if dist.get_rank() == 0:
            os.makedirs(out, exist_ok=True)
            save_file({k: v.detach().cpu().clone() for k, v in policy.items()}, os.path.join(out, "policy.safetensors"))
            if draft is not None:
                save_file(
                    {k: v.detach().cpu().clone() for k, v in draft.items()}, os.path.join(out, "draft.safetensors")
                )
    finally:
        trainer.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    platform.exit_process(0)
