"""Optional features of the executor, a folder each, on the hooks of ``base.py``; ``registry.py``
builds the list a runner uses from its configuration."""
