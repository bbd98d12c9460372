"""The OpenAI-compatible HTTP server: request and response schemas, the Starlette app, the
admission gate and drain, logging, OpenAPI document and offline batch files."""
