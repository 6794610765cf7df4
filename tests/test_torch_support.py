"""titan_spec on a torch older than the pinned 2.14.1 (the lent GPU image's 2.11):
torch_compat.py's backfills match torch 2.14's own, the draft's loss result becomes a pytree
node exactly where FSDP needs it, and the preflight refuses what 2.11 cannot run in one line,
before anything starts. scripts/compat_check.sh runs the GPU check's test files under 2.11."""

import dataclasses
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.utils import _pytree

from titan_spec import torch_compat
from titan_spec.config import ConfigError, load_config
from titan_spec.preflight.torch_support import check_torch_support

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ON_2_14 = torch_compat.TORCH_VERSION >= (2, 14)


def _cfg(name: str, *overrides: str, world: int = 1):
    return load_config(os.path.join(ROOT, "train_configs", name), list(overrides), world_size=world, check_paths=False)


@pytest.mark.skipif(not ON_2_14, reason="compares the backfill with torch 2.14's own class")
def test_mesh_dims_backfill_behaves_as_torch_2_14s():
    from torch.distributed.fsdp import DataParallelMeshDims as Real

    Ours = torch_compat._DataParallelMeshDims
    assert [f.name for f in dataclasses.fields(Ours)] == [f.name for f in dataclasses.fields(Real)]
    for kw in ({"shard": "dp_shard"}, {"replicate": "dp_replicate"}, {"shard": ("dp_shard", "cp"), "replicate": "r"}):
        ours, real = Ours(**kw), Real(**kw)
        assert (ours.shard_names, ours.replicate_names) == (real.shard_names, real.replicate_names), kw
    for cls in (Ours, Real):
        with pytest.raises(ValueError, match="At least one of shard or replicate"):
            cls()


def test_set_timeout_backfill_sets_the_groups_timeout(tmp_path):
    # A real one-process gloo group; the backfill takes the default group for None, as 2.14's.
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        group = dist.new_group([0])
        for g in (None, group):
            torch_compat._set_timeout(timedelta(seconds=123), g)
            dist.barrier(group=g)  # the group still works after the change
        if ON_2_14:
            dist.set_timeout(timedelta(seconds=77), group)  # and the real one takes the same arguments
    finally:
        dist.destroy_process_group()


def test_fsdp_output_registers_a_pytree_node_only_where_fsdp_needs_it(monkeypatch):
    from titan_spec.models.draft import DraftLossResult

    t = torch.zeros(3)
    leaves = _pytree.tree_leaves(DraftLossResult(t, t, t, t))
    # On 2.14 FSDP finds the tensors in a dataclass itself: the class is left alone there.
    assert len(leaves) == (1 if ON_2_14 else 4)

    monkeypatch.setattr(torch_compat, "BACKFILLS_NEEDED", True)

    @torch_compat.fsdp_output
    @dataclasses.dataclass
    class Out:
        a: torch.Tensor
        b: torch.Tensor

    assert _pytree.tree_leaves(Out(t, t + 1))[1].tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    "name, overrides, world, key",
    [
        ("debug_cpu_pp.toml", (), 2, "pipeline_parallel_degree"),
        (
            "debug_cpu_sft.toml",
            ("--model.flavor", "tiny_moe", "--parallelism.expert_parallel_degree", "2"),
            2,
            "expert_parallel_degree",
        ),
        ("debug_cpu.toml", ("--parallelism.spmd_backend", "spmd_types"), 2, "spmd_backend"),
        ("debug_cpu.toml", ("--parallelism.spmd_backend", "full_dtensor"), 1, "spmd_backend"),
    ],
)
def test_preflight_refuses_what_torch_2_11_cannot_run(name, overrides, world, key, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    cfg = _cfg(name, *overrides, world=world)
    check_torch_support(cfg, (2, 14))  # the pinned torch runs it
    with pytest.raises(ConfigError) as e:
        check_torch_support(cfg, (2, 11))
    assert e.value.key == f"parallelism.{key}" and "refused on torch 2.11" in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_preflight_lets_torch_2_11_run_the_gpu_checks_configs(monkeypatch):
    # What the GPU check trains (debug_cpu_sft.toml, the default and its draft chain) and the
    # data-parallel default at dp = 2 (the dp = 2 draft-gradient test) are not refused.
    for name, world in (("debug_cpu_sft.toml", 1), ("debug_cpu.toml", 2), ("debug_cpu_draft.toml", 1)):
        monkeypatch.setenv("WORLD_SIZE", str(world))
        check_torch_support(_cfg(name, world=world), (2, 11))
    monkeypatch.setenv("WORLD_SIZE", "1")  # spmd_types on one process passes no dp_mesh_dims
    check_torch_support(_cfg("debug_cpu.toml", "--parallelism.spmd_backend", "spmd_types"), (2, 11))


def test_check_on_torch_2_11_is_one_line_naming_the_key(monkeypatch, capsys, tmp_path):
    from titan_spec.train.entry import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch_compat, "TORCH_VERSION", (2, 11))
    rc = main(
        [
            "--check",
            "--config",
            os.path.join(ROOT, "train_configs", "debug_cpu_pp.toml"),
            "--job.dump_folder",
            str(tmp_path),
        ]
    )
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0, err
    assert "parallelism.pipeline_parallel_degree" in err and "refused on torch 2.11" in err, err
