"""Where a server engine's environment is built: scripts/ensure_<engine>_env.sh of this checkout.

A leaf of the ground floor: the config's checks (validate.py) and the engines
(rollout/server_engine.py, rollout/vllm/serving.py) read the same path.
"""

from __future__ import annotations

import os

__all__ = ["env_script"]

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def env_script(engine: str) -> str:
    """scripts/ensure_<engine>_env.sh: builds (or reuses) that engine's environment."""
    return os.path.join(_ROOT, "scripts", f"ensure_{engine}_env.sh")
