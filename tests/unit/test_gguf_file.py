"""One parse of a GGUF file per process (engine.model.gguf_file), read again once the file changes."""

from __future__ import annotations

import os

import numpy as np
import pytest
from gguf import GGUFWriter

from engine.model.gguf_file import gguf_reader


def _write(path, name: str) -> None:
    writer = GGUFWriter(str(path), "llama")
    writer.add_name(name)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_file_is_parsed_once_and_again_when_it_changes(tmp_path):
    path = tmp_path / "m.gguf"
    _write(path, "first")
    reader = gguf_reader(path)
    assert gguf_reader(str(path)) is reader
    _write(path, "second, longer")
    stamp = os.stat(path).st_mtime_ns + 1_000_000_000  # a change within one clock tick counts too
    os.utime(path, ns=(stamp, stamp))
    again = gguf_reader(path)
    assert again is not reader
    assert again.get("general.name") == "second, longer"


def test_the_shipped_file_reads_as_ggufs_own_reader_reads_it(model_path):
    """gguf's GGUFReader is the reference: every metadata value and every tensor's view agree."""
    from gguf import GGUFReader

    ours, theirs = gguf_reader(model_path), GGUFReader(model_path)
    header = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}  # GGUFReader lists the header as fields
    assert set(ours.metadata) == set(theirs.fields) - header
    for key, field in theirs.fields.items():
        if key not in header:
            assert ours.get(key) == field.contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.tensor_type, mine.shape, mine.n_elements, mine.n_bytes) == (
            reference.tensor_type, tuple(int(d) for d in reference.shape), reference.n_elements, reference.n_bytes)
        assert mine.data.dtype == reference.data.dtype and mine.data.shape == reference.data.shape
        assert np.array_equal(mine.data, reference.data), mine.name


def test_a_file_that_is_not_gguf_is_a_value_error_naming_it(tmp_path):
    path = tmp_path / "not.gguf"
    path.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        gguf_reader(path)
