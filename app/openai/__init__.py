"""OpenAI's chat and completions APIs: the request models and their checks, the response
models and how deltas become them, tool calls and structured outputs, the token routes'
work, and a request's preparation (prepare.py: template, tokenize, resolve, once)."""
