"""A GGUF file's header, parsed once: its metadata and tensor table, with transformers' fast
reader (gguf-py's GGUFReader walks a large vocabulary one numpy view at a time: 11.6 s on Gemma
3 270M's 262,144 tokens, against 0.5 s here). The GGUF conversion (engine/runtime/gguf_convert.py)
and the block reader (gguf_blocks.py) both start from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

_DEFAULT_ALIGNMENT = 32  # bytes, where the file does not set general.alignment


@dataclass(frozen=True)
class GgufTensor:
    name: str
    shape: tuple[int, ...]  # torch order, slowest axis first
    ggml_type: int
    offset: int  # bytes from the start of the data section


@dataclass(frozen=True)
class GgufHeader:
    metadata: dict[str, Any]  # string arrays (the vocabulary) are left as their length
    tensors: tuple[GgufTensor, ...]
    data_start: int  # byte offset of the data section in the file

    @property
    def architecture(self) -> str:
        return self.metadata["general.architecture"]


def read_header(gguf_path: Path) -> GgufHeader | None:
    """The file's metadata and tensor table; None where the fast reader cannot parse it (the
    callers then hand the file to gguf-py or transformers, which say what is wrong with it)."""
    try:
        # transformers' own header reader, used below its GgufHeader, which refuses some ggml
        # types (Q5_0) the legacy loader dequantises. Private: a transformers without it (or
        # with other signatures) lands here too, and its public conversion runs instead.
        from transformers.integrations.gguf.reader import (
            _mapped,
            _read_metadata,
            _read_tensor_table,
        )

        blob = _mapped(str(gguf_path))
        metadata, num_tensors, position = _read_metadata(blob, str(gguf_path))
        entries, position = _read_tensor_table(blob, num_tensors, position)
    except Exception:  # not a GGUF it parses: transformers' conversion says what is wrong
        return None
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    data_start = (position + alignment - 1) // alignment * alignment
    return GgufHeader(metadata, tuple(GgufTensor(*entry) for entry in entries), data_start)
