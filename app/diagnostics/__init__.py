"""What the server tells about its cache: a request's cache diagnostics (cache.py), the
operator's cache report (cache_report.py) and the chat template's check (template_check.py)."""
