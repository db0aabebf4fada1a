"""Chat questions: the prompts of the SmolLM2 integration tests (CPU and GPU) and of
benchmarks/spec_decode.py."""

from __future__ import annotations

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "Who wrote Hamlet?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 12?",
    "Give me a synonym for happy.",
    "Describe a cat in five words.",
    "Why is the sky blue? Answer briefly, please, in plain words for a child of six.",
    "Name a planet.",
    "What does CPU stand for?",
    "Suggest a name for a bakery.",
    "How many legs does a spider have?",
    "What colour do you get by mixing blue and yellow?",
    "Tell me a fun fact about octopuses, something most people do not know about them.",
]
