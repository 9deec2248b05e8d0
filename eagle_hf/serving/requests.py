"""What a request to `eagle-hf serve` may ask, checked before anything runs: every refusal is a 4xx whose message
names the field and the fix (OpenAI's error body), and the server goes on serving.

The settings mean what they mean in transformers' own server without a drafter (`max_tokens`, `temperature`,
`top_p`, `stop`, `frequency_penalty`, `logit_bias` become the call's generation config there), with two
differences that make a request mean one thing whatever else the server is doing: ``temperature > 0`` samples
(transformers' server samples only where the model's generation config already does), and ``seed`` seeds the
call itself, just before it runs, not the process when the request arrives (and drafts a fixed chain, so that
its rounds, and the random numbers they draw, repeat: `eagle_hf.hf.serving.SpeculativeCall`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

#: fields of OpenAI's API that change the output and that transformers' server ignores: refused, not ignored
UNSUPPORTED_FIELDS = {
    "chat": ("audio", "function_call", "functions", "logprobs", "modalities", "parallel_tool_calls", "prediction",
             "presence_penalty", "reasoning_effort", "response_format", "tool_choice", "top_logprobs",
             "web_search_options", "generation_config"),
    "completion": ("best_of", "echo", "logprobs", "presence_penalty", "generation_config"),
}
#: the most stop strings a request may give (OpenAI's limit)
MAX_STOP_STRINGS = 4


class RequestError(Exception):
    """A request the server refuses: `status` (4xx), a message naming the fix, the field at fault (`param`)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status

    def body(self) -> dict:
        """OpenAI's error body (its client raises `BadRequestError` and friends with this message)."""
        return error_body(self.message, self.param, self.status)


def error_body(message: str, param: str | None = None, status: int = 400) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


@dataclass
class ServedRequest:
    """One request's settings that the server applies itself, and what its call did (filled when it returns)."""

    stream: bool = False
    max_tokens: int | None = None  # None: up to the context (transformers' default of 1024 at most)
    sample: bool | None = None  # True: temperature > 0 asked to sample; None: the model's generation config decides
    seed: int | None = None
    stats: object | None = None  # the call's `SpecDecodeStats` (None without a drafter, or before the call returns)


def parse_body(raw: bytes) -> dict:
    """The JSON object of a request body."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RequestError(f"The request body is not valid JSON ({err}); send a JSON object.") from None
    if not isinstance(body, dict):
        raise RequestError(f"The request body is a JSON {type(body).__name__}; send a JSON object.")
    return body


def check_request(body: dict, kind: str, served_name: str) -> ServedRequest:
    """`body` of a ``"chat"`` (/v1/chat/completions) or ``"completion"`` (/v1/completions) request, checked; the
    settings the server applies itself are taken out of it (`seed`) and returned. Fields OpenAI's API does not know
    are left to transformers' handler, which refuses them (422)."""
    unsupported = [f for f in UNSUPPORTED_FIELDS[kind] if body.get(f) is not None]
    if unsupported:
        raise RequestError(f"{', '.join(unsupported)}: not supported by this server; leave "
                           f"{'them' if len(unsupported) > 1 else 'it'} out.", unsupported[0])
    model = body.get("model")
    if model is not None and model != served_name:
        raise RequestError(f"The model {model!r} does not exist here: this server serves {served_name!r} "
                           "(GET /v1/models).", "model", status=404)
    if body.get("n") not in (None, 1):
        raise RequestError(f"n={body['n']!r}: this server returns one choice per request; leave n out or send 1.",
                           "n")
    if kind == "chat":
        _check_messages(body.get("messages"))
    elif not isinstance(body.get("prompt"), str):
        raise RequestError("prompt: send the prompt as one string.", "prompt")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise RequestError(f"stream={stream!r}: send true or false.", "stream")
    request = ServedRequest(stream=bool(stream))
    for name in ("max_completion_tokens", "max_tokens"):
        if body.get(name) is not None:
            request.max_tokens = _count(body, name)
            break
    temperature = _number(body, "temperature", 0.0, 2.0)
    if temperature is not None:
        request.sample = temperature > 0
    _number(body, "top_p", 0.0, 1.0, low_open=True)
    penalty = _number(body, "frequency_penalty", -2.0, 2.0)
    if penalty is not None and penalty <= -1.0:
        raise RequestError(f"frequency_penalty={penalty}: above -1 here (it becomes transformers' "
                           "repetition_penalty = 1 + frequency_penalty, which must be positive).", "frequency_penalty")
    _check_stop(body.get("stop"))
    _check_logit_bias(body.get("logit_bias"))
    seed = body.pop("seed", None)
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            body["seed"] = seed
            raise RequestError(f"seed={seed!r}: send a whole number from 0 to 2**63 - 1.", "seed")
        request.seed = seed
    return request


def _check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages: send a non-empty list of {\"role\": ..., \"content\": ...} objects.", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(f"messages[{i}]: each message is an object with a \"role\" string and its "
                               "\"content\".", "messages")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise RequestError(f"messages[{i}].content: send a string or a list of content parts.", "messages")


def _count(body: dict, name: str) -> int:
    value = body[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RequestError(f"{name}={value!r}: send a whole number of tokens, at least 1.", name)
    return value


def _number(body: dict, name: str, low: float, high: float, low_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value > high or value < low or (low_open and value == low):
        bound = f"above {low}" if low_open else f"from {low}"
        raise RequestError(f"{name}={value!r}: send a number {bound} to {high}.", name)
    return float(value)


def _check_stop(stop) -> None:
    if stop is None or isinstance(stop, str) and stop:
        return
    if (not isinstance(stop, list) or not 1 <= len(stop) <= MAX_STOP_STRINGS
            or not all(isinstance(s, str) and s for s in stop)):
        raise RequestError(f"stop={stop!r}: send a non-empty string or a list of 1 to {MAX_STOP_STRINGS} of them.",
                           "stop")


def _check_logit_bias(bias) -> None:
    if bias is None:
        return
    ok = isinstance(bias, dict) and all(
        isinstance(k, str) and k.isdigit() and isinstance(v, (int, float)) and not isinstance(v, bool)
        for k, v in bias.items())
    if not ok:
        raise RequestError("logit_bias: send an object of token id (a string of digits) -> bias (a number).",
                           "logit_bias")
