"""A Responses API answer written back: the whole response object (`ResponseMaker.whole`) or its documented stream
of events (`ResponseMaker.start`, `.text`, `.finish`, `.error`), both from serving.structured.outcome: a cut answer is
`incomplete` (reason max_output_tokens) and never a function call."""

from __future__ import annotations

import json
import uuid

from specquant_cli.serving.replies import cached_tokens, now, specquant_info
from specquant_cli.serving.responses import ResponsesRequest
from specquant_cli.serving.schemas import ApiError


def _rid(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


# -- the response -----------------------------------------------------------------------------------------------

def usage(last) -> dict:
    return {"input_tokens": last.prompt_tokens, "output_tokens": last.new_tokens,
            "total_tokens": last.prompt_tokens + last.new_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens(last), "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


def _has_message(o) -> bool:
    """Whether an answer's outcome (serving.structured.Outcome) has a message item: text, even empty when it ended
    on its own; not a cut answer with nothing to show."""
    return o.content is not None and (o.content != "" or o.finish == "stop")


class ResponseMaker:
    """One answer as a response object (`whole`) or as its stream of events (`start`, `text`, `finish`), to the
    request `req` for the model named `model`."""

    def __init__(self, req: ResponsesRequest, model: str):
        from specquant_cli.toolcalls import ToolStream

        self.req = req
        self.params = req.params
        self.id = _rid("resp")
        self.created = now()
        self.model = model
        self.msg_id = _rid("msg")
        self.seq = 0
        self.tools = ToolStream() if self.params.tool_calls else None
        self._text: list[str] = []  # the answer so far
        self._shown: list[str] = []  # the text sent as deltas
        self._open = False  # the message item was announced

    def response(self, status: str, output: list, last=None, answer=None) -> dict:
        d = {"id": self.id, "object": "response", "created_at": self.created, "status": status, "background": False,
             "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
             "model": self.model, "output": output, "previous_response_id": None,
             "reasoning": {"effort": None, "summary": None}, "service_tier": "default", "store": False,
             "truncation": "disabled", "usage": usage(last) if last is not None else None, **self.req.echo}
        if status in ("completed", "incomplete"):
            d["completed_at"] = now()
        if answer is not None and last is not None:
            d["specquant"] = specquant_info(answer, last)
        if self.req.warnings:  # what the request asked that the model did not see (built-in tools left out)
            d["specquant"] = {**d.get("specquant", {}), "warnings": list(self.req.warnings)}
        return d

    def _outcome(self, text: str, last):
        from specquant_cli.serving.replies import finish_reason
        from specquant_cli.serving.structured import answer_outcome

        return answer_outcome(text, finish_reason(last), self.params)

    def _message(self, text: str, status: str) -> dict:
        return {"type": "message", "id": self.msg_id, "status": status, "role": "assistant",
                "content": [] if status == "in_progress" and not text else [self._part(text)]}

    @staticmethod
    def _part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _call(self, c: dict) -> dict:
        """A function_call item; a function of a namespace tool names its namespace, as OpenAI's does."""
        item = {"type": "function_call", "id": _rid("fc"), "call_id": _rid("call"), "name": c["name"],
                "arguments": json.dumps(c["arguments"], ensure_ascii=False), "status": "completed"}
        if c["name"] in self.req.namespaces:
            item["namespace"] = self.req.namespaces[c["name"]]
        return item

    def _output(self, o) -> list[dict]:
        status = "completed" if o.finish == "stop" else "incomplete"
        out = [self._message(o.content, status)] if _has_message(o) else []
        return out + [self._call(c) for c in o.calls]

    @staticmethod
    def _status(o) -> str:
        return "incomplete" if o.finish == "length" else "completed"

    def whole(self, text: str, answer, last) -> dict:
        """The response object of a whole answer."""
        o = self._outcome(text, last)
        return self.response(self._status(o), self._output(o), last, answer)

    # -- streamed -----------------------------------------------------------------------------------------------
    def _event(self, kind: str, **fields) -> dict:
        d = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return d

    def start(self) -> list[dict]:
        """The events that open the stream."""
        opening = self.response("in_progress", [])
        return [self._event("response.created", response=opening),
                self._event("response.in_progress", response=opening)]

    def _open_message(self) -> list[dict]:
        self._open = True
        return [self._event("response.output_item.added", output_index=0, item=self._message("", "in_progress")),
                self._event("response.content_part.added", item_id=self.msg_id, output_index=0, content_index=0,
                            part=self._part(""))]

    def _delta(self, text: str) -> list[dict]:
        out = [] if self._open else self._open_message()
        self._shown.append(text)
        return out + [self._event("response.output_text.delta", item_id=self.msg_id, output_index=0,
                                  content_index=0, delta=text, logprobs=[])]

    def text(self, rec) -> list[dict]:
        """The events of one record's text (none while it may still open a call, or is a call)."""
        self._text.append(rec.text)
        text = rec.text
        if self.tools is not None:
            text = "".join(x for kind, x in self.tools.feed(rec.text) if kind == "text")
        return self._delta(text) if text else []

    def finish(self, answer, last) -> list[dict]:
        """The events that end the stream: the message's close, the calls, then response.completed (or
        .incomplete), whose response is the one `whole` gives."""
        o = self._outcome("".join(self._text), last)
        out: list[dict] = []
        if _has_message(o):
            rest = o.content[len("".join(self._shown)):]
            if rest or not self._open:
                out += self._delta(rest) if rest else self._open_message()
            status = "completed" if o.finish == "stop" else "incomplete"
            out += [self._event("response.output_text.done", item_id=self.msg_id, output_index=0, content_index=0,
                                text=o.content, logprobs=[]),
                    self._event("response.content_part.done", item_id=self.msg_id, output_index=0, content_index=0,
                                part=self._part(o.content)),
                    self._event("response.output_item.done", output_index=0, item=self._message(o.content, status))]
        items = [self._message(o.content, "completed" if o.finish == "stop" else "incomplete")] \
            if _has_message(o) else []
        for c in o.calls:
            index, item = len(items), self._call(c)
            out += [self._event("response.output_item.added", output_index=index,
                                item={**item, "arguments": "", "status": "in_progress"}),
                    self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                delta=item["arguments"]),
                    self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                name=item["name"], arguments=item["arguments"]),
                    self._event("response.output_item.done", output_index=index, item=item)]
            items.append(item)
        status = self._status(o)
        out.append(self._event(f"response.{status}", response=self.response(status, items, last, answer)))
        return out

    def error(self, e: ApiError) -> list[dict]:
        """The events that end a stream an error broke (e.g. the server stopping): `error`, then response.failed."""
        return [self._event("error", code=e.code, message=e.message, param=e.param),
                self._event("response.failed", response={**self.response("failed", []),
                                                         "error": {"code": "server_error", "message": e.message}})]
