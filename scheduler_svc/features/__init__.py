"""Optional features of the scheduler, one folder each, registering on the hook points of
``base.py`` (validate/submit, step message, apply reply, persist/recover); ``registry.py`` builds
the engine's set once from its configuration. The request path iterates hooks and names no
feature. Which folder holds what, and the hooks each uses: docs/internals.md, "Features".

This file imports nothing (importing a feature's module must not import the others)."""
