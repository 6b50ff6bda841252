"""`draftsman serve`: an OpenAI-compatible HTTP server with speculative decoding.

app.py (routes, validation, streaming), scheduler.py (continuous batching in one thread),
metrics.py (Prometheus), protocol.py (request/response shapes), text.py (detokenization),
server.py (loading and uvicorn with graceful shutdown).
"""

from draftsman.serve.app import ServeState, create_app
from draftsman.serve.server import build_state, load_state, run_server

__all__ = ["ServeState", "build_state", "create_app", "load_state", "run_server"]
