import json
import os
import subprocess
import sys

import pytest
import torch

from titan_spec.config import ConfigError, load_config, locate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pythonpath() -> str:
    """The repository first, then what this process was given (scripts/gpu_check.sh's
    .gpu_site on a machine whose image lacks packages)."""
    return os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)


def run_train(
    dump: str, nproc: int = 1, overrides: tuple[str, ...] = (), timeout: int = 600, config: str = "debug_cpu_sft.toml"
) -> list[dict]:
    """Run the real entry point under torchrun (gloo on CPU) with train_configs/``config``
    and small-model overrides; return the metrics.jsonl rows."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "titan_spec.train",
        "--config",
        os.path.join(ROOT, "train_configs", config),
        "--job.dump_folder",
        dump,
        "--metrics.log_freq",
        "1",
        "--metrics.enable_tensorboard",
        "false",
        "--training.seq_len",
        "128",
        "--training.local_batch_size",
        "4",
        "--lr_scheduler.warmup_steps",
        "2",
        *overrides,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=_pythonpath())
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    if out.returncode != 0:
        raise AssertionError(f"training failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}")
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def train_many(
    nproc: int, runs: list[tuple], timeout: int = 600, config: str = "debug_cpu_pp.toml"
) -> list[list[dict]]:
    """Several runs (dump folder, overrides[, env]) of train_configs/``config`` in ONE torchrun
    launch of nproc processes (tests/helpers/train_many.py), one after the other (a run may
    read what an earlier one exported); returns each run's metrics.jsonl rows. ``env``:
    environment variables for that run only; overrides starting with ("--config", NAME) run
    train_configs/NAME instead. The base arguments are run_train's."""
    base = [
        "--metrics.log_freq",
        "1",
        "--metrics.enable_tensorboard",
        "false",
        "--training.seq_len",
        "128",
        "--training.local_batch_size",
        "4",
        "--lr_scheduler.warmup_steps",
        "2",
    ]
    argvs = []
    for run in runs:
        name, overrides = config, list(run[1])
        if overrides[:1] == ["--config"]:
            name, overrides = overrides[1], overrides[2:]
        argvs.append(
            {
                "argv": [
                    "--config",
                    os.path.join(ROOT, "train_configs", name),
                    *base,
                    "--job.dump_folder",
                    run[0],
                    *overrides,
                ],
                "env": run[2] if len(run) > 2 else {},
            }
        )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        os.path.join(ROOT, "tests/helpers/train_many.py"),
        json.dumps(argvs),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=_pythonpath())
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    if out.returncode != 0:
        raise AssertionError(f"training failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}")
    rows = []
    for run in runs:
        with open(os.path.join(run[0], "metrics.jsonl")) as f:
            rows.append([json.loads(line) for line in f])
    return rows


@pytest.fixture
def train():
    return run_train


@pytest.fixture
def many():
    return train_many


def pytest_configure(config):
    # scripts/gpu_check.sh runs `pytest -m gpu`: the tests that need a CUDA GPU.
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one; scripts/gpu_check.sh runs them)")
    config.addinivalue_line(
        "markers",
        "needs_torch_2_14(what): runs what the preflight refuses on torch < 2.14 "
        "(titan_spec/preflight/torch_support.py); skipped there, as scripts/compat_check.sh counts them",
    )


def pytest_runtest_setup(item):
    mark = item.get_closest_marker("needs_torch_2_14")
    if mark is not None:
        from titan_spec.torch_compat import TORCH_VERSION

        if TORCH_VERSION < (2, 14):
            pytest.skip(f"refused on torch {torch.__version__} by the preflight: {mark.args[0]}")


def load_checked(path, overrides=None, world_size=None):
    """``load_config`` plus titan_spec.preflight.check_inputs (the task file, the SGLang inputs),
    errors located as ``validate_run`` locates them: what `--check` finds about a config's
    inputs, without building its trainer."""
    from titan_spec.preflight import check_inputs

    cfg = load_config(path, overrides, world_size, check_paths=False)
    try:
        check_inputs(cfg)
    except ConfigError as e:
        raise locate(cfg, e) from None
    return cfg
