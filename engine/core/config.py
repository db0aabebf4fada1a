"""Engine configuration (torch-free): one frozen dataclass, validated once."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from engine.core.errors import ParamError

# The one list of each name a setting may take (app/settings.py and the runtime use these).
TORCH_DTYPES = ("float32", "bfloat16", "float16")  # what a model runs in
DTYPES = ("auto", *TORCH_DTYPES)  # auto: float32 on CPU, bfloat16 on CUDA
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")  # engine/runtime/attention/select.py
# see engine/sched/admission.py; fair-share: engine/sched/fair_share.py (fcfs with one tenant)
SCHEDULING_POLICIES = ("fcfs", "longest-prefix-first", "fair-share")
BLOCK_SIZES = (8, 16, 32, 64, 128)
# none: exact (the oracle for every equality test); native: a GGUF model's blocks as stored
# (Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q6_K kernels, fp32 math); q8_0: Q8_0 blocks made at load; fp16:
# fp16 weights, fp32 math; int8: int8 weights and per-token int8 activations. CPU float32 only
# (engine/runtime/cpu/quant.py).
QUANTIZATIONS = ("none", "native", "q8_0", "fp16", "int8")
# The most max_schema_bytes may allow; app/openai/json_schema.py's check_schema refuses larger
# schemas whatever the setting (a backstop: the routes check the configured cap first,
# app/serving/limits.py).
MAX_SCHEMA_BYTES_CEILING = 1024 * 1024
# config key -> the values it may take
KV_TIERS = ("off", "disk", "host")
ASYNC_SCHEDULING = ("auto", "on", "off")

CHOICES: dict[str, tuple[object, ...]] = {
    "dtype": DTYPES,
    "kv_cache_dtype": DTYPES,
    "device": DEVICES,
    "attention_backend": ATTENTION_BACKENDS,
    "scheduling_policy": SCHEDULING_POLICIES,
    "block_size": BLOCK_SIZES,
    "quantization": QUANTIZATIONS,
    "kv_tier": KV_TIERS,
    "async_scheduling": ASYNC_SCHEDULING,
}


def is_host_local_endpoint(endpoint: str) -> bool:
    """Whether only this host can reach a ZMQ endpoint: ipc:// and inproc://, or tcp:// and
    ws:// on a loopback address (127.0.0.0/8, ::1, localhost, the interface lo). A wildcard
    (*, 0.0.0.0, ::), another address, name or interface, or another transport is not."""
    transport, _, address = endpoint.partition("://")
    if transport in ("ipc", "inproc"):
        return True
    if transport not in ("tcp", "ws"):
        return False
    host = address.rsplit(":", 1)[0].removeprefix("[").removesuffix("]")
    if host in ("localhost", "lo"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a wildcard, a name or an interface
        return False


def _one_of(names: tuple[object, ...]) -> str:
    """('a', 'b', 'c') -> 'must be a, b or c'."""
    *rest, last = (str(name) for name in names)
    return f"must be {', '.join(rest)} or {last}"


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs. Sizes are in tokens/blocks/bytes as their names say."""

    model: str | None = None  # HF dir, hub id (offline cache), .gguf file; None: embedded default
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (auto: fp32 on CPU, bf16 on CUDA)
    device: str = "auto"  # auto | cpu | cuda
    quantization: str = "none"  # none (exact) | native | q8_0 | fp16 | int8 (CPU, float32)
    # The KV pool's dtype: auto | float32 | bfloat16 | float16. Under a float32 model on the
    # CPU, float16 or bfloat16 halve the bytes a token takes and a decode reads (K/V rounded
    # when stored, attention math in fp32). auto: float16 under quantization native or q8_0
    # (block weights, the served approximation), else the model's dtype (exact).
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None  # explicit pool size in blocks; wins over the next two
    kv_cache_bytes: int | None = None  # pool size in bytes (CPU default: 1 GiB)
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of memory for weights + activations + KV
    max_model_len: int | None = None  # None: the model's own context window
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_cache: bool = True
    # Per-namespace (tenant) cap on prefix-tree blocks: over it, a namespace's LRU blocks are
    # evicted before anyone else's (engine/kv/namespace_quota.py). None: plain LRU for all.
    max_cached_blocks_per_namespace: int | None = None
    scheduling_policy: str = (
        "fair-share"  # fair-share (fcfs for 1 tenant) | fcfs | longest-prefix-first
    )
    # fair-share: service per token (engine/sched/fair_share.py FairShareWeights)
    fair_share_prompt_weight: float = 1.0
    fair_share_cached_prompt_weight: float = 0.1
    fair_share_output_weight: float = 2.0
    # fair-share, while two or more tenants are active (a live request, or the last one ended
    # less than fair_share_active_seconds ago): the prefill tokens per step of every tenant
    # but the least-served active one, together (0: no cap; engine/sched/fair_share.py).
    fair_share_prefill_tokens: int = 4
    fair_share_active_seconds: float = 1.0  # 0: only tenants with a live request are active
    attention_backend: str = "auto"  # auto | torch | cpu | triton
    enforce_eager: bool = False  # CUDA: no CUDA graphs
    # Schedule a decode step while the one before it runs (engine/sched/lookahead.py): auto
    # | on | off (auto: on with CUDA, where the host's scheduling then hides behind the GPU;
    # off on the CPU, whose cores run both).
    async_scheduling: str = "auto"
    native_decode: bool = True  # CPU, block weights: decode steps' layers in one native call
    num_threads: int | None = None  # CPU: torch threads (None: torch's default)
    cache_dir: str | None = None  # None: $KVSHARE_CACHE_DIR or ~/.cache/kvshare
    # Shadow audit of the prefix cache (engine/audit/auditor.py): the fraction of cache hits whose
    # prompt is recomputed without the cache and compared, and its cost limits.
    audit_sample_rate: float = 0.01
    audit_max_tokens_per_step: int = 256  # audit tokens per step, within the step's leftover
    audit_max_pending: int = 4  # audits queued at once; more are dropped (counted)
    # Corruption threshold on max|cached - recomputed| / max(1, max|recomputed|), per dtype.
    audit_tolerance_float32: float = 1e-3
    audit_tolerance_bfloat16: float = 0.25
    audit_tolerance_float16: float = 0.1
    audit_tolerance_int8: float = 0.35  # quantization int8 (fp16 keeps float32's)
    # Restored KV (a second-tier load, after a restart too) is audited at its own rate.
    audit_restored_sample_rate: float = 0.1
    # The second KV tier (engine/kv/kv_tier.py, docs/kv-tier.md): prefix blocks the pool evicts
    # move there and come back instead of being recomputed, each load verified. off | disk
    # (files in kv_tier_dir, kept across restarts) | host (host memory; a CUDA worker's tier).
    kv_tier: str = "off"
    kv_tier_dir: str | None = None  # disk: None -> <cache dir>/kv-tier (one server per directory)
    kv_tier_max_bytes: int = 4 << 30  # entries' bytes, least recently used dropped first
    # disk: write the pool's cached blocks to the tier at a graceful stop and index the
    # directory at start (warm restart); false starts with an empty tier.
    kv_tier_warm_restart: bool = True
    enable_fault_injection: bool = False  # drills only: corrupt / mis-map cached blocks
    # KV cache events (engine/kv_event_publisher.py): a ZMQ PUB endpoint to bind, e.g.
    # "tcp://127.0.0.1:5557"; None or "" keeps them off (no socket, no hashing).
    kv_events_endpoint: str | None = None
    kv_events_topic: str = "kvshare"  # the first frame of every message
    kv_events_queue_size: int = 10_000  # event batches (steps) queued for the publisher thread
    # CURVE (set both or neither): the server's certificate with its secret key (a .key_secret
    # file from zmq.auth.create_certificates) and a directory of the public certificates
    # (.key files) of the subscribers it admits; events are encrypted on the wire.
    kv_events_curve_secret_key_file: str | None = None
    kv_events_curve_clients_dir: str | None = None
    # The events carry every tenant's token ids: an endpoint reachable beyond this host needs
    # CURVE unless this opt-out is set (for routers that cannot speak CURVE).
    kv_events_allow_plaintext: bool = False
    # Structured output (engine/runtime/grammar.py): a response_format is compiled into a
    # grammar off the engine thread; slower or larger schemas fail only their request.
    grammar_compile_timeout_seconds: float = 10.0
    # A json_schema's canonical text, in bytes; at most MAX_SCHEMA_BYTES_CEILING.
    max_schema_bytes: int = 64 * 1024
    grammar_cache_size: int = 256  # compiled grammars kept (LRU)
    # Speculative decoding by n-gram prompt lookup (engine/core/spec_ngram.py): up to this many
    # draft tokens per decode step (0: off), found by matching the last min..max tokens
    # earlier in the sequence's own context; exact (the kept tokens are the target's own).
    speculative_ngram_tokens: int = 0
    speculative_ngram_min: int = 2
    speculative_ngram_max: int = 4
    # Draft only in steps where at most this many sequences decode (0: any number). One
    # sequence's decode step reads every weight for one row, so rows of a draft come almost
    # free; in a larger batch each drafted row costs compute the batch already spends.
    speculative_max_decodes: int = 0

    def __post_init__(self) -> None:
        checks = [
            (
                self.num_kv_blocks is None or self.num_kv_blocks >= 1,
                "num_kv_blocks",
                "must be >= 1",
            ),
            (
                self.kv_cache_bytes is None or self.kv_cache_bytes > 0,
                "kv_cache_bytes",
                "must be > 0",
            ),
            (
                0.0 < self.gpu_memory_utilization <= 1.0,
                "gpu_memory_utilization",
                "must be in (0, 1]",
            ),
            (self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1"),
            (
                self.max_cached_blocks_per_namespace is None
                or self.max_cached_blocks_per_namespace >= 1,
                "max_cached_blocks_per_namespace",
                "must be >= 1 (null: no cap)",
            ),
            *(
                (
                    getattr(self, f"fair_share_{kind}_weight") >= 0.0,
                    f"fair_share_{kind}_weight",
                    "must be >= 0",
                )
                for kind in ("prompt", "cached_prompt", "output")
            ),
            (
                self.fair_share_prefill_tokens >= 0,
                "fair_share_prefill_tokens",
                "must be >= 0 (0: no cap)",
            ),
            (self.fair_share_active_seconds >= 0.0, "fair_share_active_seconds", "must be >= 0"),
            (self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1"),
            *(
                (getattr(self, name) in choices, name, _one_of(choices))
                for name, choices in CHOICES.items()
            ),
            (
                self.max_model_len is None or self.max_model_len >= 1,
                "max_model_len",
                "must be >= 1",
            ),
            (0.0 <= self.audit_sample_rate <= 1.0, "audit_sample_rate", "must be in [0, 1]"),
            (
                0.0 <= self.audit_restored_sample_rate <= 1.0,
                "audit_restored_sample_rate",
                "must be in [0, 1]",
            ),
            (self.kv_tier_max_bytes > 0, "kv_tier_max_bytes", "must be > 0"),
            (self.audit_max_tokens_per_step >= 1, "audit_max_tokens_per_step", "must be >= 1"),
            (self.audit_max_pending >= 1, "audit_max_pending", "must be >= 1"),
            *(
                (getattr(self, name) > 0.0, name, "must be > 0")
                for name in (
                    *(f"audit_tolerance_{d}" for d in TORCH_DTYPES),
                    "audit_tolerance_int8",
                )
            ),
            (
                not self.kv_events_endpoint or "://" in self.kv_events_endpoint,
                "kv_events_endpoint",
                "must be a ZMQ endpoint such as tcp://127.0.0.1:5557",
            ),
            (self.kv_events_queue_size >= 1, "kv_events_queue_size", "must be >= 1"),
            *self._kv_events_access_checks(),
            (
                self.grammar_compile_timeout_seconds > 0.0,
                "grammar_compile_timeout_seconds",
                "must be > 0",
            ),
            (
                1 <= self.max_schema_bytes <= MAX_SCHEMA_BYTES_CEILING,
                "max_schema_bytes",
                f"must be within [1, {MAX_SCHEMA_BYTES_CEILING}]",
            ),
            (self.grammar_cache_size >= 1, "grammar_cache_size", "must be >= 1"),
            (self.speculative_ngram_tokens >= 0, "speculative_ngram_tokens", "must be >= 0"),
            (self.speculative_ngram_min >= 1, "speculative_ngram_min", "must be >= 1"),
            (self.speculative_max_decodes >= 0, "speculative_max_decodes", "must be >= 0"),
            (
                self.speculative_ngram_max >= self.speculative_ngram_min,
                "speculative_ngram_max",
                "must be >= speculative_ngram_min",
            ),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise ParamError(name, f"{name} {rule}, got {getattr(self, name)!r}")

    def _kv_events_access_checks(self) -> list[tuple[bool, str, str]]:
        secret_key_file = self.kv_events_curve_secret_key_file
        clients_dir = self.kv_events_curve_clients_dir
        return [
            (
                bool(clients_dir) or not secret_key_file,
                "kv_events_curve_clients_dir",
                "must be set with kv_events_curve_secret_key_file (CURVE needs both)",
            ),
            (
                bool(secret_key_file) or not clients_dir,
                "kv_events_curve_secret_key_file",
                "must be set with kv_events_curve_clients_dir (CURVE needs both)",
            ),
            (
                not secret_key_file or Path(secret_key_file).expanduser().is_file(),
                "kv_events_curve_secret_key_file",
                "must be a certificate file (the .key_secret of zmq.auth.create_certificates)",
            ),
            (
                not clients_dir or Path(clients_dir).expanduser().is_dir(),
                "kv_events_curve_clients_dir",
                "must be a directory of the subscribers' public certificates (.key files)",
            ),
            (
                not self.kv_events_endpoint
                or is_host_local_endpoint(self.kv_events_endpoint)
                or bool(secret_key_file and clients_dir)
                or self.kv_events_allow_plaintext,
                "kv_events_endpoint",
                "is reachable beyond this host and the events carry every tenant's token ids: "
                "set kv_events_curve_secret_key_file and kv_events_curve_clients_dir (CURVE), "
                "bind a loopback or ipc:// endpoint (tcp://127.0.0.1:5557), or set "
                "kv_events_allow_plaintext: true to publish in plain text knowingly",
            ),
        ]

    def kv_dtype_name(self, model_dtype: str) -> str:
        """The KV pool's torch dtype name for a model in model_dtype (kv_cache_dtype resolved:
        auto is float16 under block weights, the model's own dtype otherwise)."""
        if self.kv_cache_dtype != "auto":
            return self.kv_cache_dtype
        return "float16" if self.quantization in ("native", "q8_0") else model_dtype

    def audit_tolerance(self, dtype: str) -> float:
        """The corruption threshold of the audit for a torch dtype name ("float32", ...)."""
        return getattr(self, f"audit_tolerance_{dtype}")

    def cache_root(self) -> Path:
        """Where kvshare keeps what it makes: converted weights, the response store."""
        root = self.cache_dir or os.environ.get("KVSHARE_CACHE_DIR") or "~/.cache/kvshare"
        return Path(root).expanduser()
