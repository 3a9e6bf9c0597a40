"""Serving many requests on one model: continuous batching (`engine`) behind an
OpenAI-compatible HTTP API (`app`, on Starlette and uvicorn: the `serve` extra)."""
