"""Two RL steps of a REAL RLTrainer with rl.drift_metrics on, printing one JSON line: per
step the logged drift metrics (drift/kl, drift/kl_k3, rollout/completion_len*) and the same
KL estimates computed here independently, in float64, one rollout at a time (unpacked): the
log-probs of each completion under the policy that generated it (the engine's target, which
the step's push filled) and under the trainer's frozen starting policy (tests/test_rl_e2e.py).

    python -m torch.distributed.run --nproc_per_node=1 tests/helpers/rl_drift.py ARGS...
"""

import copy
import json
import statistics
import sys

import titan_spec  # noqa: F401  (CPU shims before torchtitan)
import torch
from torchtitan.tools.logging import init_logger

from titan_spec import platform
from titan_spec.config import load_config
from titan_spec.models.attention import doc_metadata_from_positions
from titan_spec.preflight import to_trainer_config


def _logps(model, ids: list[int], start: int, temperature: float) -> torch.Tensor:
    """float64 log-probs (at the temperature) of ids[start:] given what precedes them."""
    x = torch.tensor([ids])
    positions = torch.arange(len(ids))[None]
    out = model(x, positions=positions, attention_masks=doc_metadata_from_positions(positions))
    logits = (out[0] if isinstance(out, tuple) else out)[0].double() / temperature
    logp = logits.log_softmax(-1)
    return logp[start - 1 : -1].gather(-1, x[0, start:, None])[:, 0]


def independent(trainer) -> dict:
    record, T = trainer.last_step, trainer.rl.temperature
    cur = copy.deepcopy(trainer.worker.target).double()  # the weights this step's rollouts came from
    ref = copy.deepcopy(trainer.reference).double()
    k1, k3, lengths = [], [], []
    with torch.no_grad():
        for r in record.batch.rollouts:
            ids = r.prompt_ids + r.output_ids
            lengths.append(len(r.output_ids))
            if not r.output_ids:
                continue
            d = _logps(ref, ids, len(r.prompt_ids), T) - _logps(cur, ids, len(r.prompt_ids), T)
            k1 += (-d).tolist()
            k3 += (torch.exp(d) - d - 1).tolist()
    lengths.sort()
    return {
        "kl": sum(k1) / len(k1),
        "kl_k3": sum(k3) / len(k3),
        "len_mean": statistics.mean(lengths),
        "len_max": lengths[-1],
        "lengths": lengths,
    }


def main() -> None:
    init_logger()
    argv = sys.argv[1:]
    i = argv.index("--config")
    trainer = to_trainer_config(load_config(argv[i + 1], argv[:i] + argv[i + 2 :])).build()
    steps = []
    try:
        for _ in range(2):
            trainer.step += 1  # what torchtitan's train() does before each train_step
            trainer.train_step(None)
            logged = {
                k: v
                for k, v in trainer.step_metrics().items()
                if k.startswith("drift/") or k.startswith("rollout/completion_len")
            }
            steps.append({"logged": logged, "independent": independent(trainer)})
    finally:
        trainer.close()
        torch.distributed.destroy_process_group()
    print("rl_drift: " + json.dumps(steps), flush=True)


if __name__ == "__main__":
    main()
    platform.exit_process(0)
