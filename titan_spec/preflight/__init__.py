"""Everything checked before the first step, in one place, and what it resolves the config to.

``python -m titan_spec.train --plan`` / ``--check`` (run_train.sh, before torchrun starts any
rank) and every run's own start go through ``validate_run`` (``plan_runs`` for a
job.requires chain): a config error is one line naming the key and where its value came
from, and nothing starts.

    torch_support.py   what the torch this process runs cannot (pp, ep, the spmd backends on torch < 2.14)
    resolve.py         tokenizer, target and draft architectures, tap ids, promised inputs (Made)
    parallelism.py     tensor / pipeline parallelism fit the target and the features used
    engines.py         the rollout engine can start from the inputs
    inputs.py          the files a config names (task file, records, reward, engine inputs)
    trainer_config.py  the config as torchtitan's Trainer.Config (what the checks resolved)
    plan.py            validate_run, plan_runs, weightless_inputs

The config's own values (types, ranges, combinations) are checked when it is loaded
(titan_spec/config/validate.py); runtime modules raise plain errors.
"""

from titan_spec.preflight.inputs import check_inputs
from titan_spec.preflight.plan import plan_runs, validate_run, weightless_inputs
from titan_spec.preflight.resolve import Made, draft_arch_for, resolve_arch, resolve_tokenizer, tap_ids_for
from titan_spec.preflight.trainer_config import to_trainer_config

__all__ = [
    "Made",
    "check_inputs",
    "draft_arch_for",
    "plan_runs",
    "resolve_arch",
    "resolve_tokenizer",
    "tap_ids_for",
    "to_trainer_config",
    "validate_run",
    "weightless_inputs",
]
