"""Our GGUF container reader against the `gguf` package's GGUFReader on the model's own file and
on files GGUFWriter writes; bad files get errors that say what is wrong."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from minillm.checkpoint.gguf_file import read_gguf

HEADER_FIELDS = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}  # GGUFReader's own


def reference_metadata(reader: GGUFReader) -> dict:
    return {key: field.contents() for key, field in reader.fields.items()
            if key not in HEADER_FIELDS}


def assert_same_file(path, flattened_by_gguf: tuple[str, ...] = ()) -> None:
    """Ours equals GGUFReader's reading; ``flattened_by_gguf``: arrays of arrays, which its
    ``contents()`` flattens into one list (ours keeps the nesting; the caller checks it)."""
    ours, ref = read_gguf(path), GGUFReader(str(path))
    assert ours.version == ref.fields["GGUF.version"].contents()
    want = reference_metadata(ref)
    for key in flattened_by_gguf:
        assert [x for row in ours.metadata[key] for x in row] == want[key]
        want[key] = ours.metadata[key]
    assert ours.metadata.keys() == want.keys()
    for key, value in want.items():
        assert ours.metadata[key] == value and type(ours.metadata[key]) is type(value), key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for mine, theirs in zip(ours.tensors, ref.tensors):
        assert mine.type_name == theirs.tensor_type.name, mine.name
        assert mine.shape == tuple(int(s) for s in reversed(theirs.shape)), mine.name
        assert mine.data.dtype == theirs.data.dtype, mine.name
        assert np.array_equal(mine.data.reshape(-1).view(np.uint8),
                              np.asarray(theirs.data).reshape(-1).view(np.uint8)), mine.name


def test_the_model_file_reads_as_gguf_reads_it(gguf_path):
    assert_same_file(gguf_path)


def test_every_value_type_and_an_unaligned_tensor(tmp_path):
    path = tmp_path / "types.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_uint8("u8", 7)
    w.add_int8("i8", -7)
    w.add_uint16("u16", 700)
    w.add_int16("i16", -700)
    w.add_uint32("u32", 70_000)
    w.add_int32("i32", -70_000)
    w.add_float32("f32", 0.25)
    w.add_uint64("u64", 2**40)
    w.add_int64("i64", -2**40)
    w.add_float64("f64", 1e-300)
    w.add_bool("flag", True)
    w.add_string("text", "héllo ✓")
    w.add_array("ints", [1, 2, 3])
    w.add_array("words", ["a", "", "ünï"])
    w.add_array("nested", [[1, 2], [3]])
    w.add_tensor("odd", np.arange(3 * 5, dtype=np.float32).reshape(3, 5))
    w.add_tensor("half", np.ones((2, 4), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_same_file(path, flattened_by_gguf=("nested",))
    ours = read_gguf(path)
    assert ours.metadata["nested"] == [[1, 2], [3]] and ours.tensors[0].shape == (3, 5)


def test_a_file_that_is_not_gguf_says_so(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 a zip file")
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf(path)


def test_an_unsupported_version_names_it(tmp_path):
    path = tmp_path / "v1.gguf"
    path.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(16))
    with pytest.raises(ValueError, match="version 1"):
        read_gguf(path)


def test_a_block_type_we_do_not_dequantize_is_still_read(tmp_path):
    from gguf import quants

    path = tmp_path / "q5.gguf"
    w = GGUFWriter(str(path), "llama")
    data = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
    w.add_tensor("q", quants.quantize(data, GGMLQuantizationType.Q5_0),
                 raw_dtype=GGMLQuantizationType.Q5_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_same_file(path)
