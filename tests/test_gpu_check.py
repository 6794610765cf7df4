"""scripts/gpu_check.sh without a GPU, and the CLIs it drives (it cannot run here: no CUDA)."""

import importlib.util
import os
import subprocess
import sys

from titan_spec.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _module(rel: str):
    spec = importlib.util.spec_from_file_location(rel.replace("/", "_").removesuffix(".py"), os.path.join(ROOT, rel))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_gpu_check_without_cuda_is_one_line_and_exit_2():
    # CUDA_VISIBLE_DEVICES="" hides any GPU, so this holds on a GPU machine too.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable}
    out = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts/gpu_check.sh")], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("gpu_check: needs a CUDA GPU")


def test_gpu_check_steps_pass_arguments_their_clis_accept():
    gc = _module("scripts/gpu_check.py")
    assert list(gc.STEPS) == [
        "gpu_tests",
        "ttt_attention",
        "cotrain_32k",
        "compile_train_step",
        "engine_cuda",
        "vllm_cuda",
    ]
    bench = _module("bench/ttt_attention.py")
    ttt = bench._parse_args(gc.TTT_ARGS)
    assert (ttt.device, ttt.dtype, ttt.variants) == ("cuda", "bfloat16", "ttt,causal_x_T,causal_fa2_x_T")
    assert {"ttt", bench.REFERENCE, bench.REFERENCE_FA2} == set(ttt.variants.split(","))
    assert _module("bench/rollout.py")._parse_args(gc.ROLLOUT_ARGS).device == "cuda"
    path = os.path.join(ROOT, "train_configs", gc.TRAIN_CONFIG)
    big = load_config(path, gc.TRAIN_COMMON + gc.COTRAIN_ARGS, world_size=1, check_paths=False)
    assert (big.training.seq_len, big.activation_checkpoint.mode, big.draft.enable) == (32768, "full", True)
    assert load_config(
        path, gc.TRAIN_COMMON + gc.COMPILE_ARGS + ["--compile.enable", "true"], world_size=1, check_paths=False
    ).compile.enable


def _wheel(path, name: str, files: dict[str, str]) -> str:
    """A real pure-Python wheel of ``files`` (what pip installs from .gpu_wheels)."""
    import base64
    import hashlib
    import zipfile

    info = f"{name}-0.1.dist-info"
    files = {
        **files,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [
        f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(t.encode()).digest()).rstrip(b'=').decode()},"
        f"{len(t.encode())}"
        for n, t in files.items()
    ] + [f"{info}/RECORD,,"]
    whl = os.path.join(path, f"{name}-0.1-py3-none-any.whl")
    with zipfile.ZipFile(whl, "w") as z:
        for n, t in {**files, f"{info}/RECORD": "\n".join(record) + "\n"}.items():
            z.writestr(n, t)
    return whl


def test_gpu_site_installs_only_what_the_python_lacks(tmp_path):
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    wheels.mkdir()
    _wheel(wheels, "ts_probe_missing", {"ts_probe_missing/__init__.py": "VALUE = 7\n"})
    _wheel(wheels, "pytest", {"pytest/__init__.py": "raise RuntimeError('the image has its own pytest')\n"})
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts/gpu_site.py"), str(wheels), str(site)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    import json

    report = json.loads((site / "site.json").read_text())
    assert report["installed"] == ["ts_probe_missing-0.1-py3-none-any.whl"]
    assert report["present"] == ["pytest-0.1-py3-none-any.whl"] and not (site / "pytest").exists()
    assert report["placeholders"] == ([] if importlib.util.find_spec("datasets") else ["datasets"])
    probe = subprocess.run(
        [sys.executable, "-c", "import ts_probe_missing, pytest; print(ts_probe_missing.VALUE)"],
        env={**os.environ, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.stdout.strip() == "7", probe.stderr


def test_the_datasets_placeholder_imports_as_torchtitan_does_and_raises_on_use(tmp_path):
    gs = _module("scripts/gpu_site.py")
    pkg = tmp_path / "datasets"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(gs.ABSENT)
    (pkg / "distributed.py").write_text(gs.ABSENT_DISTRIBUTED)
    code = (
        "from datasets import Dataset, load_dataset\n"
        "from datasets.distributed import split_dataset_by_node\n"
        "try:\n    load_dataset('json', data_files='x.jsonl')\n"
        "except ModuleNotFoundError as e:\n    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and "datasets is not installed on this machine" in out.stdout, out.stderr
