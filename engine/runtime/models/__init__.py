"""Model registry: HF architecture names -> our paged implementations."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from engine.core.errors import KVShareError
from engine.runtime.models.llama import LlamaForCausalLM

_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


class UnsupportedArchitectureError(KVShareError):
    """The checkpoint's architecture has no implementation here; the message lists ours."""


def supported_architectures() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def get_model_class(architectures: Sequence[str] | None) -> type[nn.Module]:
    """The class for the first supported name in an HF config's `architectures` list."""
    for name in architectures or ():
        if name in _REGISTRY:
            return _REGISTRY[name]
    named = ", ".join(architectures or ()) or "(none listed in config.json)"
    raise UnsupportedArchitectureError(
        f"unsupported model architecture {named}; supported: {', '.join(supported_architectures())}"
    )
