"""The one place a safetensors file is read in part: its header (names, dtypes, shapes) or one
tensor, never the whole file.

safetensors' own reader (``safe_open``, memory-mapped) checks the header when the file is
opened: its length, its JSON, and that the tensors' byte ranges tile the data exactly. So a
truncated file, one with bytes after the last tensor, or a corrupt header is one
HFCheckpointError naming the file and safetensors' reason, before ``load_file`` would fail on
it later with a traceback.

``DTYPES`` is the one table from a header's dtype code to the torch dtype ``load_file`` gives
for it; a code outside it is a tensor ``load_file`` cannot load, refused in one line.
"""

from __future__ import annotations

import torch
from safetensors import SafetensorError, safe_open

__all__ = ["DTYPES", "HFCheckpointError", "read_safetensors_header", "read_tensor", "tensor_table"]

DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "C64": torch.complex64,
}
"""safetensors dtype code -> the torch dtype ``safetensors.torch.load_file`` gives it."""


class HFCheckpointError(ValueError):
    """A checkpoint directory that cannot be used, phrased for the user."""


def read_safetensors_header(file: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype code, shape) from ``file``'s header, without reading the data; a file
    safetensors cannot open is one HFCheckpointError naming it and safetensors' reason."""
    try:
        with safe_open(file, framework="pt") as f:
            return {name: (f.get_slice(name).get_dtype(), tuple(f.get_slice(name).get_shape())) for name in f.keys()}
    except (SafetensorError, OSError) as e:
        reason = str(e).removeprefix("Error while deserializing header: ")
        raise HFCheckpointError(f"{file}: not a complete safetensors file: {reason}") from None


def tensor_table(files: list[str]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (shape, torch dtype) of every tensor in ``files``, from their headers (no tensor
    is read): what a server that loads these files holds for each name."""
    out = {}
    for file in files:
        for name, (code, shape) in read_safetensors_header(file).items():
            if code not in DTYPES:
                raise HFCheckpointError(
                    f"{file}: tensor {name!r} has safetensors dtype {code}, which safetensors.torch cannot load; "
                    f"allowed: {', '.join(DTYPES)}"
                )
            out[name] = (shape, DTYPES[code])
    return out


def read_tensor(file: str, name: str) -> torch.Tensor:
    """The tensor ``name`` of ``file``, alone (the rest of the file is not read)."""
    with safe_open(file, framework="pt") as f:
        return f.get_tensor(name)
