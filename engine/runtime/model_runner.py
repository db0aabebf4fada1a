"""Owns the model and the paged KV tensors; turns a SchedulerOutput into sampled tokens."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.core.batch import (
    BlockCopy,
    ModelRunnerOutput,
    SampleSpec,
    ScheduledSeq,
    SchedulerOutput,
)
from engine.core.config import EngineConfig
from engine.core.errors import ParamError
from engine.core.intmath import cdiv
from engine.core.protocol import ModelInfo
from engine.core.sampling_params import SamplingParams
from engine.runtime.attention.select import get_attention_backend
from engine.runtime.block_io import read_blocks, write_blocks
from engine.runtime.cpu.allocator import keep_temporaries_on_heap, zeros_on_huge_pages
from engine.runtime.cpu.block_linear import BlockLinear
from engine.runtime.cpu.capabilities import cpu_capabilities
from engine.runtime.cpu.decode_step import NativeDecodeStep
from engine.runtime.cpu.fused import CpuFusedOps
from engine.runtime.cpu.linear import can_pack
from engine.runtime.cuda_graph_runner import CudaGraphRunner, graphs_disabled_reason
from engine.runtime.grammar import GrammarMatchers
from engine.runtime.loader import kvshare_cache_dir, load_model
from engine.runtime.models.llama import LlamaSpec
from engine.runtime.prompt_logprobs import score_prompt_rows
from engine.runtime.sampler import Sampler
from engine.runtime.step_inputs import prepare_inputs
from engine.runtime.transfer import split_to_device

logger = logging.getLogger(__name__)

_CPU_DEFAULT_KV_BYTES = 1 << 30
_GIB = float(1 << 30)


@dataclass
class LaunchedStep:
    """A step whose device work is queued (ModelRunner.launch). token_ids: its sampled rows'
    tokens on the device, row i for the i-th sampled row, where every row draws one token
    (else None); result() waits for them on the host and returns the step's output."""

    token_ids: torch.Tensor | None
    result: Callable[[], ModelRunnerOutput]

    def adding(self, **fields: Any) -> LaunchedStep:
        """This step, with `fields` (found at launch) set on its output when it is read."""
        finish = self.result

        def result() -> ModelRunnerOutput:
            output = finish()
            for name, value in fields.items():
                setattr(output, name, value)
            return output

        return LaunchedStep(self.token_ids, result)


def kv_bytes_per_token(hf_config: Any, dtype: torch.dtype | str) -> int:
    """KV bytes one token takes across all layers: 2 (K and V) * layers * Hkv * D * itemsize."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    spec = LlamaSpec.from_hf_config(hf_config)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * itemsize


def resolve_device(name: str) -> torch.device:
    """auto -> cuda when available, else cpu."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was requested but torch sees no CUDA device")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto -> float32 on CPU, bfloat16 on CUDA; otherwise the named torch dtype."""
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return getattr(torch, name)


class ModelRunner:
    """Loads the model, allocates the KV pool, and runs one step at a time.

    Public attributes: device, dtype, model, hf_config, max_model_len, block_size,
    bytes_per_block, num_kv_blocks, kv_caches (per layer (k, v), each
    [num_kv_blocks, block_size, Hkv, D]), attn_backend, sampler, model_info, graph_runner
    (CUDA graphs for decode-only steps; None on the CPU, with enforce_eager or torch attention),
    grammar_matchers (structured output: the engine registers each constrained request's
    compiled grammar; execute() releases the requests the scheduler reports finished).

    For the cache auditor: capture_prompt_logits(seq_id) keeps the logits row a sequence gets
    at its last prompt token (its first sample) for take_prompt_logits(); run_audit() runs a
    shadow forward into private blocks.
    kv_caches are never reallocated after start-up: CUDA graphs hold their pointers.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self._load_model()
        # Prompt tokens marked for the block kernels' prompt path where the projections are GGUF
        # blocks (capabilities.py, prompt_rows; the kernels pick AMX tiles, the prefill GEMM or
        # the FMAs per format and build: kvshare_prompt_path).
        self.tile_prompts = (
            self.device.type == "cpu"
            and cpu_capabilities().prompt_rows
            and any(isinstance(m, BlockLinear) for m in self.model.modules())
        )
        if self.device.type == "cpu":  # after loading: weights keep their own mappings
            keep_temporaries_on_heap()
        self.attn_backend = get_attention_backend(
            config.attention_backend, self.device, kvshare_cache_dir(config) / "kernels"
        )
        fused_ops = None
        if self.attn_backend.name == "cpu":  # its library also has the fused elementwise ops
            library = self.attn_backend.library
            fused_ops = CpuFusedOps(library)
            self.model.use_fused_ops(fused_ops)
            if config.native_decode and hasattr(self.model, "use_native_decode"):
                self.model.use_native_decode(NativeDecodeStep.for_model(self.model, library))
        elif self.attn_backend.name == "triton":  # one launch per norm, gate and rope + store
            from engine.runtime.attention.triton_fused import TritonFusedOps

            self.model.use_fused_ops(TritonFusedOps())
        self.grammar_matchers = GrammarMatchers(self.model_info.vocab_size)
        self.sampler = Sampler(
            self.model_info.eos_token_ids,
            self.grammar_matchers,
            argmax=fused_ops.argmax if fused_ops is not None else None,
        )
        self._capture_seq_ids: set[int] = set()  # the auditor's (the warm-up samples too)
        self._prompt_logits: dict[int, torch.Tensor] = {}
        self.block_size = config.block_size
        self.kv_dtype = self._resolve_kv_dtype()
        self.bytes_per_block = self.block_size * kv_bytes_per_token(self.hf_config, self.kv_dtype)
        self.graph_runner: CudaGraphRunner | None = None  # the sizing warm-up runs eagerly
        self.num_kv_blocks = self._size_kv_pool()
        self.kv_caches = self._allocate_kv_caches(self.num_kv_blocks)
        self._log_capacity()
        self.graph_runner = self._capture_cuda_graphs()  # needs the final pool: graphs keep it

    def execute(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        """Read the second tier's spills, write its loads, apply copy-on-write copies (in that
        order: engine/core/batch.py), then run the forward over the batch and sample its last
        tokens; score the prompt positions of the chunks that ask (prompt_logprobs.py)."""
        return self.launch(sched_out).result()

    def launch(
        self, sched_out: SchedulerOutput, previous: LaunchedStep | None = None
    ) -> LaunchedStep:
        """execute() with the host's wait for the sampled tokens left to result(): on CUDA the
        step's work is queued, so the next one (a lookahead step, whose previous_token_rows
        read `previous`'s tokens on the device) can be scheduled and queued behind it."""
        self.grammar_matchers.release(sched_out.finished_request_ids)
        spilled = read_blocks(self.kv_caches, [spill.block_id for spill in sched_out.block_spills])
        write_blocks(self.kv_caches, sched_out.block_loads)
        if sched_out.block_copies:
            self._copy_blocks(sched_out.block_copies)
        return self._run(sched_out, previous).adding(spilled_kv=spilled)

    def _run(self, sched_out: SchedulerOutput, previous: LaunchedStep | None) -> LaunchedStep:
        if sched_out.is_empty:
            return LaunchedStep(None, ModelRunnerOutput)
        self._check_seqs(sched_out.seqs)
        with torch.inference_mode():
            tokens = self._previous_tokens(sched_out, previous)
            if self.graph_runner is not None and self.graph_runner.can_replay(sched_out):
                return self._launch_graph(sched_out, tokens)
            inputs = prepare_inputs(sched_out, self.device, self.tile_prompts)
            if tokens is not None:  # lookahead decodes come first, one token each
                inputs.input_ids[: tokens.shape[0]].copy_(tokens)
            meta = inputs.meta
            # Only the sampled rows' hidden states are read unless prompt positions are
            # scored: the model may then skip the rest past the last K/V store.
            scores_prompts = any(seq.prompt_logprobs is not None for seq in sched_out.seqs)
            rows = None if scores_prompts else inputs.logits_indices
            hidden = self.model(
                inputs.input_ids, inputs.positions, meta, self.kv_caches, self.attn_backend,
                output_rows=rows,
            )  # fmt: skip
            sampled = hidden if rows is not None else hidden[inputs.logits_indices]  # [S, E]
            launched = self._sample(sampled, inputs.sample_seq_ids, inputs.sample_specs)
            if not scores_prompts:
                return launched
            prompt_logprobs = score_prompt_rows(  # hidden [T, E]: every row
                self.model.compute_logits, hidden, sched_out.seqs, meta.query_start_loc_host
            )
            return launched.adding(prompt_logprobs=prompt_logprobs)

    def _previous_tokens(
        self, sched_out: SchedulerOutput, previous: LaunchedStep | None
    ) -> torch.Tensor | None:
        """A lookahead step's input tokens, on the device: [num lookahead rows] int64."""
        rows = sched_out.previous_token_rows
        if rows is None:
            return None
        if previous is None or previous.token_ids is None:
            raise ValueError("a lookahead step needs the step before it, with one token per row")
        (index,) = split_to_device([rows], self.device)
        return previous.token_ids.index_select(0, index)

    def _sample(
        self,
        hidden: torch.Tensor,
        seq_ids: list[int],
        specs: list[SampleSpec],
        head: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> LaunchedStep:
        """hidden [S, E]: the last-token rows of the sampled sequences, in seq_ids order;
        head: their logits [S, V] and argmax [S] where a CUDA graph computed them."""
        if not specs:
            return LaunchedStep(None, ModelRunnerOutput)
        drawn = None
        if not self._capture_seq_ids:
            # Greedy rows need no logits: the model may find the argmax from fewer of them.
            greedy = (lambda: head[1]) if head is not None else None
            drawn = self.sampler.draw_by_argmax(
                specs, greedy or (lambda: self.model.greedy_tokens(hidden))
            )
        if drawn is None:
            logits = head[0] if head is not None else self.model.compute_logits(hidden)  # [S, V]
            if self._capture_seq_ids:
                self._capture_logits(logits, seq_ids, specs)
            drawn = self.sampler.draw(logits, specs)
        one_each = all(len(spec.seeds) == 1 for spec in specs)  # token_ids row i = spec i
        finish = drawn.result

        def result() -> ModelRunnerOutput:
            output = ModelRunnerOutput()
            for seq_id, tokens in zip(seq_ids, finish(), strict=True):
                output.sampled.setdefault(seq_id, []).extend(tokens)  # a draft's rows, in order
            return output

        return LaunchedStep(drawn.token_ids if one_each else None, result)

    # -- cache audit --------------------------------------------------------------------------
    def capture_prompt_logits(self, seq_id: int) -> None:
        """Keep the logits row seq_id gets when it samples its first output token."""
        self._capture_seq_ids.add(seq_id)

    def take_prompt_logits(self, seq_id: int) -> torch.Tensor | None:
        """The captured row ([V] float32), or None if not captured yet; stops the capture
        once it has been returned."""
        logits = self._prompt_logits.pop(seq_id, None)
        if logits is not None:
            self._capture_seq_ids.discard(seq_id)
        return logits

    def stop_capture(self, seq_id: int) -> None:
        self._capture_seq_ids.discard(seq_id)
        self._prompt_logits.pop(seq_id, None)

    def _capture_logits(
        self, logits: torch.Tensor, seq_ids: list[int], specs: list[SampleSpec]
    ) -> None:
        """logits: [S, V]; a copy of each captured row, before the sampler sees it."""
        for row, (seq_id, spec) in enumerate(zip(seq_ids, specs, strict=True)):
            if seq_id in self._capture_seq_ids and spec.output_index == 0:
                self._prompt_logits[seq_id] = logits[row].float().clone()

    def run_audit(
        self, sched_out: SchedulerOutput, logits_seq_ids: set[int]
    ) -> dict[int, torch.Tensor]:
        """Run prefill chunks into the auditor's private blocks (eagerly, never a graph, no
        sampling); return the last-token logits row ([V] float32) of each chunk whose
        seq_id is in logits_seq_ids."""
        self._check_seqs(sched_out.seqs)
        inputs = prepare_inputs(sched_out, self.device, self.tile_prompts)
        ends = inputs.meta.query_start_loc_host[1:]
        wanted = [i for i, seq in enumerate(sched_out.seqs) if seq.seq_id in logits_seq_ids]
        (rows,) = split_to_device([[ends[i] - 1 for i in wanted]], self.device)
        with torch.inference_mode():
            hidden = self.model(
                inputs.input_ids,
                inputs.positions,
                inputs.meta,
                self.kv_caches,
                self.attn_backend,
                output_rows=rows,
            )  # [W, E]: the wanted chunks' last rows
            if not wanted:
                return {}
            logits = self.model.compute_logits(hidden)  # [W, V]
            return {sched_out.seqs[i].seq_id: logits[j].float() for j, i in enumerate(wanted)}

    # -- CUDA graphs (runtime/cuda_graph_runner.py): decode-only steps replay a captured graph --
    def _launch_graph(
        self, sched_out: SchedulerOutput, tokens: torch.Tensor | None
    ) -> LaunchedStep:
        """tokens: a lookahead step's input tokens on the device (its rows come first)."""
        seqs = sched_out.seqs
        rows = [i for i, seq in enumerate(seqs) if seq.sample is not None]
        seq_ids, specs = [seqs[i].seq_id for i in rows], [seqs[i].sample for i in rows]
        hidden = self.graph_runner.replay(sched_out, tokens)  # [B, E], row i = sequence i
        head = self.graph_runner.head_outputs(len(seqs))  # the graph's logits and argmax
        if len(rows) < len(seqs):
            index = split_to_device([rows], self.device)[0]
            hidden = hidden[index]  # [S, E]
            head = None if head is None else (head[0][index], head[1][index])
        return self._sample(hidden, seq_ids, specs, head)

    def _capture_cuda_graphs(self) -> CudaGraphRunner | None:
        reason = graphs_disabled_reason(
            self.config.enforce_eager, self.device, self.attn_backend.name
        )
        if reason is not None:
            if self.device.type == "cuda":
                logger.info("CUDA graphs off: %s; every step runs eagerly", reason)
            return None
        graph_runner = CudaGraphRunner(
            self.model, self.kv_caches, self.attn_backend,
            block_size=self.block_size, max_model_len=self.max_model_len,
            max_num_seqs=self.config.max_num_seqs,
        )  # fmt: skip
        graph_runner.capture()
        return graph_runner

    # -- end CUDA graphs ---------------------------------------------------------------------

    def _check_seqs(self, seqs: list[ScheduledSeq]) -> None:
        for seq in seqs:
            if seq.context_len > self.max_model_len:
                raise ValueError(
                    f"sequence {seq.seq_id} reaches {seq.context_len} tokens, "
                    f"past max_model_len {self.max_model_len}"
                )
            if len(seq.block_ids) * self.block_size < seq.context_len:
                raise ValueError(
                    f"sequence {seq.seq_id} has {len(seq.block_ids)} blocks "
                    f"for {seq.context_len} tokens"
                )

    def _load_model(self) -> None:
        loaded = load_model(self.config, self.device, self.dtype)
        self.model = loaded.model
        if can_pack(self.device, self.dtype) and self.config.quantization in ("none", "native"):
            # oneDNN with packed weights: faster CPU matmuls (for the layers native left as
            # they were loaded: all of them for a model that is not GGUF blocks)
            self.model.pack_for_cpu()
        self.hf_config = loaded.hf_config
        self.max_model_len = loaded.max_model_len
        self.model_info = ModelInfo(
            name=loaded.name,
            tokenizer_path=loaded.tokenizer_path,
            max_model_len=loaded.max_model_len,
            vocab_size=loaded.vocab_size,
            eos_token_ids=loaded.eos_token_ids,
            weights_version=loaded.weights_version,
        )

    def _size_kv_pool(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.config.kv_cache_bytes is not None:
            budget = self.config.kv_cache_bytes
        elif self.device.type == "cpu":
            budget = _CPU_DEFAULT_KV_BYTES
        else:
            budget = self._cuda_kv_budget()
        num_blocks = int(budget // self.bytes_per_block)
        if num_blocks < 1:
            raise ValueError(
                f"the KV budget ({budget} bytes) holds no block of {self.bytes_per_block} bytes"
            )
        return num_blocks

    def _cuda_kv_budget(self) -> int:
        """Bytes for KV: utilisation * total memory, minus what is in use, minus activation peak."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        baseline = torch.cuda.memory_allocated(self.device)
        num_tokens = min(self.config.max_num_batched_tokens, self.max_model_len)
        self._warm_up(num_tokens)
        activation_peak = torch.cuda.max_memory_allocated(self.device) - baseline
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        budget = total * self.config.gpu_memory_utilization - (total - free) - activation_peak
        logger.info(
            "CUDA memory: %.2f GiB total, %.2f GiB in use after loading and warm-up, "
            "%.2f GiB activation peak; gpu_memory_utilization %.2f leaves %.2f GiB for KV",
            total / _GIB,
            (total - free) / _GIB,
            activation_peak / _GIB,
            self.config.gpu_memory_utilization,
            max(0.0, budget) / _GIB,
        )
        return max(0, int(budget))

    def _warm_up(self, num_tokens: int) -> None:
        """One dummy prefill of num_tokens through a temporary pool (measures the peak).

        The peak must cover the longest attention and sampling a full batch: one sequence
        takes all tokens but one per further sequence, up to max_num_seqs sequences, and
        every one samples with top-p (the sampler's largest path: it sorts the vocabulary).
        Each sequence owns contiguous blocks, so its slots are consecutive.
        """
        num_seqs = min(self.config.max_num_seqs, num_tokens)
        params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=1)
        seqs, num_blocks = [], 0
        for i in range(num_seqs):
            length = num_tokens - (num_seqs - 1) if i == 0 else 1
            block_ids = list(range(num_blocks, num_blocks + cdiv(length, self.block_size)))
            spec = SampleSpec(params, [i], output_index=0, prompt_token_ids=[], output_token_ids=[])
            seqs.append(ScheduledSeq(i, [0] * length, 0, block_ids, sample=spec))
            num_blocks += len(block_ids)
        slots = [s.block_ids[0] * self.block_size + p for s in seqs for p in range(s.num_tokens)]
        self.kv_caches = self._allocate_kv_caches(num_blocks)
        self.execute(SchedulerOutput(seqs=seqs, slot_mapping=slots))
        del self.kv_caches

    def _resolve_kv_dtype(self) -> torch.dtype:
        """The KV pool's dtype (EngineConfig.kv_dtype_name): one other than the model's only
        where the attention backend stores and reads it (the CPU ones; Triton keeps the
        model's)."""
        model_dtype = str(self.dtype).removeprefix("torch.")
        name = self.config.kv_dtype_name(model_dtype)
        kv_dtype = getattr(torch, name)
        if kv_dtype != self.dtype and self.attn_backend.name not in ("cpu", "torch"):
            raise ParamError(
                "kv_cache_dtype",
                f"kv_cache_dtype {name} differs from the model's dtype {model_dtype}, which the "
                f"{self.attn_backend.name} attention backend does not support; use auto",
            )
        return kv_dtype

    def _allocate_kv_caches(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        spec = LlamaSpec.from_hf_config(self.hf_config)
        shape = (num_blocks, self.block_size, spec.num_kv_heads, spec.head_dim)
        if self.device.type == "cpu":  # one slab on huge pages, each layer's K and V a slice
            slab = zeros_on_huge_pages((2 * spec.num_layers, *shape), self.kv_dtype)
            return [(slab[2 * i], slab[2 * i + 1]) for i in range(spec.num_layers)]
        return [
            (
                torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
                torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
            )
            for _ in range(spec.num_layers)
        ]

    def _copy_blocks(self, copies: list[BlockCopy]) -> None:
        src, dst = split_to_device([[c.src for c in copies], [c.dst for c in copies]], self.device)
        self.attn_backend.copy_blocks(self.kv_caches, src, dst)

    def _log_capacity(self) -> None:
        num_tokens = self.num_kv_blocks * self.block_size
        full_context_seqs = num_tokens // self.max_model_len
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB, %s on %s); "
            "%d sequences fit at full context (%d tokens); attention backend %s",
            self.num_kv_blocks,
            self.block_size,
            num_tokens,
            self.num_kv_blocks * self.bytes_per_block / _GIB,
            str(self.kv_dtype).removeprefix("torch."),
            self.device,
            full_context_seqs,
            self.max_model_len,
            self.attn_backend.name,
        )
        if full_context_seqs < 1:
            logger.warning("the KV pool holds fewer tokens than one full-context sequence")
