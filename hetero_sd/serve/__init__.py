"""Serving many requests: the continuous-batching engine (batch.py) and the
OpenAI-compatible HTTP server over it (app.py, `hetero-sd serve`).

Nothing is imported here: the server's dependencies (FastAPI, uvicorn,
prometheus-client) come with the optional `server` extra, and batch.py must
import without them.
"""
