"""Model registry: HF architecture names -> our paged implementations."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from engine.core.errors import KVShareError
from engine.runtime.models.gemma3 import Gemma3ForCausalLM
from engine.runtime.models.llama import LlamaForCausalLM

_REGISTRY: dict[str, type[nn.Module]] = {
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


class UnsupportedArchitectureError(KVShareError):
    """The checkpoint's architecture has no implementation here; the message lists ours."""


def supported_architectures() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def _registered(architectures: Sequence[str] | None) -> type[nn.Module] | None:
    """Our class for the first supported name in an HF config's `architectures`, or None."""
    return next((_REGISTRY[n] for n in architectures or () if n in _REGISTRY), None)


def get_model_class(architectures: Sequence[str] | None) -> type[nn.Module]:
    """The class for the first supported name in an HF config's `architectures` list."""
    found = _registered(architectures)
    if found is not None:
        return found
    named = ", ".join(architectures or ()) or "(none listed in config.json)"
    raise UnsupportedArchitectureError(
        f"unsupported model architecture {named}; supported: {', '.join(supported_architectures())}"
    )


def implements_sliding_window(architectures: Sequence[str] | None) -> bool:
    """Whether our class for these architectures attends within a sliding window itself (the
    others keep the context at the window, where full attention is exact)."""
    return bool(getattr(_registered(architectures), "implements_sliding_window", False))


def turn_end_tokens(architectures: Sequence[str] | None) -> tuple[str, ...]:
    """Tokens that end a chat turn besides EOS for these architectures (the engine stops on
    them): Gemma's <end_of_turn>; none for the others."""
    return tuple(getattr(_registered(architectures), "turn_end_tokens", ()))
