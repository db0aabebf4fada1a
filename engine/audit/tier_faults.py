"""Fault drills on the second KV tier: damage an entry where it is stored, so that its
verification on load can be seen to catch it (engine/kv/kv_tier.py). Refused unless the engine
runs with enable_fault_injection, like the pool drills (engine/audit/faults.py).

Each drill rewrites the most recently used tier entry through the tier's store:
  tier_bit_flip           one bit of the payload flipped (the checksum no longer matches);
  tier_truncate           the entry cut to half its bytes (a torn write);
  tier_foreign_namespace  a valid entry of the same tokens under another namespace (another
                          tenant's file put in its place);
  tier_foreign_model      a valid entry written under another fingerprint (another model's).
The index is not told: the next load of that entry must refuse it, count it and compute the
prompt instead.
"""

from __future__ import annotations

from dataclasses import replace

from engine.core.errors import InvalidFaultTarget
from engine.core.protocol import FaultReport
from engine.kv.kv_tier import KVTier
from engine.kv.tier_format import decode_entry, encode_entry

TIER_FAULT_KINDS = (
    "tier_bit_flip",
    "tier_truncate",
    "tier_foreign_namespace",
    "tier_foreign_model",
)


def inject_tier_fault(tier: KVTier | None, kind: str) -> FaultReport:
    if tier is None:
        raise InvalidFaultTarget("the second KV tier is off: no entry to damage")
    key = tier.most_recent_key()
    data = tier.store.get(key) if key is not None else None
    if key is None or data is None:
        raise InvalidFaultTarget("the KV tier holds no entry")
    head, payload = decode_entry(data)
    if kind == "tier_bit_flip":
        damaged = bytearray(data)
        damaged[len(data) - 4 - len(payload) // 2] ^= 0x01
        data = bytes(damaged)
    elif kind == "tier_truncate":
        data = data[: len(data) // 2]
    elif kind == "tier_foreign_namespace":
        data = encode_entry(
            replace(head, namespace=(*head.namespace[:-1], "another-tenant")), payload
        )
    else:
        data = encode_entry(replace(head, fingerprint="another-model"), payload)
    tier.store.put(key, data)
    tier.flush()
    detail = f"{kind}: tier entry {key} ({len(head.token_ids)} tokens from position 0)"
    return FaultReport(kind, [], detail)
