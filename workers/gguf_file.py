"""The tensors of a GGUF file, found without parsing its metadata.

gguf-py's GGUFReader builds an object for every metadata value, the 49k
strings of the default model's vocabulary included: about 2 s per worker.
The loader needs only the tensor index (name, shape, type, offset) and the
alignment, so this reads the header, steps over the metadata by its lengths
and maps the data (copy-on-write: writable arrays, nothing read ahead).
Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (version 2 and 3).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

# GGUF value type -> size in bytes of its fixed-size values (8: string, 9: array).
_VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]
    """torch's order (GGUF lists dimensions the other way round)."""
    gguf_type: int
    data: np.ndarray
    """The file's bytes of the tensor, uint8."""


def read_gguf_tensors(path: str) -> list[GGUFTensor]:
    with open(path, "rb") as file:
        magic, version = file.read(4), _read(file, "<I")
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"{path} is not a GGUF file of version 2 or 3 (magic {magic!r}, version {version})")
        tensor_count, metadata_count = _read(file, "<Q"), _read(file, "<Q")
        alignment = DEFAULT_ALIGNMENT
        for _ in range(metadata_count):
            key, value_type = _read_string(file), _read(file, "<I")
            if key == "general.alignment" and value_type == _UINT32:
                alignment = _read(file, "<I")
            else:
                _skip_value(file, value_type)
        index = []
        for _ in range(tensor_count):
            name, num_dims = _read_string(file), _read(file, "<I")
            dims = struct.unpack(f"<{num_dims}Q", file.read(8 * num_dims))
            index.append((name, tuple(reversed(dims)), _read(file, "<I"), _read(file, "<Q")))
        data_start = -(-file.tell() // alignment) * alignment
    mapped = np.memmap(path, dtype=np.uint8, mode="c")
    return [GGUFTensor(name, shape, gguf_type, _tensor_bytes(mapped, data_start + offset, shape, gguf_type))
            for name, shape, gguf_type, offset in index]


def _tensor_bytes(mapped: np.ndarray, start: int, shape: tuple[int, ...], gguf_type: int) -> np.ndarray:
    import gguf  # the table of block sizes

    block_size, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(gguf_type)]
    rows, columns = int(np.prod(shape[:-1])), shape[-1]
    return mapped[start : start + rows * columns // block_size * block_bytes].reshape(rows, -1)


def _read(file: BinaryIO, fmt: str) -> int:
    return struct.unpack(fmt, file.read(struct.calcsize(fmt)))[0]


def _read_string(file: BinaryIO) -> str:
    return file.read(_read(file, "<Q")).decode("utf-8")


def _skip_value(file: BinaryIO, value_type: int) -> None:
    if value_type == _STRING:
        file.seek(_read(file, "<Q"), 1)
    elif value_type == _ARRAY:
        element_type, count = _read(file, "<I"), _read(file, "<Q")
        if element_type in _VALUE_SIZES:
            file.seek(count * _VALUE_SIZES[element_type], 1)
        else:
            for _ in range(count):
                _skip_value(file, element_type)
    else:
        file.seek(_VALUE_SIZES[value_type], 1)
