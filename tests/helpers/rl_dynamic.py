"""RL steps of a REAL RLTrainer with rl.dynamic_sampling on, printing one JSON line: per step
every round's rewards as the trainer scored them (``score`` is wrapped, so the rounds a step
ran are the calls it made), the seeds its generation used (``RolloutGeneration.rollout_share`` is wrapped), the
kept batch's rewards and what dynamic sampling recorded (tests/test_rl_dynamic_sampling.py).

    python -m torch.distributed.run --nproc_per_node=1 tests/helpers/rl_dynamic.py STEPS ARGS...

``coin`` is the test's reward (task.reward = "rl_dynamic:coin"): a fresh policy writes
random tokens, and a reward of 1 for about one completion in five, fixed by the text's
CRC32, gives some groups reward spread and leaves others flat.
"""

import json
import sys
import zlib

import titan_spec  # noqa: F401  (CPU shims before torchtitan)
import torch
from torchtitan.tools.logging import init_logger

from titan_spec import platform
from titan_spec.config import load_config
from titan_spec.preflight import to_trainer_config


def coin(completion: str, answer: str, record) -> float:
    """1 for about a fifth of the completions (by the CRC32 of the text), else 0."""
    return float(zlib.crc32(completion.encode()) % 5 == 0)


def main() -> None:
    init_logger()
    steps, argv = int(sys.argv[1]), sys.argv[2:]
    i = argv.index("--config")
    trainer = to_trainer_config(load_config(argv[i + 1], argv[:i] + argv[i + 2 :])).build()
    rounds: list = []
    seeds: list = []
    score, share = trainer.score, trainer.generation.rollout_share

    def recording_score(batch):
        rewards_PG = score(batch)
        rounds.append(rewards_PG.tolist())
        return rewards_PG

    def recording_share(prompts, seed, baselines, step):
        seeds.append(seed)
        return share(prompts, seed, baselines, step)

    trainer.score, trainer.generation.rollout_share = recording_score, recording_share
    out = []
    try:
        for _ in range(steps):
            rounds.clear()
            trainer.step += 1  # what torchtitan's train() does before each train_step
            trainer.train_step(None)
            record = trainer.last_step
            d = record.batch.dynamic
            out.append(
                {
                    "rounds": list(rounds),
                    "kept": record.rewards_PG.tolist(),
                    "seeds": list(seeds),
                    "dynamic": None if d is None else [d.rounds, d.dropped, d.topped_up, d.generated],
                    "batch_index": trainer.dataloader.batch_index,
                    "completions": len(record.batch.rollouts),
                }
            )
    finally:
        trainer.close()
        torch.distributed.destroy_process_group()
    print("rl_dynamic: " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
    platform.exit_process(0)
