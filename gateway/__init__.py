"""The public OpenAI-compatible API: auth, model resolution, tokenization, routing, metering."""
