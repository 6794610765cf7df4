"""Rollout engines: the protocol (base.py), the built-in PyTorch engine (torch_engine.py) and
the SGLang engine (sglang_engine.py; import it from there, it is GPU-only at run time)."""

from titan_spec.rl.rollout.base import Rollout, RolloutEngine, SamplingParams
from titan_spec.rl.rollout.torch_engine import TorchEngineConfig, TorchRolloutEngine

__all__ = ["Rollout", "RolloutEngine", "SamplingParams", "TorchEngineConfig", "TorchRolloutEngine"]
