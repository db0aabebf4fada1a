"""Paged attention backends behind one interface (see base.py)."""
