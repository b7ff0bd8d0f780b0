"""Every GGUF tensor type we claim to read, written by `gguf.GGUFWriter` and read back."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants

from minillm.checkpoint.gguf import dequantize

ARR = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
ROUNDED = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def write_and_read(tmp_path, type_name: str):
    """A one-tensor GGUF file holding ARR stored as ``type_name``; returns the reader's tensor."""
    qtype = GGMLQuantizationType[type_name]
    data = {"F32": ARR, "F16": ARR.astype(np.float16)}.get(type_name)
    if data is None:
        data = quants.quantize(ARR, qtype)  # uint8 bytes, for BF16 and the block formats
    path = tmp_path / f"{type_name}.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_tensor("t", data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    (t,) = GGUFReader(str(path)).tensors
    assert t.tensor_type == qtype
    return t


@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16", "Q8_0", "Q4_1"])
def test_each_type_matches_gguf_dequantize_bit_exact(tmp_path, type_name):
    """Ours == the gguf package's own dequantize, with load_gguf's shape (reversed t.shape)."""
    t = write_and_read(tmp_path, type_name)
    shape = tuple(int(s) for s in reversed(t.shape))
    assert shape == ARR.shape
    ours = dequantize(t.data, t.tensor_type.name, shape)
    ref = torch.from_numpy(quants.dequantize(t.data, t.tensor_type).astype(np.float32))
    assert ours.dtype == torch.float32
    assert torch.equal(ours, ref.reshape(shape))


@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16"])
def test_float_types_equal_the_array_rounded_to_that_dtype(tmp_path, type_name):
    """Float types lose nothing beyond rounding the original array to their dtype."""
    t = write_and_read(tmp_path, type_name)
    ours = dequantize(t.data, type_name, ARR.shape)
    expected = torch.from_numpy(ARR).to(ROUNDED[type_name]).float()
    assert torch.equal(ours, expected)
    if type_name != "F32":
        assert not torch.equal(ours, torch.from_numpy(ARR))  # the rounding is really there


def test_unsupported_type_names_itself_and_the_supported_ones(tmp_path):
    t = write_and_read(tmp_path, "Q5_0")
    with pytest.raises(NotImplementedError, match="Q5_0") as err:
        dequantize(t.data, t.tensor_type.name, ARR.shape)
    assert "F32, F16, BF16, Q8_0, Q4_1" in str(err.value)
