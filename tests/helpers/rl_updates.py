"""Two RL steps of a REAL RLTrainer (built as `python -m titan_spec.train` builds it), driven
step by step, printing one JSON line with what each step did (tests/test_rl_updates.py):

    python -m torch.distributed.run --nproc_per_node=1 tests/helpers/rl_updates.py ARGS...

ARGS: titan_spec CLI arguments (--config included) of the RL run. Per step: the importance-ratio
deviation max |pi / pi_behaviour - 1| of each update, in order, and its policy gradient
norm (0 for a minibatch whose groups all have equal rewards); the optimizer steps the
policy's and the draft's AdamW have taken after it (their per-parameter "step" state); the
policy version the step's rollouts were generated with (what the engine was pushed); for a MoE
policy, the largest |routing bias| of the trainer's MoE layers after the step and whether the
built-in engine's biases equal the trainer's as pushed at the start of the step; the
completions' lengths.
"""

import json
import sys

import titan_spec  # noqa: F401  (CPU shims before torchtitan)
import torch
from torchtitan.tools.logging import init_logger

from titan_spec import platform
from titan_spec.config import load_config
from titan_spec.models.moe import expert_biases
from titan_spec.rl.worker import full_policy_state
from titan_spec.preflight import to_trainer_config


def _adam_steps(optimizer) -> list[float]:
    return sorted({float(s["step"]) for s in optimizer.state.values() if "step" in s})


def _load(argv: list[str]):
    i = argv.index("--config")
    return load_config(argv[i + 1], argv[:i] + argv[i + 2 :])


def main() -> None:
    init_logger()
    trainer = to_trainer_config(_load(sys.argv[1:])).build()
    steps = []
    try:
        for _ in range(2):
            pushed = {k: v.clone() for k, v in expert_biases(full_policy_state(trainer.model_parts)).items()}
            trainer.step += 1  # what torchtitan's train() does before each train_step
            trainer.train_step(None)
            record = trainer.last_step
            engine = getattr(trainer.worker.main, "target", None)
            served = expert_biases(engine.state_dict()) if engine is not None else {}
            after = expert_biases(full_policy_state(trainer.model_parts))
            steps.append(
                {
                    "max_expert_bias": max((float(v.abs().max()) for v in after.values()), default=None),
                    "engine_bias_pushed": bool(pushed) and all(torch.equal(served[k], v) for k, v in pushed.items()),
                    "ratio_dev": [u.ratio_dev for u in record.updates],
                    "grad_norm": [float(u.grad_norm) for u in record.updates],
                    "policy_adam_steps": _adam_steps(trainer.optimizers.optimizers[0]),
                    "draft_adam_steps": _adam_steps(trainer.draft_training.optimizer),
                    "policy_version": record.batch.policy_version,
                    "lengths": [len(r.output_ids) for r in record.batch.rollouts],
                    "engine_version": trainer.worker.main.policy_version,
                }
            )
    finally:
        trainer.close()
        torch.distributed.destroy_process_group()
    print("rl_updates: " + json.dumps(steps), flush=True)


if __name__ == "__main__":
    main()
    platform.exit_process(0)
