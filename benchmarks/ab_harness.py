"""What benchmarks/ab.py's subcommands share: another tree's kernel library built with this
tree's flags, variants timed in turns, medians, a bit-for-bit check and the tables."""

from __future__ import annotations

import ctypes
import statistics
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

# Sources from before kvshare_native.h define entry points without a prior declaration; this
# tree's check on that changes no generated code, so another tree's build only warns.
OTHER_TREE_FLAGS = ("-Wno-error=missing-declarations",)


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


def seconds_of(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def per_call(fn: Callable[[], object], reps: int) -> float:
    started = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - started) / reps


# --- native-step --------------------------------------------------------------------------------
