"""Thin HTTP handlers: parse, call a service from app/serving/, return what it built."""
