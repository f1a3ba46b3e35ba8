"""`specquant serve`: an OpenAI-compatible HTTP front end over the same session layer as `chat`.

schemas (the wire format and its refusals) → app (FastAPI routes, auth, body cap, SSE, one log line per
request) → service (what the routes need: the sessions, one per slot, and the policies and limits) → worker (the
queue: up to --parallel requests run at once, each on a thread of its own, and the rest wait) → slots (each running
request a sequence of the shared contexts; the batcher joins their model calls into one llama.cpp call per round,
on its own thread) → server (the settings decided before any model loads, start-up, uvicorn, signals)."""
