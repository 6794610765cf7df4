"""TOML -> typed config, with validation that names where a value came from (the file or
``command line --key``), the key and what is allowed.

    schema.py    the sections as plain dataclasses, one docstring per key
    loader.py    reading TOML and ``--section.key value`` overrides, type coercion, origins
                 (``locate``), the moved keys (``MOVED``), ``load_config``
    validate.py  each section's checks and those that span sections (``validate`` runs
                 ``CHECKS`` in order and changes nothing; ``check_paths``)
    mode.py      the run's mode (``cfg.mode``), decided once from the keys that select it
    errors.py    ``ConfigError``

This package stands on the ground floor: it imports no other titan_spec module. The checks
that need one (the task file, the SGLang engine's inputs, architectures and checkpoints)
live next to what they check; ``titan_spec.preflight.validate_run`` runs them all before a run.
"""

from titan_spec.config.errors import ConfigError
from titan_spec.config.loader import load_config, locate, parse_overrides, quiet_torchtitan
from titan_spec.config.mode import RunMode, mode_of, run_mode
from titan_spec.config.schema import (
    ActivationCheckpointConfig,
    DAPOConfig,
    DFlashConfig,
    DSparkConfig,
    DraftConfig,
    Eagle3Config,
    GeneratedTaskConfig,
    JobConfig,
    ModelConfig,
    OptimizerConfig,
    RLConfig,
    RolloutConfig,
    ServerEngineConfig,
    SGLangConfig,
    SpeculativeConfig,
    TaskConfig,
    TitanSpecConfig,
    TokenizerConfig,
    TrainingConfig,
    VLLMConfig,
)
from titan_spec.config.validate import check_paths, document_multiple, validate

__all__ = [
    "ConfigError",
    "TitanSpecConfig",
    "load_config",
    "parse_overrides",
    "locate",
    "quiet_torchtitan",
    "RunMode",
    "mode_of",
    "run_mode",
    "validate",
    "check_paths",
    "document_multiple",
    "ActivationCheckpointConfig",
    "DraftConfig",
    "JobConfig",
    "ModelConfig",
    "OptimizerConfig",
    "RLConfig",
    "RolloutConfig",
    "SGLangConfig",
    "SpeculativeConfig",
    "TaskConfig",
    "TokenizerConfig",
    "TrainingConfig",
    "VLLMConfig",
    "DAPOConfig",
    "DFlashConfig",
    "DSparkConfig",
    "Eagle3Config",
    "GeneratedTaskConfig",
    "ServerEngineConfig",
]
