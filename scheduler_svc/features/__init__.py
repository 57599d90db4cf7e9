"""Optional features of the scheduler, one folder each, registering on the hook points of
``base.py`` (connect, scheduling budget, validate/submit, step message, apply reply,
persist/recover, metrics); ``registry.py`` builds the engine's set once from its configuration,
``flags.py`` gathers the command-line flags features declare in their folders. The request path
iterates hooks and names no feature. Which folder holds what, and the hooks each uses:
docs/internals.md, "Features".

This file imports nothing (importing a feature's module must not import the others)."""
