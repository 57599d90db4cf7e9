"""llmserve's OpenAI-compatible HTTP frontend: a stateless client of the scheduler's gRPC API."""
