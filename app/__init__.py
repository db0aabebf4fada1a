"""kvshare's HTTP front end: an OpenAI-compatible FastAPI app over an EngineClient.

Nothing in app/ imports torch; app/cli.py builds the real engine lazily.
"""
