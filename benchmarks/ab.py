r"""In-process A/B benchmarks: two or more variants of the kernels or the engine, timed in turns.

    python benchmarks/ab.py attention --base DIR [--base DIR2] [--batches 1 2 4 8] \
        [--positions 540] [--rounds 31] [--isa native] [--chunks 256:0 256:256 512:0]
    python benchmarks/ab.py block-linear (--base DIR | --amx) [--rows 1 3 8 64 512] \
        [--rounds 9] [--threads 2] [--isa native]
    python benchmarks/ab.py native-step --base DIR [--batches 1 8] [--steps 600] \
        [--prompt-tokens 240] [--different-bits] [--isa native]
    python benchmarks/ab.py greedy-head [--batches 8 4 1] [--steps 300] [--prompt-tokens 300]

On a shared host two runs of the same code differ by more than most kernel changes do. Here the
variants take turns within each round (a round: one call or one decode step of each), so they
see the same host at the same moment; each reports its median over the rounds. Their outputs
are compared bit for bit before any timing. DIR is another tree (a worktree, or `git archive` of
another commit): the library of its own engine/runtime/cpu/*.cpp, built with this tree's
compiler and flags (engine/runtime/cpu/native.py). `ab.py SUBCOMMAND --help` says what each
times. Never part of `make test`.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import inspect
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

# Sources from before kvshare_native.h define entry points without a prior declaration; this
# tree's check on that changes no generated code, so another tree's build only warns.
OTHER_TREE_FLAGS = ("-Wno-error=missing-declarations",)
HEAD_MAX_ROWS = 8  # block-linear: the tied LM head (Q8_0) at decode row counts only


# --- What the subcommands share -----------------------------------------------------------------


def build(tree: Path, target: Path, isa: str, entry_points: tuple[str, ...]) -> ctypes.CDLL:
    """The kernel library of `tree`'s own engine/runtime/cpu/*.cpp, built as native.py builds
    this tree's, each entry point it has typed as kvshare_native.h declares it (an older tree
    lacks the newer ones). Exits when it lacks one of `entry_points`."""
    from engine.runtime.cpu import native

    compiler = native._find_compiler()
    if compiler is None:
        raise SystemExit("needs a C++ compiler (g++)")
    sources = tuple(sorted((tree / "engine/runtime/cpu").glob("*.cpp")))
    if not sources:
        raise SystemExit(f"{tree}: no engine/runtime/cpu/*.cpp there")
    extra_flags = () if tree == REPO else OTHER_TREE_FLAGS
    try:
        native._compile(compiler, isa, target, sources, extra_flags)
    except native.NativeBuildError as exc:
        raise SystemExit(f"{tree}: {exc}") from exc
    library = ctypes.CDLL(str(target))
    missing = [name for name in entry_points if not hasattr(library, name)]
    if missing:
        raise SystemExit(f"{tree}: its kernels lack {', '.join(missing)}; take a newer tree")
    for prototype in native.INTERFACE.prototypes.values():
        if hasattr(library, prototype.name):
            function = getattr(library, prototype.name)
            function.restype, function.argtypes = prototype.restype, list(prototype.argtypes)
    return library


def build_each(
    trees: dict[str, Path], scratch: Path, isa: str, entry_points: tuple[str, ...]
) -> dict[str, ctypes.CDLL]:
    """Each named tree's library (build()), in `scratch`."""
    return {
        name: build(tree.resolve(), scratch / f"build{i}.so", isa, entry_points)
        for i, (name, tree) in enumerate(trees.items())
    }


def interleave(variants: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Each variant's seconds per round (what its call returns), the variants in turn within
    each round."""
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, run in variants.items():
            samples[name].append(run())
    return samples


def medians(samples: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(values) for name, values in samples.items()}


def check_same_bits(outputs: dict, what: str, tolerate: bool = False) -> None:
    """Every output (a tensor, by variant) against the first, bit for bit. A difference ends the
    run, or with `tolerate` is printed (its largest element) and the run goes on."""
    import torch

    (first_name, first), *others = outputs.items()
    for name, out in others:
        if torch.equal(out, first):
            continue
        if not tolerate:
            raise SystemExit(
                f"{what}: {name} differs from {first_name}: the A/B needs the same bits"
            )
        largest = (out.double() - first.double()).abs().max().item()
        print(f"{what}: {name} differs from {first_name} by up to {largest:.3g}")


def print_header(*columns: str) -> None:
    print("| " + " | ".join(columns) + " |\n|" + "---|" * len(columns))


def print_row(*cells: object) -> None:
    print("| " + " | ".join(map(str, cells)) + " |", flush=True)


def _seconds(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def cpu_engine():
    """An engine of config/cpu.yaml, drafting and the audit off."""
    from app.settings import load_settings
    from engine.llm_engine import LLMEngine

    config = load_settings(REPO / "config" / "cpu.yaml", environ={}).to_engine_config()
    return LLMEngine(dataclasses.replace(config, audit_sample_rate=0.0, speculative_ngram_tokens=0))


def decode_in_turns(
    engine, switch, batch: int, steps: int, rng, prompt_tokens: int, tolerate: bool = False
) -> None:
    """`batch` fresh prompts of `prompt_tokens` decoded `steps` steps, switch.use() taking the
    variants in turn step by step (switch: a NativeSwitch or GreedyToggle). Its times are
    cleared first; times[name]["step"] holds each variant's steps after."""
    from profile_step import _is_decode_only

    from engine.core.protocol import EngineRequest
    from engine.core.sampling_params import SamplingParams

    ids = [f"ab-{batch}-{i}-{rng.randrange(10**9)}" for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=steps + 64, ignore_eos=True)
    for request_id in ids:
        prompt = [rng.randrange(1000, 40000) for _ in range(prompt_tokens)]
        engine.add_request(EngineRequest(request_id, prompt, params))
    while not _is_decode_only(engine, batch):  # every prompt prefilled: one token a sequence
        engine.step()
    switch.check_same_bits(engine, tolerate)
    for times in switch.times.values():
        for samples in times.values():
            samples.clear()

    def step_with(name: str) -> float:
        switch.use(name)
        return _seconds(engine.step)

    variants = {name: partial(step_with, name) for name in switch.names}
    for name, samples in interleave(variants, steps // len(variants)).items():
        switch.times[name]["step"] = samples
    for request_id in ids:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()


# --- attention ----------------------------------------------------------------------------------


def attention(args: argparse.Namespace) -> int:
    """Native paged attention of two or more builds, the same KV, from memory.

    SmolLM2's shapes (30 layers, 9 query heads over 3 KV heads of 64, fp16 KV in 16-token blocks),
    the pool on huge pages as the CPU runner allocates it (engine/runtime/cpu/allocator.py), each
    sequence's blocks consecutive. Per batch size, every build (this tree's and each --base's) runs
    the 30 layers' kvshare_paged_decode (2 threads) once per round, each after a sweep of 128 MB (as
    in a step, where the weights have just passed through the caches). Outputs are compared first (a
    difference is printed). Prints, per build, the median over rounds and the KV bytes read over it.
    Then, per --chunks ROWS:CACHED, a prefill chunk of ROWS queries after CACHED cached tokens (each
    row a query at its own position, one sequence's blocks: after the first row, its context is in
    cache), the 30 layers without a sweep."""
    import torch
    from kv_pages import BLOCK, HEAD_DIM, HEADS, KV_HEADS, LAYERS

    from engine.runtime.cpu.allocator import zeros_on_huge_pages

    trees = {"this tree": REPO, **{str(base): base for base in args.base}}
    scratch = Path(tempfile.mkdtemp())
    libraries = build_each(trees, scratch, args.isa, ("kvshare_paged_decode",))
    blocks = -(-args.positions // BLOCK)
    pool = zeros_on_huge_pages(
        (2 * LAYERS, max(args.batches) * blocks, BLOCK, KV_HEADS, HEAD_DIM), torch.float16
    )
    pool.normal_()
    sweep = torch.ones(32 * 1024 * 1024)

    print_header("batch", "build", "ms (30 layers)", "KV GB/s")
    for batch in args.batches:
        tables = torch.arange(batch * blocks, dtype=torch.int32).reshape(batch, blocks).contiguous()
        # Lengths a little apart, as a batch's sequences are.
        seq_lens = torch.tensor(
            [args.positions - 7 * i % 40 for i in range(batch)], dtype=torch.int32
        )
        query = torch.randn(batch, HEADS, HEAD_DIM)
        inputs = (pool, query, [tables] * LAYERS, seq_lens)
        times = _attention_in_turns(libraries, inputs, args.rounds, f"batch {batch}", sweep)
        kv_bytes = 2 * LAYERS * int(seq_lens.sum()) * KV_HEADS * HEAD_DIM * 2
        for name, seconds in times.items():
            print_row(batch, name, f"{1000 * seconds:.3f}", f"{kv_bytes / seconds / 1e9:.1f}")

    if args.chunks:
        print()
        print_header("chunk (rows after cached)", "build", "ms (30 layers)")
    for chunk in args.chunks:
        rows, cached = (int(part) for part in chunk.split(":"))
        blocks = -(-(cached + rows) // BLOCK)
        pool = torch.randn(2 * LAYERS, blocks, BLOCK, KV_HEADS, HEAD_DIM).to(torch.float16)
        tables = torch.arange(blocks, dtype=torch.int32).repeat(rows, 1).contiguous()
        seq_lens = torch.arange(cached + 1, cached + rows + 1, dtype=torch.int32)
        inputs = (pool, torch.randn(rows, HEADS, HEAD_DIM), [tables] * LAYERS, seq_lens)
        times = _attention_in_turns(libraries, inputs, args.rounds, f"chunk {chunk}", None)
        for name, seconds in times.items():
            print_row(f"{rows} after {cached}", name, f"{1000 * seconds:.2f}")
    return 0


def _attention_in_turns(libraries, inputs, rounds: int, label: str, sweep) -> dict[str, float]:
    """Each build's median seconds (each call after a sweep of the caches when `sweep` is
    given); their outputs compared first."""
    import torch
    from kv_pages import run_layers

    outs = {name: torch.empty_like(inputs[1]) for name in libraries}
    for name, library in libraries.items():
        run_layers(library, *inputs, outs[name])
    check_same_bits(outs, label, tolerate=True)

    def call(name: str) -> float:
        if sweep is not None:
            sweep.sum()
        return run_layers(libraries[name], *inputs, outs[name])

    return medians(interleave({name: partial(call, name) for name in libraries}, rounds))


# --- block-linear -------------------------------------------------------------------------------


def block_linear(args: argparse.Namespace) -> int:
    """The block kernels per shape and row count: two builds, interleaved calls.

    native-step compares two builds inside decode steps; prefill chunks and single tensors need a
    finer look. This loads SmolLM2's own tensors from the embedded GGUF (block_kernels.py's) as
    quantization native holds them (panels) and calls kvshare_block_linear from this tree's library
    and then DIR's, round after round, on the same activations. It first checks both give the same
    bits at every row count (layout, tiling and scheduling changes must), then prints each one's
    median time per call and GFLOP/s, and the ratio.

    With --amx the two sides are this tree's one library with its panels on AMX tiles and on the
    FMAs (the paths of prompt and of generated tokens on such a CPU; amx_panels.cpp), switched
    before each call. Those sum in different orders, so each is checked against F.linear on the
    dequantized weights instead (fp64, within 1e-5 of sum |x w|)."""
    import torch
    from block_kernels import HEAD, smollm2_block_weights

    from engine.core.config import EngineConfig
    from engine.runtime.cpu.block_linear import to_panels

    torch.set_num_threads(args.threads)
    weights = smollm2_block_weights(EngineConfig())
    entry_points = ("kvshare_block_linear_rows", *(("kvshare_panel_amx",) if args.amx else ()))
    with tempfile.TemporaryDirectory() as scratch:
        trees = {"this tree": REPO} if args.amx else {"this tree": REPO, "base": args.base}
        libraries = build_each(trees, Path(scratch), args.isa, entry_points)
        this = libraries["this tree"]
        if args.amx:
            if not this.kvshare_panel_amx(1):
                print("no AMX here (the CPU lacks amx_bf16, or Linux refused the tile state)")
                return 1
            sides = {"AMX": (this, 1), "FMA": (this, 0)}  # side -> (library, its AMX switch)
        else:
            sides = {name: (library, None) for name, library in libraries.items()}
        first, second = sides
        print(f"threads {args.threads}, build level {args.isa}, {args.rounds} interleaved rounds")
        print_header("tensor", "rows", f"{first} us (GFLOP/s)", f"{second} us (GFLOP/s)",
                     f"{second} / {first}")  # fmt: skip
        for name, stored in weights.items():
            rows = [r for r in args.rows if name != HEAD or r <= HEAD_MAX_ROWS]
            _block_linear_rows(args, name == HEAD, name, stored, to_panels(stored), sides, rows)
        if args.amx:
            this.kvshare_panel_amx(0)
    return 0


def _block_linear_rows(args, is_head: bool, name: str, stored, weight, sides, row_counts) -> None:
    """One tensor's table rows: per row count, the sides checked, then timed in turns."""
    import torch
    import torch.nn.functional as F

    from engine.runtime.cpu.block_linear import BlockLinear

    reference = stored.dequantize().double() if args.amx else None
    calls = {}
    for key, (library, amx) in sides.items():
        module = BlockLinear(weight, None, library)

        def call(x, module=module, library=library, amx=amx):
            if amx is not None:
                library.kvshare_panel_amx(amx)
            return module(x)

        calls[key] = call
    for rows in row_counts:
        x = torch.randn(rows, weight.in_features, generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            outs = {key: call(x) for key, call in calls.items()}
            if reference is None:
                check_same_bits(outs, f"{name} at {rows} rows")
            else:
                expected = F.linear(x.double(), reference)
                bound = F.linear(x.double().abs(), reference.abs()) * 1e-5 + 1e-12
                for key, out in outs.items():
                    if not ((out.double() - expected).abs() <= bound).all():
                        raise SystemExit(f"{key} is off F.linear on {name}, {rows} rows")
            reps = 20 if is_head else max(1, 2000 // rows)
            variants = {key: partial(_per_call, partial(c, x), reps) for key, c in calls.items()}
            a, b = medians(interleave(variants, args.rounds)).values()
        flops = 2 * rows * weight.in_features * weight.out_features
        print_row(name, rows, f"{1e6 * a:.1f} ({flops / a / 1e9:.0f})",
                  f"{1e6 * b:.1f} ({flops / b / 1e9:.0f})", f"{b / a:.2f}x")  # fmt: skip


def _per_call(fn: Callable[[], object], reps: int) -> float:
    started = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - started) / reps


# --- native-step --------------------------------------------------------------------------------


class NativeSwitch:
    """Points the engine's native step and LM head at one library or another, and times them."""

    def __init__(self, model, libraries: dict[str, ctypes.CDLL]) -> None:
        self.step = model.native_decode
        self.head, self.head_entry = _step_head(model)
        if self.step is None or not hasattr(self.head, "_run"):
            raise SystemExit("needs quantization native (a native decode step and a block head)")
        self.libraries = libraries
        self.names = list(libraries)
        self.times = {name: {"step": [], "layers": [], "head": []} for name in libraries}
        self.current = self.names[0]

    def use(self, name: str) -> None:
        self.current = name
        library = self.libraries[name]
        self.step._run = self._timed(library.kvshare_decode_layers, "layers")
        self.head._run = self._timed(getattr(library, self.head_entry), "head")

    def _timed(self, fn, bucket: str):
        def timed(*args):
            started = time.perf_counter()
            status = fn(*args)
            self.times[self.current][bucket].append(time.perf_counter() - started)
            return status

        return timed

    def check_same_bits(self, engine, tolerate: bool) -> None:
        """One decode step's layers, then one head call, through each library on the same
        inputs."""
        layers, heads = {}, {}
        run = self.step.run

        def through_each(hidden, *args):
            start = hidden.clone()
            for name in self.names:
                hidden.copy_(start)
                self.use(name)
                layers[name] = run(hidden, *args).clone()
            return layers[name]

        self.step.run = through_each
        try:
            engine.step()
        finally:
            del self.step.run
        for name in self.names:
            self.use(name)
            heads[name] = self.head(layers[self.names[0]])
        check_same_bits(layers, "layers", tolerate)
        check_same_bits(heads, "head", tolerate)


def _step_head(model):
    """The head the engine's greedy steps here call, and its entry point: GreedyHead where the
    model has one, else the block head."""
    if model.greedy_head is not None:
        return model.greedy_head, "kvshare_greedy_head"
    return model.lm_head, "kvshare_block_linear_rows"


def native_step(args: argparse.Namespace) -> int:
    """The native CPU kernels of two builds: one engine, alternate decode steps.

    One engine (this tree's Python, config/cpu.yaml, drafting off, ~240-token prompts) decodes; its
    native layer stack (kvshare_decode_layers) and its LM head are called, step by step in turn,
    from this tree's library and from DIR's. It prints, per library, the median step, layer stack
    and head; and the weight bytes a step reads over its median step, against the read bandwidth
    measured in the same process before and after.

    Both builds must compute the same bits (as layout, tiling and scheduling changes do: the kernel
    tests hold them to it), since the KV cache is written by whichever ran the step; one decode step
    and one head call are checked first. --different-bits times builds whose sums run in another
    order (an attention split, say): it prints the largest difference and goes on, and the KV then
    holds whichever build's rounding wrote it."""
    import torch
    from profile_step import read_bandwidth_gbs, weight_bytes

    engine = cpu_engine()
    model = engine.runner.model
    entry_points = ("kvshare_decode_layers", _step_head(model)[1])
    with tempfile.TemporaryDirectory() as scratch:
        trees = {"this tree": REPO, f"base ({args.base})": args.base}
        switch = NativeSwitch(model, build_each(trees, Path(scratch), args.isa, entry_points))
        weights = weight_bytes(model)
        step_mb = (weights["layers"] + weights["head"]) / 1e6
        bandwidth = [read_bandwidth_gbs(torch)]
        rng = random.Random(0)
        results = []
        for batch in args.batches:
            decode_in_turns(
                engine, switch, batch, args.steps, rng, args.prompt_tokens, args.different_bits
            )
            for name, times in switch.times.items():
                step_medians = {part: 1000 * v for part, v in medians(times).items()}
                results.append((batch, name, step_medians, len(times["step"])))
        bandwidth.append(read_bandwidth_gbs(torch))
    read = statistics.mean(bandwidth)
    print(f"read bandwidth {bandwidth[0]:.1f} GB/s before, {bandwidth[1]:.1f} after")
    print_header("batch", "kernels", "steps", "step ms", "layers ms", "head ms",
                 "weights GB/s (of read)")  # fmt: skip
    for batch, name, ms, count in results:
        gbs = step_mb / ms["step"]
        print_row(batch, name, count, f"{ms['step']:.2f}", f"{ms['layers']:.2f}",
                  f"{ms['head']:.2f}", f"{gbs:.1f} ({gbs / read:.0%})")  # fmt: skip
    return 0


# --- greedy-head --------------------------------------------------------------------------------


class GreedyToggle:
    """The model's greedy_head on ("greedy head") or off ("full head"); each step's _sample
    timed too."""

    def __init__(self, runner, head) -> None:
        self.model, self.head = runner.model, head
        self.names = ["greedy head", "full head"]
        self.current = self.names[0]
        self.times = {name: {"step": [], "sample": []} for name in self.names}
        sample = runner._sample

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return sample(*args, **kwargs)
            finally:
                self.times[self.current]["sample"].append(time.perf_counter() - started)

        runner._sample = timed

    def use(self, name: str) -> None:
        self.current = name
        self.model.greedy_head = self.head if name == "greedy head" else None

    def check_same_bits(self, engine, tolerate: bool) -> None:
        """Random hidden rows through both: the same tokens."""
        import torch

        hidden = torch.randn(8, self.model.spec.hidden_size)
        full = self.model.compute_logits(hidden).argmax(dim=-1)
        check_same_bits({"greedy head": self.head(hidden), "full head": full}, "tokens", tolerate)


def greedy_head(args: argparse.Namespace) -> int:
    """Greedy decoding with and without GreedyHead: one engine, alternate steps.

    Under quantization native a greedy row's token can come from GreedyHead (greedy_head.cpp:
    integer estimates of every logit, then the few panels that can hold the largest computed
    exactly) instead of the full Q8_0 LM head and an argmax. One engine (config/cpu.yaml, drafting
    and the audit off) decodes `batch` greedy sequences of ~`prompt-tokens`; step by step in turn
    its model's greedy_head is the GreedyHead or None (the full head). It prints per batch size and
    variant the median step and the median time of ModelRunner._sample (the head with the argmax or
    the greedy head, and the sampler's Python). It first checks that both give the same tokens on
    random hidden rows. Where the kernels' estimate lacks VNNI (kvshare_greedy_head_fast() is 0) the
    product leaves GreedyHead off; this then times the plain loops and says so."""
    from engine.runtime.cpu.block_linear import GreedyHead
    from engine.runtime.cpu.native import load_library
    from engine.runtime.loader import kvshare_cache_dir

    engine = cpu_engine()
    model = engine.runner.model
    head = model.greedy_head
    if head is None:
        head = GreedyHead(model.lm_head, load_library(kvshare_cache_dir(engine.config) / "kernels"))
        print("this build's estimate has no VNNI: timing the plain loops the product leaves off")
    toggle = GreedyToggle(engine.runner, head)
    rng = random.Random(0)
    print_header("batch", "variant", "steps", "step ms", "_sample ms")
    for batch in args.batches:
        decode_in_turns(engine, toggle, batch, args.steps, rng, args.prompt_tokens)
        for name, times in toggle.times.items():
            ms = {part: 1000 * v for part, v in medians(times).items()}
            print_row(batch, name, len(times["step"]), f"{ms['step']:.2f}", f"{ms['sample']:.2f}")
    return 0


# --- the command line ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name: str, run) -> argparse.ArgumentParser:
        sub = commands.add_parser(
            name,
            help=run.__doc__.split("\n")[0],
            description=inspect.cleandoc(run.__doc__),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        sub.set_defaults(run=run)
        return sub

    isa = {"default": "native", "help": "the kernels' build level"}
    sub = command("attention", attention)
    sub.add_argument("--base", type=Path, action="append", required=True, help="another tree")
    sub.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    sub.add_argument("--positions", type=int, default=540, help="context of each sequence")
    sub.add_argument("--rounds", type=int, default=31)
    sub.add_argument("--isa", **isa)
    sub.add_argument("--chunks", nargs="*", default=[], help="prefill chunks, ROWS:CACHED")

    sub = command("block-linear", block_linear)
    sides = sub.add_mutually_exclusive_group(required=True)
    sides.add_argument("--base", type=Path, help="the other tree")
    sides.add_argument("--amx", action="store_true", help="this tree's AMX tiles against its FMAs")
    sub.add_argument("--rows", type=int, nargs="+", default=[1, 3, 8, 64, 512])
    sub.add_argument("--rounds", type=int, default=9)
    sub.add_argument("--threads", type=int, default=2)
    sub.add_argument("--isa", **isa)

    sub = command("native-step", native_step)
    sub.add_argument("--base", type=Path, required=True, help="the other tree")
    sub.add_argument("--batches", type=int, nargs="+", default=[1])
    sub.add_argument("--steps", type=int, default=600, help="decode steps per batch size")
    sub.add_argument("--isa", **isa)
    sub.add_argument("--prompt-tokens", type=int, default=240, help="each prompt's length")
    sub.add_argument(
        "--different-bits",
        action="store_true",
        help="time builds whose outputs differ (a changed summation order): print the difference",
    )

    sub = command("greedy-head", greedy_head)
    sub.add_argument("--batches", type=int, nargs="+", default=[8, 4, 1])
    sub.add_argument("--steps", type=int, default=300, help="decode steps per batch size")
    sub.add_argument("--prompt-tokens", type=int, default=300)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
