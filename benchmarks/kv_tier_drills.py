"""benchmarks/kv_tier.py's drills: tier entries corrupted on disk are detected and never served.

Prompts are computed on a disk tier engine, pushed out of its pool into the tier, and one entry
of each (its block DRILL_BLOCK, so the blocks before it still load) is corrupted in place: a
payload bit flipped, the file truncated, another namespace's entry (cache_salt) copied over it,
or the entry re-encoded under another engine fingerprint (engine/kv/tier_format.py). The
prompt is then sent again; its greedy output is compared with a tier-off engine's. The same
after a restart (close(), a new engine on the directory), where unreadable, misnamed and
foreign entries are removed at start (num_tier_ignored_at_start), and a restart under another
kv_cache_dtype (every entry foreign). A control prompt of each phase is left intact: its
verification must find nothing. Exact mode (quantization none): a tier hit's greedy tokens
against a miss's.
"""

from __future__ import annotations

import math
import random
import tempfile
from collections.abc import Callable
from pathlib import Path

from benchmarks.kv_tier_engine import (
    build_engine,
    push_out,
    random_prompt,
    running_engine,
    serve,
    served_config,
)
from engine.core.sequence import make_namespace
from engine.kv.tier_format import EntryHead, decode_entry, decode_head, encode_entry, entry_key
from engine.kv.tier_store import SUFFIX

DRILL_BLOCK = 2  # the block whose entry is corrupted
OTHER_SALT = "kv-tier-drill-other"  # the other namespace
FOREIGN_FINGERPRINT = "f" * 32  # another model's (any other digest)
MAX_TOKENS = 32  # greedy tokens compared with the reference
CONTROL = "none (control)"


def flip_payload_bit(path: Path, other: Path) -> None:
    """Bit 14 of a float16 in the middle of the payload: its exponent's top bit."""
    data = bytearray(path.read_bytes())
    head, start = decode_head(bytes(data))
    offset = start + (head.payload_len // 2 & ~1)
    data[offset + 1] ^= 0x40
    path.write_bytes(bytes(data))


def truncate_payload(path: Path, other: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def truncate_head(path: Path, other: Path) -> None:
    path.write_bytes(path.read_bytes()[:10])


def other_namespace(path: Path, other: Path) -> None:
    """The same token path's entry of another namespace (cache_salt) under this name."""
    path.write_bytes(other.read_bytes())


def foreign_fingerprint(path: Path, other: Path) -> None:
    """The same entry, valid, as written under another engine fingerprint."""
    head, payload = decode_entry(path.read_bytes())
    foreign = EntryHead(FOREIGN_FINGERPRINT, head.namespace, head.token_ids, head.payload_len)
    path.write_bytes(encode_entry(foreign, payload))


Corruption = Callable[[Path, Path], None]
# name: (corruption, what should see it)
LIVE: dict[str, tuple[Corruption, str]] = {
    "payload bit flipped": (flip_payload_bit, "checksum"),
    "file truncated to half": (truncate_payload, "checksum"),
    "another namespace's entry copied over it": (other_namespace, "refused (namespace)"),
    "written under another model fingerprint": (foreign_fingerprint, "refused (fingerprint)"),
}
AT_RESTART: dict[str, tuple[Corruption, str]] = {
    "payload bit flipped": (flip_payload_bit, "checksum, at load"),
    "file truncated in its head": (truncate_head, "ignored at start (unreadable)"),
    "another namespace's entry copied over it": (other_namespace, "ignored at start (misnamed)"),
    "written under another model fingerprint": (foreign_fingerprint, "ignored at start"),
}


class DrillSite:
    """The tier directory of one engine and its drill prompts (prompt + suffix requests)."""

    def __init__(self, tier_dir: str, weights_version: str, prompts: dict, suffix: list[int]):
        self.tier_dir = Path(tier_dir)
        self.weights_version = weights_version
        self.prompts = prompts  # (phase, name) -> token ids
        self.suffix = suffix
        self.block_size = served_config().block_size

    def entry(self, key: tuple[str, str], salt: str | None = None) -> Path:
        path = self.prompts[key][: (DRILL_BLOCK + 1) * self.block_size]
        name = entry_key(make_namespace(self.weights_version, None, salt), path)
        return self.tier_dir / f"{name}{SUFFIX}"

    def corrupt(self, phase: str, drills: dict[str, tuple[Corruption, str]]) -> None:
        for name, (corruption, _) in drills.items():
            path = self.entry((phase, name))
            assert path.is_file(), f"{phase} / {name}: no entry to corrupt at {path}"
            corruption(path, self.entry((phase, name), OTHER_SALT))

    def load(self, engine, phase: str, name: str, seen_by: str, expected: list[int]) -> dict:
        """Send the drilled prompt again: what verification found, what came from the tier."""
        removed = seen_by.startswith("ignored") and not self.entry((phase, name)).exists()
        served = serve(engine, self.prompts[(phase, name)] + self.suffix, MAX_TOKENS)
        return {
            "phase": phase,
            "corruption": name,
            "seen_by": seen_by,
            "detected": served.num_detected + removed,
            "tier_tokens": served.num_tier_hit_tokens,
            "pool_tokens": served.num_hit_tokens - served.num_tier_hit_tokens,
            "equal": served.output_ids == expected,
        }


def run_drills(args) -> dict:
    block_size = served_config().block_size
    rng = random.Random(args.seed + 1)
    prompts = {
        (phase, name): random_prompt(rng, args.drill_prompt_tokens)
        for phase, drills in (("live", LIVE), ("restart", AT_RESTART))
        for name in (*drills, CONTROL)
    }
    suffix = random_prompt(rng, 8)
    request_blocks = math.ceil((args.drill_prompt_tokens + len(suffix) + MAX_TOKENS) / block_size)
    expected = reference_outputs(prompts, suffix, 4 * request_blocks * len(prompts))
    pool = 4 * request_blocks
    with tempfile.TemporaryDirectory(prefix="kvshare-tier-") as tier_dir:
        engine = build_engine("disk", pool, tier_dir)
        site = DrillSite(tier_dir, engine.model_info.weights_version, prompts, suffix)
        fill(engine, site, rng, pool)
        site.corrupt("live", LIVE)
        rows = [site.load(engine, "live", n, s, expected[("live", n)]) for n, s in _drills(LIVE)]
        engine.close()
        site.corrupt("restart", AT_RESTART)
        engine = build_engine("disk", pool, tier_dir)
        ignored = engine.stats().num_tier_ignored_at_start
        engine.kv_tier.flush()  # the removals at start are on disk
        rows += [
            site.load(engine, "restart", n, s, expected[("restart", n)])
            for n, s in _drills(AT_RESTART)
        ]
        engine.close()
        other_dtype = restart_foreign_dtype(site, pool, rng)
    return {
        "drill_block": DRILL_BLOCK,
        "num_kv_blocks": pool,
        "rows": rows,
        "ignored_at_start": ignored,
        "other_kv_dtype": other_dtype,
        "exact_mode": exact_mode(args, rng),
    }


def _drills(drills: dict[str, tuple[Corruption, str]]) -> list[tuple[str, str]]:
    return [*((name, seen_by) for name, (_, seen_by) in drills.items()), (CONTROL, "-")]


def reference_outputs(prompts: dict, suffix: list[int], pool: int) -> dict:
    with running_engine("off", pool) as engine:
        return {key: serve(engine, p + suffix, MAX_TOKENS).output_ids for key, p in prompts.items()}


def fill(engine, site: DrillSite, rng: random.Random, pool: int) -> None:
    """Every drill prompt (and the other namespace's copies) computed, then only in the tier."""
    tail = random_prompt(rng, 4)  # the prompts' full blocks hold only their own tokens
    for key, prompt in site.prompts.items():
        serve(engine, prompt + tail, max_tokens=0)
        if "namespace" in key[1]:
            serve(engine, prompt + tail, max_tokens=0, cache_salt=OTHER_SALT)
    push_out(engine, (pool + 1) * site.block_size, pool * site.block_size // 3, rng)
    engine.kv_tier.flush()


def restart_foreign_dtype(site: DrillSite, pool: int, rng: random.Random) -> dict:
    """A restart under another kv_cache_dtype: the fingerprint differs, every entry is
    foreign (removed at start); a control prompt is computed, nothing loaded."""
    num_files = len(list(site.tier_dir.glob(f"*{SUFFIX}")))
    engine = build_engine("disk", pool, str(site.tier_dir), kv_cache_dtype="float32")
    try:
        ignored = engine.stats().num_tier_ignored_at_start
        served = serve(engine, site.prompts[("live", CONTROL)] + site.suffix, MAX_TOKENS)
    finally:
        engine.close()
    return {"num_files": num_files, "ignored": ignored, "tier_tokens": served.num_tier_hit_tokens}


def exact_mode(args, rng: random.Random) -> dict:
    """quantization none: a prompt loaded from the tier, and the same prompt computed."""
    block_size = served_config().block_size
    prompt = random_prompt(rng, 2 * args.drill_prompt_tokens)
    tail, suffix = random_prompt(rng, 4), random_prompt(rng, 8)
    pool = 2 * math.ceil((len(prompt) + len(suffix) + MAX_TOKENS) / block_size)
    with running_engine("off", pool, quantization="none") as engine:
        miss = serve(engine, prompt + suffix, MAX_TOKENS)
    with running_engine("disk", pool, quantization="none") as engine:
        serve(engine, prompt + tail, max_tokens=0)
        push_out(engine, (pool + 1) * block_size, pool * block_size // 3, rng)
        hit = serve(engine, prompt + suffix, MAX_TOKENS)
    return {
        "num_prompt_tokens": len(prompt + suffix),
        "tier_tokens": hit.num_tier_hit_tokens,
        "miss_hit_tokens": miss.num_hit_tokens,
        "num_output_tokens": len(hit.output_ids),
        "equal": hit.output_ids == miss.output_ids,
    }


def format_drills(result: dict) -> str:
    rows = result["rows"]
    lines = [
        f"### Drills: one entry of each prompt corrupted (block {result['drill_block']})",
        "",
        "| phase | corruption | seen by | detected | tokens from the tier / pool | "
        f"greedy output = tier off ({MAX_TOKENS} tokens) |",
        "| --- | --- | --- | ---: | ---: | --- |",
    ]
    for row in rows:
        lines.append(
            f"| {row['phase']} | {row['corruption']} | {row['seen_by']} | {row['detected']} | "
            f"{row['tier_tokens']} / {row['pool_tokens']} | {'yes' if row['equal'] else 'NO'} |"
        )
    drilled = [row for row in rows if row["corruption"] != CONTROL]
    controls = [row for row in rows if row["corruption"] == CONTROL]
    dtype, exact = result["other_kv_dtype"], result["exact_mode"]
    lines += [
        "",
        f"Detected {sum(r['detected'] for r in drilled)} of {len(drilled)} corrupted entries "
        f"(num_tier_ignored_at_start at the restart: {result['ignored_at_start']}); served bad "
        f"(output differs from tier off): {sum(not r['equal'] for r in rows)}; false alarms on "
        f"the controls: {sum(r['detected'] for r in controls)}. A restart under "
        f"kv_cache_dtype float32: {dtype['ignored']} of {dtype['num_files']} entries ignored at "
        f"start, {dtype['tier_tokens']} tokens loaded.",
        f"Exact mode (quantization none): {exact['tier_tokens']} of "
        f"{exact['num_prompt_tokens']} prompt tokens from the tier; greedy tokens "
        f"{'equal' if exact['equal'] else 'DIFFER'} to a miss's ({exact['num_output_tokens']}).",
    ]
    return "\n".join(lines)
