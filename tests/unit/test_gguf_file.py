"""One parse of a GGUF file per process (engine.model.gguf_file), read again once the file changes."""

from __future__ import annotations

import os

import numpy as np
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
    assert again.get_field("general.name").contents() == "second, longer"
