"""The safetensors header reader on files the safetensors library writes: names, dtype codes and
shapes without the data, the torch dtypes load_file gives, and one line for a broken file."""

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from titan_spec.models.safetensors_header import (
    DTYPES,
    HFCheckpointError,
    read_safetensors_header,
    read_tensor,
    tensor_table,
)

TENSORS = {
    "w_bf16": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
    "w_f16": torch.ones(4, 1, 5, dtype=torch.float16),
    "w_f32": torch.zeros(7, dtype=torch.float32),
    "ids_i64": torch.tensor([3, -1, 2], dtype=torch.int64),
    "scalar_f32": torch.tensor(1.5),
}


@pytest.fixture
def file(tmp_path):
    path = str(tmp_path / "model.safetensors")
    save_file(TENSORS, path)
    return path


def test_header_names_dtype_codes_and_shapes(file):
    assert read_safetensors_header(file) == {
        "w_bf16": ("BF16", (2, 3)),
        "w_f16": ("F16", (4, 1, 5)),
        "w_f32": ("F32", (7,)),
        "ids_i64": ("I64", (3,)),
        "scalar_f32": ("F32", ()),
    }


def test_table_holds_the_dtypes_load_file_gives(file, tmp_path):
    other = str(tmp_path / "other.safetensors")
    save_file({"flag": torch.tensor([True, False]), "u8": torch.zeros(2, 2, dtype=torch.uint8)}, other)
    table = tensor_table([file, other])
    loaded = {**load_file(file), **load_file(other)}
    assert table == {name: (tuple(t.shape), t.dtype) for name, t in loaded.items()}
    assert table["w_bf16"] == ((2, 3), torch.bfloat16) and table["ids_i64"] == ((3,), torch.int64)


def test_every_dtype_in_the_table_round_trips_through_safetensors(tmp_path):
    path = str(tmp_path / "all.safetensors")
    save_file({code: torch.zeros(2, dtype=dtype) for code, dtype in DTYPES.items()}, path)
    assert {name: code for name, (code, _) in read_safetensors_header(path).items()} == {c: c for c in DTYPES}


def test_read_tensor_reads_one_tensor(file):
    assert torch.equal(read_tensor(file, "ids_i64"), TENSORS["ids_i64"])


@pytest.mark.parametrize(
    "cut, reason",
    [
        (1, "incomplete metadata, file not fully covered"),  # the last data byte lost
        ("header", "invalid header length"),  # the header itself cut short
    ],
)
def test_truncated_file_is_one_line_naming_it(file, cut, reason):
    raw = open(file, "rb").read()
    with open(file, "wb") as f:
        f.write(raw[:20] if cut == "header" else raw[:-cut])
    for read in (read_safetensors_header, lambda f: tensor_table([f])):
        with pytest.raises(HFCheckpointError) as e:
            read(file)
        assert str(e.value) == f"{file}: not a complete safetensors file: {reason}"


def test_a_dtype_load_file_cannot_load_is_one_line(tmp_path):
    # F8_E8M0 is a valid safetensors code that safetensors.torch does not map to a torch dtype.
    path = str(tmp_path / "e8m0.safetensors")
    header = json.dumps({"scale": {"dtype": "F8_E8M0", "shape": [2], "data_offsets": [0, 2]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + b"\0\0")
    assert read_safetensors_header(path) == {"scale": ("F8_E8M0", (2,))}
    with pytest.raises(
        HFCheckpointError, match=r"tensor 'scale' has safetensors dtype F8_E8M0, .*allowed: BOOL, U8"
    ) as e:
        tensor_table([path])
    assert "\n" not in str(e.value)
