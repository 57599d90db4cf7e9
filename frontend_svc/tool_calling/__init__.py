"""Tool calling for the chat route: tools and tool_choice (protocol.py, models.py), the JSON
Schemas that hold a model to its calls (schema.py, which the scheduler enforces as any
constraint of a request's output), and
the parsers that find tool calls in a model's text, whole or streamed (parsers/, stream.py)."""
