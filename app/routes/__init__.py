"""Thin HTTP handlers: parse, call a service from app/serving.py, return what it built."""
