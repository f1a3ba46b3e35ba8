"""`specquant serve`: an OpenAI-compatible HTTP front end over the same session layer as `chat`.

guard (host, origin, key, one log line per request) → app (FastAPI routes; body: the body read strictly; schemas:
the wire format and its refusals; replies and sse: the answer written back, whole or streamed) → service (what the
routes need: the sessions, one per slot, and the policies and limits) → worker (the queue: up to --parallel requests
run at once, each on a thread of its own, and the rest wait) → slots (each running request a sequence of the shared
contexts; the batcher joins their model calls into one llama.cpp call per round, on its own thread) → server (the
settings decided before any model loads, start-up, uvicorn, signals)."""
