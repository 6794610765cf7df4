"""Rollout engines: the protocol (base.py) and the built-in PyTorch engine (torch_engine.py)."""

from titan_spec.rl.rollout.base import Rollout, RolloutEngine, SamplingParams
from titan_spec.rl.rollout.torch_engine import TorchEngineConfig, TorchRolloutEngine

__all__ = ["Rollout", "RolloutEngine", "SamplingParams", "TorchEngineConfig", "TorchRolloutEngine"]
