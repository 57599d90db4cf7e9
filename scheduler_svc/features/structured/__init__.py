"""Structured outputs (issue 26): the scheduler keeps one grammar matcher per constrained
sequence and sends each step's allowed-token masks; the executor only applies them.

`spec` turns a request's `structured_output` into grammar text and checks its size, `compiler`
compiles and caches grammars (llguidance), `bitmask` packs mask rows for the wire, `matchers`
owns the matchers and builds a step's masks, `structured` is the engine's one seam (validate,
add a step's masks, grammar complete?). Nothing here imports torch. Path and design:
docs/internals.md, "A constrained request's path".
"""
