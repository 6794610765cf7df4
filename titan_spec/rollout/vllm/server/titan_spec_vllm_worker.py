"""Runs inside vLLM's worker processes (the .venv-vllm interpreter): the worker extension
through which titan_spec replaces the served policy and draft weights in place.

vLLM resolves ``worker_extension_cls`` by qualified name in every worker it spawns, so this
module is top-level on the server's PYTHONPATH (titan_spec_vllm_server.py puts its folder
there) and imports nothing from titan_spec (the trainer's package needs torch 2.14 and
torchtitan; this environment has torch 2.13 and vLLM).

Why ``reload_weights`` (vllm/model_executor/model_loader/reload/inplace.py) and not
``model.load_weights``: after start-up vLLM has processed the parameters into kernel
form (fused qkv / gate_up, repacked CPU weights), and a second plain load_weights fails
on them; reload_weights restores the checkpoint layout layer by layer, loads, processes
again and copies the result into the original storage (so shared tensors, e.g. the
embedding the EAGLE-3 drafter borrows from the target, see the new values).
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import load_file

# Imported for its effect, before any model runs in this worker: vLLM's CPU stand-in for
# the rejection sampler's expand kernel never writes its output (cpu_expand_fix.py).
import cpu_expand_fix

__all__ = ["TitanSpecWorkerExtension"]


def _refresh_lm_heads(model) -> None:
    """Re-run the lm_head's weight processing after a reload. On CPU it packs its weight
    into a private GEMM copy (layers/utils.py dispatch_cpu_unquantized_gemm, called by
    UnquantizedEmbeddingMethod.process_weights_after_loading); with tied embeddings the
    weight is the embedding's, and reload_weights processes a tied parameter through one
    parent only (reload/__init__.py, limitation 2: the embedding), so the lm_head kept
    the OLD packed copy: measured, a pushed tied policy then served neither policy's
    greedy output. Re-packing from the current weight is idempotent for untied heads."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    for module in model.modules():
        if isinstance(module, ParallelLMHead) and getattr(module, "quant_method", None) is not None:
            module.quant_method.process_weights_after_loading(module)


class TitanSpecWorkerExtension:
    """Mixed into vLLM's worker class; called through ``collective_rpc``."""

    def titan_spec_models(self) -> dict:
        """{'target': the served policy, 'draft': the EAGLE-3 drafter's model or None}."""
        runner = self.model_runner
        drafter = getattr(runner, "drafter", None)
        return {"target": runner.get_model(), "draft": getattr(drafter, "model", None)}

    def titan_spec_reload(self, path: str, which: str) -> int:
        """Load the safetensors file at ``path`` (HF names for 'target', draft export names
        for 'draft') into the served model in place; returns the tensor count. The
        trainer checked names, shapes and dtypes before writing the file."""
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        model = self.titan_spec_models()[which]
        if model is None:
            raise ValueError(f"this server has no {which} model (started without speculative_config?)")
        tensors = load_file(path)
        config = self.vllm_config
        with torch.no_grad():
            reload_weights(config, model, iter(tensors.items()), None, is_checkpoint_format=True)
            _refresh_lm_heads(model)
        return len(tensors)

    def titan_spec_fingerprint(self, which: str) -> float:
        """Sum of the served model's parameters (a cheap way to see that a push landed)."""
        model = self.titan_spec_models()[which]
        return float(sum(p.detach().double().sum() for p in model.parameters())) if model is not None else 0.0

    def titan_spec_pid(self) -> int:
        return os.getpid()

    def titan_spec_expand_fixed(self) -> bool:
        """Whether this worker runs the expand-kernel fix (cpu_expand_fix.py; False where
        vLLM has Triton and needs none)."""
        from vllm.triton_utils import dispatcher

        registered = dispatcher._registry.get(cpu_expand_fix.KERNEL)
        return cpu_expand_fix.APPLIED and registered is not None and registered[1] is cpu_expand_fix.expand_kernel
