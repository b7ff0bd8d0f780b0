"""GGUF's container format, read with ``struct`` and numpy: the metadata, and where each tensor's
bytes lie in the file (memory-mapped, nothing copied).

The ``gguf`` package's ``GGUFReader`` reads the same things, but it builds numpy views for every
string of the vocabulary and the merges (about 98k strings in SmolLM2's file): 6 of the 9 s a
model load took. Here a string costs one ``struct.unpack_from`` and one slice. The layout
(ggml's ``docs/gguf.md``, version 2 and 3), little-endian throughout:

  "GGUF"  version:u32  tensor_count:u64  kv_count:u64
  kv_count     x  key:str  value_type:u32  value        str = length:u64, then UTF-8 bytes
  tensor_count x  name:str  n_dims:u32  dims:u64[n_dims]  ggml_type:u32  offset:u64
  zero padding to ``general.alignment`` (32 when absent), then the data: tensor i at its offset

A value of type ARRAY is item_type:u32, count:u64 and the items. ``dims`` lists the fastest
dimension first (ggml's order); :class:`GGUFTensor` gives torch's order, rows first.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"GGUF"
SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                  10: "<Q", 11: "<q", 12: "<d"}      # GGUF value type -> struct format
STRING, ARRAY = 8, 9
NUMPY_TYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
               6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
FLOAT_VIEWS = {"F32": np.float32, "F16": np.float16}   # the rest stay raw bytes (uint8)


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file: ``data`` is a read-only view of its bytes, float32/float16 for
    F32/F16 and uint8 for every other type (BF16 and the block formats), as ``GGUFReader``
    hands them over."""
    name: str
    shape: tuple[int, ...]      # torch's order, rows first
    type_name: str              # ggml's name: F32, F16, BF16, Q8_0, Q4_1, ...
    data: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    version: int
    metadata: dict[str, object]   # key -> int, float, bool, str, or a list of them
    tensors: list[GGUFTensor]


class _Cursor:
    """Reads GGUF's values one after another from a buffer."""

    def __init__(self, buf) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        self.pos += n
        return self.buf[self.pos - n:self.pos].decode("utf-8")

    def value(self, value_type: int):
        if value_type == STRING:
            return self.string()
        if value_type in SCALAR_FORMATS:
            return self.scalar(SCALAR_FORMATS[value_type])
        if value_type != ARRAY:
            raise ValueError(f"GGUF value type {value_type} is not one of the format's")
        item_type, count = self.scalar("<I"), self.scalar("<Q")
        if item_type in NUMPY_TYPES:          # numbers: one frombuffer for the whole array
            items = np.frombuffer(self.buf, NUMPY_TYPES[item_type], count, self.pos)
            self.pos += items.nbytes
            return items.tolist()
        return [self.value(item_type) for _ in range(count)]


def _type_table() -> dict[int, tuple[str, int, int]]:
    """ggml type id -> (name, weights per block, bytes per block), from the gguf package's
    constants (data only: its reader is not used)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    return {int(t): (t.name, *GGML_QUANT_SIZES[t]) for t in GGMLQuantizationType}


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse the GGUF file at ``path``: its metadata and its tensors (views of a read-only
    memory map). ValueError when the file is not GGUF version 2 or 3."""
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)   # the arrays keep it open
    cur = _Cursor(mm)
    if mm[:4] != MAGIC:
        raise ValueError(f"{path} is not a GGUF file (it starts with {mm[:4]!r})")
    cur.pos = 4
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 and 3 are; "
                         "a big-endian file reads as a huge version)")
    n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
    metadata = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar("<I"))
    infos = []
    for _ in range(n_tensors):
        name, n_dims = cur.string(), cur.scalar("<I")
        dims = [cur.scalar("<Q") for _ in range(n_dims)]
        infos.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
    align = int(metadata.get("general.alignment", 32))
    start = -(-cur.pos // align) * align
    types = _type_table()
    tensors = []
    for name, dims, type_id, offset in infos:
        if type_id not in types:
            raise ValueError(f"{path}: tensor {name} has ggml type {type_id}, unknown to gguf")
        type_name, per_block, block_bytes = types[type_id]
        nbytes = int(np.prod(dims, dtype=np.int64)) // per_block * block_bytes
        dtype = np.dtype(FLOAT_VIEWS.get(type_name, np.uint8))
        data = np.frombuffer(mm, dtype, nbytes // dtype.itemsize, start + offset)
        tensors.append(GGUFTensor(name, tuple(reversed(dims)), type_name, data))
    return GGUFFile(version, metadata, tensors)
