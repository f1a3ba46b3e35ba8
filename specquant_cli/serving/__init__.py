"""`specquant serve`: an OpenAI-compatible HTTP front end over the same session layer as `chat`.

schemas (the wire format and its refusals) → app (FastAPI routes, auth, body cap, SSE, one log line per
request) → worker (one engine: a single thread runs the queued generations one at a time) → server (start-up,
uvicorn, signals)."""
