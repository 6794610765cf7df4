"""What the trainer cannot run on the torch of this process, refused before anything starts.

titan_spec pins torch 2.14.1; on torch < 2.14 (the lent GPU image's 2.11) torch_compat.py
backfills what torchtitan 0.3.0 imports, and this refuses, in one ConfigError line each, the
paths whose 2.14 APIs cannot be backfilled faithfully.
"""

from __future__ import annotations

import os

from titan_spec.config import ConfigError, TitanSpecConfig
from titan_spec import torch_compat

__all__ = ["check_torch_support"]


def check_torch_support(cfg: TitanSpecConfig, version: tuple[int, int] | None = None) -> None:
    """One ConfigError for the first feature of ``cfg`` that torch ``version`` (default: this
    process's) cannot run."""
    version = version or torch_compat.TORCH_VERSION
    if version >= (2, 14):
        return
    on = f"torch {version[0]}.{version[1]}"
    p = cfg.parallelism
    if p.pipeline_parallel_degree > 1:
        raise ConfigError(
            f"parallelism.pipeline_parallel_degree = {p.pipeline_parallel_degree} is refused on {on}: its pipeline "
            "schedules split the microbatch kwargs themselves (torchtitan 0.3.0 calls step(arg_mbs=..., kwarg_mbs=...)) "
            "and PipelineStage takes no get_mesh; pp needs torch >= 2.14 (the pinned 2.14.1)",
            key="parallelism.pipeline_parallel_degree",
        )
    if p.expert_parallel_degree > 1:
        raise ConfigError(
            f"parallelism.expert_parallel_degree = {p.expert_parallel_degree} is refused on {on}: torchtitan 0.3.0 "
            "shards the experts on their own mesh with fully_shard's per-parameter mesh, which torch 2.14 added; "
            "ep needs torch >= 2.14 (the pinned 2.14.1)",
            key="parallelism.expert_parallel_degree",
        )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if p.spmd_backend == "full_dtensor" or (p.spmd_backend == "spmd_types" and world > 1):
        raise ConfigError(
            f"parallelism.spmd_backend = {p.spmd_backend!r} is refused on {on} with {world} process(es): torchtitan "
            "0.3.0 passes fully_shard the mesh's data-parallel axes (dp_mesh_dims), which torch 2.14 added; "
            "allowed there: 'partial_dtensor'",
            key="parallelism.spmd_backend",
        )
