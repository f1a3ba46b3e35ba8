"""The OpenAI wire format of a request: request models with the refusals named (the answers written back:
serving.replies).

Requests are validated here into `GenerationParams`, the only thing the worker sees. What specquant cannot
honour (n > 1, images, penalties, logit_bias, ...) is refused with a 400 naming the field rather than
silently ignored; structured output (response_format, tools, logprobs) is read by serving.structured; fields
that change nothing about the output (user, metadata, store, ...) are accepted.
The fields specquant reads are strict: no coercion ("4" is not 4, true is not 1), no NaN, bounded integers,
and every string that reaches the model is valid Unicode (JSON can carry a lone surrogate, UTF-8 cannot)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import PydanticCustomError

from specquant_cli.decoding.sampling import SamplingParams

MAX_STOP = 4  # OpenAI's limit on stop strings
MAX_INT = 2**31 - 1  # the largest token count (or top_k) a request may ask for; the context refuses far less
MAX_SEED = 2**64 - 1  # as the CLI's --seed
MAX_SALT = 256  # characters of a cache_salt
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool"}  # -> the template's


class ApiError(Exception):
    """An answer in OpenAI's error shape. The message is for the client: never a key or a traceback."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: Optional[str] = None,
                 code: Optional[str] = None, headers: Optional[dict[str, str]] = None):
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")  # a lone surrogate could not be sent
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# -- requests -----------------------------------------------------------------------------------------

def _unicode(s: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise PydanticCustomError("invalid_unicode", "the text is not valid Unicode (it holds a lone surrogate)") \
            from None
    return s


def _non_empty(s: str) -> str:
    if not s:
        raise PydanticCustomError("empty_text", "the text is empty")
    return s


def valid_unicode(value: Any, param: str) -> None:
    """Every string of a JSON value (keys too) is valid Unicode (a schema, a tool: they reach the model, or are sent
    back); an ApiError names the innermost field of one that is not."""
    if isinstance(value, str):
        try:
            _unicode(value)
        except PydanticCustomError as e:
            raise ApiError(400, f"invalid value for {param}: {e.message()}", param=param, code="invalid_value") \
                from None
    elif isinstance(value, dict):
        for key, item in value.items():
            valid_unicode(key, param)
            valid_unicode(item, f"{param}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            valid_unicode(item, f"{param}[{i}]")


Text = Annotated[str, AfterValidator(_unicode)]  # every string that reaches the model
NonEmptyText = Annotated[Text, AfterValidator(_non_empty)]


class _Lenient(BaseModel):
    """Unknown fields are accepted and ignored (clients send user, metadata, store, ...); known ones are strict
    (an integer is accepted for a float, nothing else is converted)."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class StreamOptions(_Lenient):
    include_usage: Optional[bool] = False


class ContentPart(_Lenient):
    type: str
    text: Optional[Text] = None  # may be empty, as a message's content may


class Message(_Lenient):
    role: str
    # empty in any role; null or absent only beside an assistant's tool_calls or in a tool's result
    # (serving.structured.history)
    content: Union[Text, Annotated[list[ContentPart], Field(min_length=1)], None] = None


class _Common(_Lenient):
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1, le=MAX_INT)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, ge=0, le=1)
    top_k: Optional[int] = Field(None, ge=0, le=MAX_INT)  # not OpenAI's; llama.cpp's servers accept it too
    seed: Optional[int] = Field(None, ge=0, le=MAX_SEED)
    stop: Union[Text, list[Text], None] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    n: Optional[int] = Field(None, ge=1)
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, Any]] = None
    specquant_policy: Optional[Text] = None
    prediction: Optional[Any] = None  # OpenAI's Predicted Outputs: read by `_prediction`
    # vLLM's field: the prompt cache, prefix sharing and drafting memory this request may use are narrowed to the
    # requests of its tenant that send the same salt (never widened: another tenant's are never used)
    cache_salt: Optional[Annotated[Text, AfterValidator(_non_empty), Field(max_length=MAX_SALT)]] = None


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1, le=MAX_INT)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    tools: Optional[Any] = None
    tool_choice: Optional[Any] = None
    functions: Optional[Any] = None
    function_call: Optional[Any] = None
    response_format: Optional[dict[str, Any]] = None


class CompletionRequest(_Common):
    prompt: Union[Text, list[Text], list[int], list[list[int]]]
    logprobs: Optional[int] = None
    echo: Optional[bool] = None
    suffix: Optional[str] = None
    best_of: Optional[int] = None


@dataclass
class GenerationParams:
    """One validated request, as the worker runs it. Exactly one of `messages` and `prompt` is set."""

    policy: str
    sampling: SamplingParams
    max_tokens: Optional[int]  # None: the server's default, clamped to what the context has left
    stop: list[str] = field(default_factory=list)
    messages: Optional[list[dict]] = None
    prompt: Optional[str] = None
    stream: bool = False
    include_usage: bool = False
    salt: Optional[str] = None  # the body's cache_salt
    grammar: Any = None  # decoding.grammar.Grammar: what the answer must be (response_format, tools)
    tools: Optional[list[dict]] = None  # the function tools the chat template describes
    tool_calls: bool = False  # the answer is read for tool calls (finish_reason "tool_calls")
    top_logprobs: Optional[int] = None  # logprobs asked, with that many alternatives
    scope: str = ""  # what the request may share with others (its tenant and salt: Service.scope_of), set on admission
    prediction: Optional[str] = None  # the text the answer is expected to resemble (`prediction.content`)
    max_tokens_param: str = "max_tokens"  # the request's field that set max_tokens (an error names it)
    prompt_param: str = "messages"  # the request's field that holds the prompt (an error names it)


def _validate(model: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        errors = e.errors()
        # Of a union's failures, the one past the type check says what is wrong ("empty", not "not a list"), and of
        # those the one deepest in the value (a part's text that is no string, not the content that is no string).
        errors = [x for x in errors if not x["type"].endswith("_type")] or errors
        err = max(errors, key=lambda x: len(_fields(x.get("loc", ()))))
        param = _param(err.get("loc", ()))
        raise ApiError(400, f"invalid value for {param or 'the body'}: {err.get('msg', 'invalid')}", param=param,
                       code="invalid_value") from None


_TYPE_NAMES = {"str", "int", "float", "bool", "dict", "list", "none"}


def _fields(loc) -> list:
    """The parts of a pydantic error location that are fields or indexes (not the member of a union that failed:
    list[str], str, ...)."""
    return [p for p in loc if isinstance(p, int) or not ("[" in p or p.lower() in _TYPE_NAMES)]


def _param(loc) -> Optional[str]:
    """A pydantic error location as OpenAI names a parameter: messages[0].content."""
    out = ""
    for part in _fields(loc):
        out += f"[{part}]" if isinstance(part, int) else ("." if out else "") + part
    return out or None


def _unsupported(param: str, why: str = "") -> ApiError:
    return ApiError(400, f"'{param}' is not supported by specquant serve{': ' + why if why else ''}", param=param,
                    code="unsupported_parameter")


def _refuse_common(req: _Common) -> None:
    if req.n not in (None, 1):
        raise _unsupported("n", "one choice per request (n=1)")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) not in (None, 0, 0.0):
            raise _unsupported(name, "penalties would change the parent's distribution")
    if req.logit_bias:
        raise _unsupported("logit_bias")


def _excluded(req: _Common, **chat) -> dict[str, bool]:
    """What OpenAI refuses beside a prediction (Predicted Outputs), besides n > 1 and penalties above 0 (refused here
    with or without one): request field -> whether the request sets it so; `chat`: the chat request's own fields."""
    extra = req.model_extra or {}
    return {**chat, "audio": extra.get("audio") is not None,
            "modalities": extra.get("modalities") not in (None, ["text"])}


def _prediction(req: _Common, excluded: dict[str, bool]) -> Optional[str]:
    """The text of the request's `prediction` (OpenAI's Predicted Outputs: {"type": "content", "content": a string or
    an array of text parts, joined as they are}), None without one; refused in OpenAI's way: a malformed one, or one
    beside a field Predicted Outputs does not take (`excluded`: _excluded)."""
    p = req.prediction
    if p is None:
        return None
    if not isinstance(p, dict):
        raise ApiError(400, "prediction must be an object: {\"type\": \"content\", \"content\": ...}",
                       param="prediction", code="invalid_type")
    if p.get("type") != "content":
        raise ApiError(400, f"invalid prediction type {p.get('type')!r}: the only type is 'content'",
                       param="prediction.type", code="invalid_value")
    content = p.get("content")
    if isinstance(content, list) and content:
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, "a prediction content part is {\"type\": \"text\", \"text\": ...}",
                               param=f"prediction.content[{j}]", code="invalid_value")
        content = "".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise ApiError(400, "prediction content must be a string or a non-empty array of text parts",
                       param="prediction.content", code="invalid_value")
    try:
        _unicode(content)
    except PydanticCustomError as e:
        raise ApiError(400, f"invalid value for prediction.content: {e.message()}", param="prediction.content",
                       code="invalid_value") from None
    for name, sets in excluded.items():
        if sets:
            raise ApiError(400, f"'{name}' is not supported with 'prediction' (Predicted Outputs)", param=name,
                           code="unsupported_parameter")
    return content


def _stops(stop: Union[str, list[str], None]) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP:
        raise ApiError(400, f"at most {MAX_STOP} stop sequences", param="stop", code="invalid_value")
    if not all(stops):
        raise ApiError(400, "a stop sequence is empty", param="stop", code="invalid_value")
    return stops


def _sampling(req: _Common) -> SamplingParams:
    # OpenAI's defaults: temperature 1, top_p 1 (send temperature 0 for greedy, the parent's exact output).
    return SamplingParams(temperature=1.0 if req.temperature is None else req.temperature, top_k=req.top_k or 0,
                          top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed)


def _text_content(content: Union[str, list[ContentPart]], i: int) -> str:
    if isinstance(content, str):
        return content
    for j, part in enumerate(content):
        if part.type != "text":
            raise _unsupported(f"messages[{i}].content[{j}]", f"content parts of type {part.type!r} (text only)")
        if part.text is None:
            raise ApiError(400, "a text part has no text", param=f"messages[{i}].content[{j}].text",
                           code="invalid_value")
    return "\n".join(part.text for part in content)


def _messages(msgs: list[Message]) -> list[dict]:
    from specquant_cli.serving.structured import check_links, history

    out = []
    for i, m in enumerate(msgs):
        role = ROLES.get(m.role)
        if m.role == "function":
            raise _unsupported(f"messages[{i}].role", "role 'function' (the tool role replaced it)")
        if role is None:
            raise ApiError(400, f"unknown role {m.role!r}: one of {', '.join(ROLES)}", param=f"messages[{i}].role",
                           code="invalid_value")
        if (m.model_extra or {}).get("function_call"):
            raise _unsupported(f"messages[{i}].function_call", "use tool_calls")
        out.append(history(i, m, role, None if m.content is None else _text_content(m.content, i)))
    if not any(m["role"] == "user" for m in out):
        raise ApiError(400, "messages must contain at least one user message", param="messages",
                       code="invalid_value")
    check_links(out)
    return out


def chat_params(body: Any, resolve_policy: Callable[[Optional[str]], str], model=None) -> GenerationParams:
    """Validate a /v1/chat/completions body. `resolve_policy` maps the body's `specquant_policy` (or None) to
    the policy to run, raising ApiError for one the server does not offer. `model`: the vocabulary a grammar
    (response_format, tools) is compiled for."""
    from specquant_cli.decoding.forms import FormError

    try:
        return _chat_params(body, resolve_policy, model)
    except FormError as e:
        raise ApiError(400, str(e), param=e.param, code="invalid_value") from None


def _chat_params(body: Any, resolve_policy: Callable[[Optional[str]], str], model) -> GenerationParams:
    from specquant_cli.serving.structured import Structure, structure

    req: ChatRequest = _validate(ChatRequest, body)
    _refuse_common(req)
    for name in ("functions", "function_call"):
        if getattr(req, name) is not None:
            raise _unsupported(name, "the deprecated form: use tools and tool_choice")
    prediction = _prediction(req, _excluded(req, logprobs=bool(req.logprobs) or req.top_logprobs is not None,
                                            max_completion_tokens=req.max_completion_tokens is not None,
                                            tools=req.tools is not None))
    for name in ("tools", "tool_choice", "response_format"):
        valid_unicode(getattr(req, name), name)
    wants = req.tools is not None or req.tool_choice is not None or req.logprobs or req.top_logprobs is not None \
        or (req.response_format or {}).get("type", "text") != "text"
    form = structure(req, model) if wants and model is not None else Structure()
    if wants and model is None:
        raise _unsupported("response_format" if req.response_format else "tools", "no model to compile it for")
    messages = _messages(req.messages)
    if model is not None:
        from specquant_cli.serving.structured import check_history

        check_history(messages, model)
    return GenerationParams(policy=resolve_policy(req.specquant_policy), sampling=_sampling(req),
                            max_tokens=req.max_completion_tokens or req.max_tokens, stop=_stops(req.stop),
                            max_tokens_param="max_completion_tokens" if req.max_completion_tokens else "max_tokens",
                            messages=messages, stream=bool(req.stream),
                            include_usage=bool(req.stream_options and req.stream_options.include_usage),
                            salt=req.cache_salt, grammar=form.grammar, tools=form.tools, tool_calls=form.calls,
                            top_logprobs=form.top_logprobs, prediction=prediction)


def completion_params(body: Any, resolve_policy: Callable[[Optional[str]], str]) -> GenerationParams:
    """Validate a /v1/completions body: one prompt string (or a list holding exactly one)."""
    req: CompletionRequest = _validate(CompletionRequest, body)
    _refuse_common(req)
    if req.best_of not in (None, 1):
        raise _unsupported("best_of")
    if req.echo:
        raise _unsupported("echo")
    if req.suffix:
        raise _unsupported("suffix")
    if req.logprobs:
        raise _unsupported("logprobs")
    prediction = _prediction(req, _excluded(req))
    prompt = req.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise _unsupported("prompt", "one prompt string per request (no token arrays or batches)")
        prompt = prompt[0]
    if not prompt:
        raise ApiError(400, "prompt is empty", param="prompt", code="invalid_value")
    return GenerationParams(policy=resolve_policy(req.specquant_policy), sampling=_sampling(req),
                            max_tokens=req.max_tokens, stop=_stops(req.stop), prompt=prompt, prompt_param="prompt",
                            stream=bool(req.stream),
                            include_usage=bool(req.stream_options and req.stream_options.include_usage),
                            salt=req.cache_salt, prediction=prediction)
