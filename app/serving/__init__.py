"""The engine side every API shares: a request's record and prepared form (records.py), the
per-request and per-tenant limits (limits.py, tenant_load.py), engine outputs as choice
deltas (choices.py), and OpenAIServing (service.py), which admits a prepared request into
the engine and hands the route finished chunks or a finished body."""
