"""Runs inside vLLM's worker processes (the .venv-vllm interpreter): titan_spec's CPU weight
transport, registered with vLLM's weight-transfer factory, and a worker extension for what
vLLM's RL protocol does not say (fingerprints, the expand fix).

vLLM resolves ``worker_extension_cls`` by qualified name in every worker it spawns, before
the worker loads its model (and so before it builds its weight-transfer engine), so this
module is top-level on the server's PYTHONPATH (titan_spec_vllm_server.py puts its folder
there), registers the transport on import, and imports nothing from titan_spec (the
trainer's package needs torch 2.14 and torchtitan; this environment has torch 2.13 and vLLM).

Every push, on every device, is vLLM's own bracket (vllm/v1/worker/gpu_worker.py, which the
CPU worker inherits): ``start_weight_update`` (or ``start_draft_weight_update``, which aims
the engine at ``model_runner.drafter.model``) -> ``update_weights(update_info)`` ->
``finish_weight_update``. Between them vLLM's layerwise reload (model_loader/reload/)
restores the checkpoint layout, ``model.load_weights`` loads checkpoint-format tensors,
and finalize processes them into kernel form and copies the result into the original
storage (so shared tensors, e.g. the embedding the EAGLE-3 drafter borrows from the
target, see the new values). A plain ``model.load_weights`` after start-up fails on the
processed parameters (measured). The transports differ only in how tensors arrive:

    "titan_spec_file" (CPU)  a safetensors file the trainer wrote (/dev/shm by default)
    "ipc" (CUDA)             vLLM's IPCWeightTransferEngine: CUDA IPC handles of the
                             trainer's tensors on the same GPU (rollout/vllm/ipc.py)
"""

from __future__ import annotations

import os

from dataclasses import dataclass

import torch
from safetensors.torch import load_file
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

# Imported for its effect, before any model runs in this worker: vLLM's CPU stand-in for
# the rejection sampler's expand kernel never writes its output (cpu_expand_fix.py).
import cpu_expand_fix

__all__ = ["FILE_TRANSPORT", "FileWeightTransferEngine", "TitanSpecWorkerExtension"]

FILE_TRANSPORT = "titan_spec_file"


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


def _refresh_dflash_from(model, loaded: dict, kv_before) -> None:
    """A DFlash drafter's fused context buffers after a CPU reload: vLLM's own rebuild for the
    norms and the rotary table (which are not packed), then the stacked K/V projection weights
    [k_0; v_0; k_1; v_1; ...] (QKVParallelLinear's rows after q) from the pushed checkpoint
    tensors, the start-of-push ones for a layer the push left out."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "_build_fused_kv_buffers") or kv_before is None:
        return
    inner._build_fused_kv_buffers()
    parts = []
    for i, layer in enumerate(inner.layers):
        rows = 2 * layer.self_attn.kv_size
        before = kv_before[i * rows : (i + 1) * rows]
        k, v = (loaded.get(f"layers.{i}.self_attn.{p}_proj.weight") for p in ("k", "v"))
        parts.append(torch.cat([k, v]).to(before) if k is not None and v is not None else before)
    inner._fused_kv_weight = torch.cat(parts).contiguous()


@dataclass
class FileInitInfo(WeightTransferInitInfo):
    """Nothing to agree on: the file says everything."""


@dataclass
class FileUpdateInfo(WeightTransferUpdateInfo):
    path: str
    """A safetensors file of checkpoint-format tensors (HF names for the target, export
    names for the draft), checked by the trainer against the served tables before it was
    written."""


class FileWeightTransferEngine(WeightTransferEngine[FileInitInfo, FileUpdateInfo]):
    """The CPU transport: checkpoint-format tensors from a safetensors file, loaded inside
    vLLM's layerwise reload as its IPC engine loads CUDA tensors (ipc_engine.py)."""

    init_info_cls = FileInitInfo
    update_info_cls = FileUpdateInfo

    def init_transfer_engine(self, init_info: FileInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        # A DFlash drafter's fused K/V weights as they are before the reload replaces them.
        self._kv_before = getattr(getattr(self.model, "model", None), "_fused_kv_weight", None)
        self._loaded = {}
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict) -> None:
        # The base class also synchronizes the accelerator, which a CPU worker has none of
        # (torch.accelerator.synchronize raises there); loading from a file is synchronous.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: FileUpdateInfo) -> None:
        self._loaded = load_file(update_info.path)
        with torch.no_grad():
            self.model.load_weights(iter(self._loaded.items()))

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        with torch.no_grad():
            finalize_layerwise_reload(self.model, self.model_config)
            _refresh_lm_heads(self.model)
            _refresh_dflash_from(self.model, self._loaded, self._kv_before)
        self._loaded, self._kv_before = {}, None

    def shutdown(self) -> None:
        pass


# Every worker process imports this module before it builds its weight-transfer engine.
try:
    WeightTransferEngineFactory.register_engine(FILE_TRANSPORT, FileWeightTransferEngine)
except ValueError:  # registered already (a process that imported this module twice)
    pass


class TitanSpecWorkerExtension:
    """Mixed into vLLM's worker class; called through ``collective_rpc``."""

    def titan_spec_models(self) -> dict:
        """{'target': the served policy, 'draft': the EAGLE-3 drafter's model or None}."""
        runner = self.model_runner
        drafter = getattr(runner, "drafter", None)
        return {"target": runner.get_model(), "draft": getattr(drafter, "model", None)}

    def titan_spec_fingerprint(self, which: str) -> float:
        """Sum of the served model's parameters (a cheap way to see that a push landed)."""
        model = self.titan_spec_models()[which]
        return float(sum(p.detach().double().sum() for p in model.parameters())) if model is not None else 0.0

    def titan_spec_pid(self) -> int:
        return os.getpid()

    def titan_spec_after_draft_reload(self) -> bool:
        """Rebuild what a drafter derives from its weights outside the reload: vLLM's DFlash
        model stacks its context K/V projections, K norms and hidden norm into fused buffers
        (qwen3_dflash.py ``_build_fused_kv_buffers``) inside ``load_weights``, which in a
        layerwise reload runs on placeholders, before finalize has put the new values in place.
        Where the linear weights stay in place (CUDA), vLLM's own rebuild reads them; on CPU
        they are packed into the GEMM's private copy and emptied, so the file transport
        rebuilds from the pushed tensors instead (``_refresh_dflash_from``). Measured on CPU
        before either: the next proposal failed ("size mismatch ... vec (0)")."""
        draft = self.titan_spec_models()["draft"]
        inner = getattr(draft, "model", None)
        if inner is None or not hasattr(inner, "_build_fused_kv_buffers"):
            return False
        if not all(layer.self_attn.qkv_proj.weight.numel() for layer in inner.layers):
            return False  # packed away (CPU): the file transport rebuilt them from the pushed tensors
        with torch.no_grad():
            inner._build_fused_kv_buffers()
        return True

    def titan_spec_expand_fixed(self) -> bool:
        """Whether this worker runs the expand-kernel fix (cpu_expand_fix.py; False where
        vLLM has Triton and needs none)."""
        from vllm.triton_utils import dispatcher

        registered = dispatcher._registry.get(cpu_expand_fix.KERNEL)
        return cpu_expand_fix.APPLIED and registered is not None and registered[1] is cpu_expand_fix.expand_kernel
