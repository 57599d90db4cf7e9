"""Running without Docker: the `make run` launcher and the embedded Redis starter (helpers
around the service, not part of it)."""
