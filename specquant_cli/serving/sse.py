"""An answer streamed as server-sent events: one loop over a job's records (`events`), written as chat and
completion chunks (`data: JSON`, then `data: [DONE]`: `ChunkFrames`) or as the Responses API's typed events
(`event: TYPE` and `data: JSON`, no [DONE]: `ResponseFrames`); a stream the client leaves stops generating for
nobody."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Protocol

from specquant_cli.serving.metrics import Observation, outcome_of
from specquant_cli.serving.replies import ChunkMaker
from specquant_cli.serving.response_maker import ResponseMaker
from specquant_cli.serving.schemas import ApiError
from specquant_cli.serving.service import Service
from specquant_cli.serving.worker import Job, disconnected

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class Frames(Protocol):
    """What one stream's events are written as: each method returns the SSE frames to send."""

    def opening(self, answer) -> list[str]: ...

    def record(self, answer, rec) -> list[str]: ...

    def finish(self, answer, rec) -> list[str]: ...

    def error(self, e: ApiError) -> list[str]: ...


async def events(svc: Service, job: Job, frames: Frames, answer, first, notes: dict,
                 obs: Observation) -> AsyncIterator[str]:
    """The SSE frames of a job's answer, from its first record `first` on; an error (e.g. SIGTERM) ends the stream
    with an error event in the API's shape. The request is observed to its end here: served, the error's outcome,
    or cancelled when the client went away (then its job is cancelled too)."""
    outcome = None  # until the stream ends
    try:
        for frame in frames.opening(answer):
            yield frame
        kind, payload = "record", first
        while True:
            if kind == "error":
                notes["error"] = payload.message
                for frame in frames.error(payload):
                    yield frame
                outcome = outcome_of(payload)
                return
            rec = payload
            notes["gen"] = (answer, rec)
            obs.record(answer, rec)
            for frame in frames.record(answer, rec):
                yield frame
            if rec.finish_reason is not None:
                for frame in frames.finish(answer, rec):
                    yield frame
                outcome = "served"
                return
            kind, payload = await job.get()
    finally:
        if outcome is None:  # the client went away (Starlette cancelled us): stop generating for nobody
            svc.worker.cancel(job, disconnected())
        obs.end(outcome or "cancelled")


class ChunkFrames:
    """Chat and completion chunks (OpenAI's `data: JSON` frames), usage last when asked, then `data: [DONE]`."""

    def __init__(self, maker: ChunkMaker):
        self.maker = maker

    def opening(self, answer) -> list[str]:
        opening = self.maker.first(answer)
        return [_event(opening)] if opening is not None else []

    def record(self, answer, rec) -> list[str]:
        chunk = self.maker.text(answer, rec)  # None while nothing can go out (its logprobs wait for the next)
        return [_event(chunk)] if chunk is not None else []

    def finish(self, answer, rec) -> list[str]:
        out = [_event(chunk) for chunk in self.maker.finish(answer, rec)]
        if self.maker.include_usage:
            out.append(_event(self.maker.usage(rec)))
        return [*out, "data: [DONE]\n\n"]

    def error(self, e: ApiError) -> list[str]:
        return [_event(e.body())]


class ResponseFrames:
    """The Responses stream: each event as `event: TYPE` and `data: JSON`; no [DONE]."""

    def __init__(self, maker: ResponseMaker):
        self.maker = maker

    def opening(self, answer) -> list[str]:
        return [_typed(event) for event in self.maker.start()]

    def record(self, answer, rec) -> list[str]:
        return [_typed(event) for event in self.maker.text(rec)]

    def finish(self, answer, rec) -> list[str]:
        return [_typed(event) for event in self.maker.finish(answer, rec)]

    def error(self, e: ApiError) -> list[str]:
        return [_typed(event) for event in self.maker.error(e)]


def _event(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _typed(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
