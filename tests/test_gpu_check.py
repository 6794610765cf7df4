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
    out = subprocess.run(["bash", os.path.join(ROOT, "scripts/gpu_check.sh")], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("gpu_check: needs a CUDA GPU")


def test_gpu_check_steps_pass_arguments_their_clis_accept():
    gc = _module("scripts/gpu_check.py")
    assert list(gc.STEPS) == ["gpu_tests", "ttt_attention", "cotrain_32k", "compile_train_step", "engine_cuda", "sglang_smoke",
                             "vllm_cuda"]
    bench = _module("bench/ttt_attention.py")
    ttt = bench._parse_args(gc.TTT_ARGS)
    assert (ttt.device, ttt.dtype, ttt.variants) == ("cuda", "bfloat16", "ttt,causal_x_T,causal_fa2_x_T")
    assert {"ttt", bench.REFERENCE, bench.REFERENCE_FA2} == set(ttt.variants.split(","))
    assert _module("bench/rollout.py")._parse_args(gc.ROLLOUT_ARGS).device == "cuda"
    assert _module("bench/sglang_smoke.py")._parse_args(gc.SMOKE_ARGS).distill_steps == 100
    path = os.path.join(ROOT, "train_configs", gc.TRAIN_CONFIG)
    big = load_config(path, gc.TRAIN_COMMON + gc.COTRAIN_ARGS, world_size=1, check_paths=False)
    assert (big.training.seq_len, big.activation_checkpoint.mode, big.draft.enable) == (32768, "full", True)
    assert load_config(path, gc.TRAIN_COMMON + gc.COMPILE_ARGS + ["--compile.enable", "true"], world_size=1,
                       check_paths=False).compile.enable
