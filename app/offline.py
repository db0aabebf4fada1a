"""`kvshare generate` and `kvshare estimate`: offline use of the engine, no HTTP.

Both import the engine runtime (torch) lazily, inside the command.
"""

from __future__ import annotations

import argparse
import sys

from engine.core.intmath import cdiv

# `kvshare generate`'s exit status when the model cannot load (kvshare serve's for the same).
MODEL_LOAD_FAILED_STATUS = 3
_CONTEXT_LENGTHS = (1024, 2048, 4096, 8192, 32768, 131072)
_BATCH_SIZES = (1, 8, 32, 64, 256)


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", required=True, help="user message (or raw text with --raw)")
    parser.add_argument("--system", default=None, help="system message for the chat template")
    parser.add_argument("--raw", action="store_true", help="no chat template: complete the text")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def run_generate(args: argparse.Namespace, engine_config) -> int:
    from engine.core.errors import ParamError
    from engine.core.sampling_params import SamplingParams
    from engine.llm_engine import LLMEngine
    from engine.tokenizer import IncrementalDetokenizer, Tokenizer

    try:
        params = SamplingParams(
            n=args.n,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            stop=tuple(args.stop),
        )
    except ParamError as e:
        print(f"kvshare generate: error: {e.message}", file=sys.stderr)
        return 2
    try:
        engine = LLMEngine(engine_config)
        tokenizer = Tokenizer(engine.model_info.tokenizer_path)
    except Exception as exc:  # the model cannot load: why, on the last line of stderr
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())
        print(f"kvshare generate: error: the model failed to load: {reason}", file=sys.stderr)
        return MODEL_LOAD_FAILED_STATUS
    prompt_ids = _prompt_ids(tokenizer, args)
    try:
        result = engine.generate([prompt_ids], params)[0]  # validates: the offline edge
    except ParamError as e:
        print(f"kvshare generate: error: {e.param}: {e.message}", file=sys.stderr)
        return 2
    if result.error:
        print(f"kvshare generate: error: {result.error}", file=sys.stderr)
        return 1
    for index, token_ids in enumerate(result.token_ids):
        detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, params.stop)
        text = detokenizer.feed(token_ids) + detokenizer.finish()
        if params.n > 1:
            print(f"--- choice {index} ---")
        print(text)
    return 0


def _prompt_ids(tokenizer, args: argparse.Namespace) -> list[int]:
    if args.raw:
        return tokenizer.encode(args.prompt)
    messages = [{"role": "user", "content": args.prompt}]
    if args.system is not None:
        messages.insert(0, {"role": "system", "content": args.system})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def add_estimate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--memory",
        default=None,
        help="KV memory to fill, e.g. 8GiB or 500MB: prints how many blocks and sequences fit",
    )


def run_estimate(args: argparse.Namespace, engine_config) -> int:
    from engine.runtime.loader import _read_hf_config, resolve_max_model_len, resolve_model_dir
    from engine.runtime.model_runner import kv_bytes_per_token

    hf_config = _read_hf_config(resolve_model_dir(engine_config))
    dtype = engine_config.dtype if engine_config.dtype != "auto" else "float32"
    dtype = engine_config.kv_dtype_name(dtype)  # the KV pool's own
    per_token = kv_bytes_per_token(hf_config, dtype)
    max_len = resolve_max_model_len(hf_config, engine_config.max_model_len)
    block_size = engine_config.block_size
    print(f"model: {engine_config.model or 'embedded default'}  dtype: {dtype}")
    print(f"KV bytes per token: {per_token} (2 x layers x kv_heads x head_dim x {dtype} bytes)")
    print(f"KV bytes per block of {block_size} tokens: {per_token * block_size}")
    print(f"context window: {max_len} tokens\n")
    lengths = [n for n in _CONTEXT_LENGTHS if n <= max_len] or [max_len]
    print("| context \\ batch | " + " | ".join(str(b) for b in _BATCH_SIZES) + " |")
    print("|---" * (len(_BATCH_SIZES) + 1) + "|")
    for length in lengths:
        cells = [format_bytes(per_token * length * batch) for batch in _BATCH_SIZES]
        print(f"| {length} | " + " | ".join(cells) + " |")
    if args.memory:
        memory = parse_bytes(args.memory)
        num_blocks = memory // (per_token * block_size)
        per_seq = cdiv(max_len, block_size)
        print(
            f"\n{format_bytes(memory)} holds {num_blocks} blocks = {num_blocks * block_size} "
            f"tokens = {num_blocks // per_seq} sequences at full context ({max_len} tokens)"
        )
    return 0


def parse_bytes(text: str) -> int:
    """'8GiB' -> 8589934592, '500MB' -> 500000000, '1024' -> 1024."""
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
    units |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    stripped = text.strip().lower()
    number = stripped.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = stripped[len(number) :].strip()
    if unit not in units or not number:
        raise ValueError(f"cannot read a size from {text!r} (try 8GiB or 500MB)")
    return int(float(number) * units[unit])


def format_bytes(num_bytes: int) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= size:
            return f"{num_bytes / size:.1f} {unit}"
    return f"{num_bytes} B"
