"""The rollout engine can start from the config's inputs (one ConfigError line each)."""

from __future__ import annotations

import subprocess

from titan_spec.config import ConfigError, TitanSpecConfig
from titan_spec.models.hf_io import read_hf_arch
from titan_spec.platform import on_cpu
from titan_spec.rollout.sglang.engine import MANAGED_SERVER_ARGS
from titan_spec.rollout.vllm.serving import vllm_misfit
from titan_spec.rollout.weight_names import check_draft_fits_policy, sglang_tap_misfit

__all__ = ["check_engine_python", "check_sglang_config", "check_vllm_config"]


def check_sglang_config(cfg: TitanSpecConfig, files: bool = True) -> None:
    """A config whose rollout.engine is 'sglang' can start this engine: the policy and draft
    directories it needs are named, server_args sets no field this module sets, and (with
    ``files``) the draft fits the policy and its tap ids are ones SGLang captures. One
    ConfigError line each, before any run starts (``titan_spec.preflight.check_inputs`` runs it).
    ``files`` False: an earlier run of the job.requires chain writes those directories
    (``titan_spec.preflight.draft_arch_for`` checks the draft promised there)."""
    if cfg.rollout.engine != "sglang":
        return
    check_engine_python(cfg.rollout.sglang.python, "sglang", "rollout.sglang.python")
    if not cfg.model.hf_checkpoint:
        raise ConfigError(
            "rollout.engine = 'sglang' needs model.hf_checkpoint: SGLang loads the policy from a local HF directory"
        )
    if not cfg.speculative.enabled:
        return
    if not cfg.draft.init_from:
        raise ConfigError(
            "rollout.engine = 'sglang' with speculative.enabled needs draft.init_from: the exported EAGLE-3 "
            "draft directory SGLang starts from (train one with --draft.offline true)"
        )
    if on_cpu() and cfg.rollout.sglang.eagle_topk > 1:
        raise ConfigError(
            f"rollout.sglang.eagle_topk = {cfg.rollout.sglang.eagle_topk} is not served on CPU: titan_spec's "
            "stand-ins for SGLang's CPU kernels build a chain only; it must be 1 (trees need a GPU)",
            key="rollout.sglang.eagle_topk",
        )
    clash = sorted(set(cfg.rollout.sglang.server_args) & set(MANAGED_SERVER_ARGS))
    if clash:
        raise ConfigError(
            f"rollout.sglang.server_args sets {clash}, which titan_spec sets itself; use the [rollout.sglang] keys"
        )
    if not files:
        return
    try:
        check_draft_fits_policy(cfg.model.hf_checkpoint, cfg.draft.init_from)
        why = cfg.draft.tap_layer_ids and sglang_tap_misfit(
            cfg.draft.tap_layer_ids, read_hf_arch(cfg.model.hf_checkpoint).n_layers
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if why:
        raise ConfigError(f"draft.tap_layer_ids: {why} (rollout.engine = 'sglang')")


def check_vllm_config(cfg: TitanSpecConfig, files: bool = True) -> None:
    """A config whose rollout.engine is 'vllm' can start vLLM from its directories: the
    policy's and the draft's head sizes are ones vLLM's CPU attention serves and a
    full-vocabulary draft carries no d2t (rollout/vllm/serving.py ``vllm_misfit``). The
    config's values are checked at load (config/validate.py). ``files`` False: an earlier
    run of the job.requires chain writes those directories."""
    if cfg.rollout.engine != "vllm" or not cfg.rl.enable:
        return
    check_engine_python(cfg.rollout.vllm.python, "vllm", "rollout.vllm.python")
    if not files or not cfg.model.hf_checkpoint:
        return
    draft = cfg.draft.init_from if cfg.speculative.enabled else None
    try:
        why = vllm_misfit(cfg.model.hf_checkpoint, draft)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if why:
        key = "draft.init_from" if draft and why.startswith(f"the draft {draft}") else "model.hf_checkpoint"
        raise ConfigError(f"{why} (rollout.engine = 'vllm')", key=key)


def check_engine_python(python: str, module: str, key: str) -> None:
    """An engine environment named in the config (``key``, '' = the one its script builds
    and checks) has ``module``: found without importing it, so this takes milliseconds."""
    if not python:
        return
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    try:
        found = subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        found = False
    if not found:
        raise ConfigError(
            f"{key} = {python!r} has no {module} (or does not run); it must be an environment with {module}, "
            f"or '' (scripts/ensure_{module}_env.sh builds one)",
            key=key,
        )
