"""Structured outputs and tool calling for the OpenAI routes: request fields -> the scheduler's
`StructuredOutput` (structured.py), tools and tool_choice (protocol.py, schema.py), and the
parsers that find tool calls in a model's text, whole or streamed (parsers/, stream.py)."""
