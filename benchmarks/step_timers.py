"""The step profile's timing hooks: wrappers that add each call's time to its bucket
(benchmarks/profile_step.py). Nothing in the engine changes; calls nested inside a timed
call count for the outer one only.
"""

from __future__ import annotations

import functools
import importlib
import time
from collections.abc import Callable

BUCKETS = (
    "projections", "attention", "elementwise", "native layers", "LM head", "sampling", "scheduling"
)  # fmt: skip
# (module, attribute path, bucket): what the hooks wrap; a missing one is skipped (older trees).
HOOKS = (
    ("engine.runtime.cpu.linear", "PackedLinear.forward", "projections"),
    ("torch.nn", "Linear.forward", "projections"),
    # Newer trees: GGUF blocks computed as stored (quantization native / q8_0), fp16 on fbgemm.
    ("engine.runtime.cpu.block_linear", "BlockLinear.forward", "projections"),
    ("engine.runtime.cpu.quant", "Fp16Linear.forward", "projections"),
    ("engine.runtime.cpu.block_linear", "BlockEmbedding.forward", "elementwise"),
    ("engine.runtime.models.llama", "RMSNorm.forward", "elementwise"),
    ("engine.runtime.models.llama", "LlamaAttention._rope", "elementwise"),
    ("engine.runtime.models.llama", "RotaryEmbedding.lookup", "elementwise"),
    ("engine.runtime.cpu.fused", "CpuFusedOps.rms_norm", "elementwise"),
    ("engine.runtime.cpu.fused", "CpuFusedOps.silu_mul", "elementwise"),
    ("engine.runtime.cpu.fused", "CpuFusedOps.rope", "elementwise"),
    ("engine.runtime.cpu.fused", "CpuFusedOps.add_rms_norm", "elementwise"),
    # Newer trees: rope on q and k fused into the KV store, counted with the store.
    ("engine.runtime.cpu.fused", "CpuFusedOps.rope_store", "attention"),
    ("torch.nn", "Embedding.forward", "elementwise"),
    ("engine.runtime.models.llama", "LlamaForCausalLM.compute_logits", "LM head"),
    # Newer trees: greedy rows' tokens from GreedyHead, without all the logits.
    ("engine.runtime.models.llama", "LlamaForCausalLM.greedy_tokens", "LM head"),
    # Newer trees: a step's whole layer stack in one native call (decode_step.cpp).
    ("engine.runtime.cpu.decode_step", "NativeDecodeStep.run", "native layers"),
    ("engine.runtime.sampler", "Sampler.__call__", "sampling"),
    ("engine.sched.scheduler", "Scheduler.schedule", "scheduling"),
    ("engine.sched.scheduler", "Scheduler.update_from_output", "scheduling"),
)
ATTENTION_METHODS = ("store_kv", "forward")


class Timers:
    """Time per bucket by `clock`; a call made while another timed call runs is not timed again."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock  # the profile's clock: wall time, or a thread's CPU time
        self.enabled = False
        self.busy = False
        self.seconds = dict.fromkeys(BUCKETS, 0.0)
        self.num_calls = 0

    def wrap(self, fn, bucket: str):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if not self.enabled or self.busy:
                return fn(*args, **kwargs)
            self.busy = True
            started = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[bucket] += self.clock() - started
                self.num_calls += 1
                self.busy = False

        return timed

    def reset(self) -> None:
        self.seconds = dict.fromkeys(BUCKETS, 0.0)
        self.num_calls = 0

    def cost_per_call(self) -> float:
        """Seconds a wrapper adds to one call (measured on a no-op)."""
        noop = self.wrap(lambda: None, "sampling")
        plain = lambda: None  # noqa: E731
        self.enabled, n = True, 20000
        started = self.clock()
        for _ in range(n):
            noop()
        wrapped = self.clock() - started
        started = self.clock()
        for _ in range(n):
            plain()
        self.enabled = False
        self.reset()
        return max(0.0, (wrapped - (self.clock() - started)) / n)


def install_hooks(timers: Timers, engine) -> list[str]:
    """Wrap every HOOKS entry that exists (class attributes) and the engine's attention backend
    (instance attributes); returns what was wrapped."""
    wrapped = []
    for module_name, path, bucket in HOOKS:
        owner_name, attr = path.split(".")
        owner = getattr(importlib.import_module(module_name), owner_name, None)
        if owner is None or attr not in vars(owner):
            continue
        setattr(owner, attr, timers.wrap(vars(owner)[attr], bucket))
        wrapped.append(f"{module_name}.{path}")
    backend = engine.runner.attn_backend
    for name in ATTENTION_METHODS:
        if hasattr(backend, name):
            setattr(backend, name, timers.wrap(getattr(backend, name), "attention"))
            wrapped.append(f"attn_backend.{name}")
    return wrapped
