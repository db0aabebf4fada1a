"""The bytes of one entry of the second KV tier (torch-free): one cached block's KV, all layers,
with what it is the KV of and a checksum over everything.

Layout, little-endian:
    magic      8 bytes  b"KVSTIER\\x01" (the last byte is FORMAT_VERSION)
    head_len   4 bytes  length of the JSON head
    head       JSON     {"fingerprint", "namespace", "token_ids", "payload_len"}
    payload    the block's KV exactly as the runner reads it out of the pool
    checksum   4 bytes  CRC-32 of everything before it

The head carries the block's whole token path from position 0 to its end and its namespace, so
an entry describes itself: the index is rebuilt from the heads alone after a restart, and a load
checks that the entry holds the tokens and namespace the index expects (a file of another
namespace put in its place is refused, not served). The fingerprint (engine_fingerprint())
names the model, tokenizer, block size, KV dtype and layout and the compute mode: an entry
written under any other one is ignored.

CRC-32 detects every burst error up to 32 bits and any single flipped bit; it is a check against
disks and torn writes, not against someone who may write the tier directory (that directory is
as trusted as the model files).
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

FORMAT_VERSION = 1
MAGIC = b"KVSTIER" + bytes([FORMAT_VERSION])
_LEN = struct.Struct("<I")
_PREFIX_LEN = len(MAGIC) + _LEN.size
HEAD_PREFIX_LEN = _PREFIX_LEN  # magic and head length: what head_length() reads


class EntryError(ValueError):
    """An entry whose bytes are not a valid entry (bad magic, length, checksum or head)."""


@dataclass(frozen=True)
class EntryHead:
    fingerprint: str
    namespace: tuple[str, ...]
    token_ids: tuple[int, ...]  # from position 0 to the end of the block
    payload_len: int


def namespace_key(namespace: Hashable) -> tuple[str, ...]:
    """A namespace as the tier stores it: a tuple of strings (make_namespace gives one)."""
    if isinstance(namespace, tuple) and all(isinstance(part, str) for part in namespace):
        return namespace
    return (repr(namespace),)


def entry_key(namespace: Hashable, token_ids: Sequence[int]) -> str:
    """The name of the entry for a block: a digest of its namespace and token path. Equal
    names never stand for equality: a load compares the head's tokens and namespace."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(json.dumps(namespace_key(namespace)).encode())
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return digest.hexdigest()


def encode_entry(head: EntryHead, payload: bytes) -> bytes:
    assert head.payload_len == len(payload)
    head_bytes = json.dumps(
        {
            "fingerprint": head.fingerprint,
            "namespace": list(head.namespace),
            "token_ids": list(head.token_ids),
            "payload_len": head.payload_len,
        },
        separators=(",", ":"),
    ).encode()
    body = b"".join((MAGIC, _LEN.pack(len(head_bytes)), head_bytes, payload))
    return body + _LEN.pack(zlib.crc32(body))


def decode_head(data: bytes) -> tuple[EntryHead, int]:
    """The head of an entry's leading bytes (at least up to the end of the head) and the
    offset where its payload starts; EntryError if they are not an entry's of this format."""
    if len(data) < _PREFIX_LEN or data[: len(MAGIC)] != MAGIC:
        raise EntryError("not a kvshare tier entry of this format version")
    (head_len,) = _LEN.unpack_from(data, len(MAGIC))
    end = _PREFIX_LEN + head_len
    if len(data) < end:
        raise EntryError("truncated head")
    try:
        raw = json.loads(data[_PREFIX_LEN:end])
        head = EntryHead(
            str(raw["fingerprint"]),
            tuple(str(part) for part in raw["namespace"]),
            tuple(int(token) for token in raw["token_ids"]),
            int(raw["payload_len"]),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise EntryError(f"unreadable head: {exc}") from exc
    return head, end


def head_length(data: bytes) -> int:
    """Bytes to read to get the whole head, from an entry's first HEAD_PREFIX_LEN bytes."""
    if len(data) < _PREFIX_LEN or data[: len(MAGIC)] != MAGIC:
        raise EntryError("not a kvshare tier entry of this format version")
    return _PREFIX_LEN + _LEN.unpack_from(data, len(MAGIC))[0]


def decode_entry(data: bytes) -> tuple[EntryHead, bytes]:
    """Head and payload of a whole entry, its checksum verified; EntryError otherwise."""
    if len(data) < _PREFIX_LEN + _LEN.size:
        raise EntryError("truncated entry")
    (checksum,) = _LEN.unpack_from(data, len(data) - _LEN.size)
    body = memoryview(data)[: len(data) - _LEN.size]
    if zlib.crc32(body) != checksum:
        raise EntryError("checksum mismatch")
    head, start = decode_head(data)
    if start + head.payload_len != len(body):
        raise EntryError("payload length does not match the head")
    return head, bytes(body[start:])


def entry_size_bound(num_tokens: int, payload_len: int) -> int:
    """About the most bytes an entry of num_tokens tokens takes (a token id: at most 20 bytes of
    JSON with its comma; the rest of the head: 512, enough beside a namespace of short names)."""
    return _PREFIX_LEN + 512 + 20 * num_tokens + payload_len + _LEN.size


def engine_fingerprint(fields: Mapping[str, object]) -> str:
    """A digest of what the KV in an entry depends on (weights, tokenizer, block size, KV dtype
    and layout, compute mode) and of this format's version."""
    text = json.dumps({"format": FORMAT_VERSION, **fields}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]
