"""The independent reference for model outputs: HF transformers `generate` on the same weights."""

from __future__ import annotations

import torch


def random_prompt(length: int, seed: int = 0) -> list[int]:
    """Token ids in [3, 256) for the tiny random test models (ids 0-2 are their specials)."""
    return torch.randint(3, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int, **generate_kwargs) -> list[int]:
    """HF generate, greedy, never stopping early (EOS ignored): the generated token ids."""
    device = hf_model.device
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([prompt], device=device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            **generate_kwargs,
        )
    sequences = out.sequences if hasattr(out, "sequences") else out
    return sequences[0, len(prompt) :].tolist()


def chat_prompt_ids(tokenizer, question: str) -> list[int]:
    """The chat-templated prompt of one user question, as HF's tokenizer builds it."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
