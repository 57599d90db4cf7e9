"""Structured outputs in the frontend: the request fields that ask for a constraint
(fields.py), what a chat call's tools and reasoning parser make of it (hooks.py, reasoning.py,
tool_tags.py). Registered by features.py on the request-field hook (request_fields.py)."""
