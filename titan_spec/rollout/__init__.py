"""Rollout engines, RL-agnostic: the protocol (base.py), the built-in PyTorch engine
(builtin/), the SGLang and vLLM engines (sglang/, vllm/: each a real server in its own
environment; import them from there) and the weight-name mapping between trainer, HF and
draft-export names (weight_names.py).

The names below are imported on first use (PEP 562), not with the package, so that importing
one engine does not pull in the built-in engine and torchtitan with it.
"""

import importlib

__all__ = ["Rollout", "RolloutEngine", "SamplingParams", "BuiltinEngineConfig", "BuiltinRolloutEngine"]

_HOME = {
    "Rollout": "base",
    "RolloutEngine": "base",
    "SamplingParams": "base",
    "BuiltinEngineConfig": "builtin.engine",
    "BuiltinRolloutEngine": "builtin.engine",
}


def __getattr__(name: str):
    if name in _HOME:
        value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
