"""The trainer's half of vLLM's CUDA IPC weight transport ("ipc",
vllm/distributed/weight_transfer/ipc_engine.py), without importing vllm.

vLLM's trainer-side engine (IPCTrainerWeightTransferEngine) needs vllm in the trainer's
environment, which titan_spec keeps free of it (the server has its own torch). What it sends
is plain data, written here in the same layout: per tensor its name, dtype name, shape and
``{gpu_uuid: args}``, ``args`` being torch's ``reduce_tensor`` rebuild arguments (the
receiver replaces the device index, args[6], with its own), pickled and base64-encoded into
``ipc_handles_pickled`` as vLLM's HTTP client does (clients.py ``_json_safe_update_info``).
The receiver maps the trainer's memory; the tensors must stay alive until it answered.

    info, keep = ipc_update_info(pairs, device)   # pairs: name -> tensor
    client.update_weights(which, info, version)   # then drop `keep`
"""

from __future__ import annotations

import base64
import pickle

import torch
from torch.multiprocessing.reductions import reduce_tensor

__all__ = ["ipc_update_info"]


def ipc_update_info(pairs: dict[str, torch.Tensor], device: torch.device) -> tuple[dict, list[torch.Tensor]]:
    """vLLM's unpacked IPC update_info for ``pairs`` copied onto ``device`` (the GPU the
    server's worker runs on: IPC handles are looked up by that GPU's UUID), and the copies
    whose memory the handles share (keep them until the server answered)."""
    if device.type != "cuda":
        raise ValueError(f"the IPC transport shares CUDA memory; the tensors are on {device}")
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    names, dtype_names, shapes, handles, keep = [], [], [], [], []
    for name, t in pairs.items():
        t = t.detach().to(device).contiguous()
        keep.append(t)
        names.append(name)
        dtype_names.append(str(t.dtype).split(".")[-1])
        shapes.append(list(t.shape))
        handles.append({uuid: reduce_tensor(t)[1]})
    torch.cuda.synchronize(device)  # the copies are complete before another process reads them
    info = {
        "names": names,
        "dtype_names": dtype_names,
        "shapes": shapes,
        "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode(),
    }
    return info, keep
