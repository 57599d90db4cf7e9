"""Tool calling for the chat route: tools and tool_choice (protocol.py, models.py), the JSON
Schemas that hold a model to its calls (schema.py, enforced by the scheduler as structured
outputs; the request's own structured-output fields are frontend_svc/structured_output.py), and
the parsers that find tool calls in a model's text, whole or streamed (parsers/, stream.py)."""
