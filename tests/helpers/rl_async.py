"""Three steps of a REAL RLTrainer with rl.async_steps = 1 (built as `python -m titan_spec.train`
builds it), driven step by step, printing one JSON line (tests/test_rl_e2e.py):

    python -m torch.distributed.run --nproc_per_node=1 tests/helpers/rl_async.py ARGS...

Before each step the trainer's full policy is copied (the weights after the step before:
W_0, W_1, W_2). Per step: the version the trainer's weights had (record.policy_version),
the version its batch was generated with (batch.policy_version) and the draft versions of
its rollouts; for every copy W_j, the largest |log-prob of a completion token under W_j -
its behaviour log-prob| over the batch (an independent forward of a fresh model loaded
with W_j: the copy that generated the batch matches to rounding, the others do not); and
the updates' importance-ratio deviations max |pi / pi_behaviour - 1|.
"""

import json
import sys

import titan_spec  # noqa: F401  (CPU shims before torchtitan)
import torch
from torchtitan.tools.logging import init_logger

from titan_spec import platform
from titan_spec.config import load_config
from titan_spec.models.attention import doc_metadata_from_positions
from titan_spec.models.registry import build_target_config
from titan_spec.preflight import to_trainer_config
from titan_spec.rl.worker import full_policy_state


def _load(argv: list[str]):
    i = argv.index("--config")
    return load_config(argv[i + 1], argv[:i] + argv[i + 2 :])


def _max_logp_gap(model, rollouts) -> float:
    """max over the batch's completion tokens of |log softmax(model) - behaviour log-prob| (T = 1)."""
    gap = 0.0
    with torch.no_grad():
        for r in rollouts:
            ids = torch.tensor([r.prompt_ids + r.output_ids])
            positions = torch.arange(ids.shape[1])[None]
            out = model(ids, positions=positions, attention_masks=doc_metadata_from_positions(positions))
            logp = (out[0] if isinstance(out, tuple) else out)[0].float().log_softmax(-1)
            start = len(r.prompt_ids) - 1
            picked = logp[start : start + len(r.output_ids)].gather(-1, torch.tensor(r.output_ids)[:, None])[:, 0]
            gap = max(gap, float((picked - torch.tensor(r.logprobs)).abs().max()))
    return gap


def main() -> None:
    init_logger()
    config = to_trainer_config(_load(sys.argv[1:]))
    trainer = config.build()
    copies, steps = [], []
    try:
        for _ in range(3):
            copies.append({k: v.detach().clone() for k, v in full_policy_state(trainer.model_parts).items()})
            trainer.step += 1  # what torchtitan's train() does before each train_step
            trainer.train_step(None)
            record = trainer.last_step
            gaps = []
            for weights in copies:
                model = build_target_config(config.arch).build()
                model.load_state_dict(weights)
                gaps.append(_max_logp_gap(model.eval(), record.batch.rollouts))
            steps.append(
                {
                    "trainer_version": record.policy_version,
                    "batch_version": record.batch.policy_version,
                    "draft_versions": sorted({r.draft_version for r in record.batch.rollouts}),
                    "logp_gap_by_copy": gaps,
                    "ratio_dev": [u.ratio_dev for u in record.updates],
                    "wait_s": record.wait_s,
                }
            )
    finally:
        trainer.generation.close()
        trainer.close()
        torch.distributed.destroy_process_group()
    print("rl_async: " + json.dumps(steps), flush=True)


if __name__ == "__main__":
    main()
    platform.exit_process(0)
