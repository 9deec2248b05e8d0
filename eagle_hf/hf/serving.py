"""`eagle-hf serve` on transformers' own server (``transformers serve``, `transformers.cli.serving`): the parts of
it used are named in this module alone, and `check_server_internals` fails with the name of what changed.

Used as they are: the chat-completions and legacy completions handlers (request -> prompt -> generation config
-> response, streamed or not; their refusals of fields OpenAI's API lacks), and the sequential generation manager
(one `generate()` at a time on one inference thread, streamed through its `DirectStreamer`). Subclassed: the
model manager, pinned to the one target eagle_hf loaded (`ServedModel`); the generation state, which hands every
request the one manager (`ServedGeneration`); and that manager, whose calls speculate with the server's drafter
(`SpeculativeGenerateManager`). The FastAPI app is assembled here as transformers' `build_server` assembles its
own (`build_app`), with the routes this server answers and a `/metrics` route of its own.

Tested with transformers 5.23 and 5.24, whose parts used here are the same; 5.25 rewrote the server (generation
in a model process, no sequential manager): importing this module there raises `EagleCompatibilityError`.
"""

from __future__ import annotations

import inspect
import logging

import torch
from transformers.utils.import_utils import is_serve_available

from ..errors import EagleCompatibilityError

if not is_serve_available():
    raise ImportError("eagle-hf serve needs FastAPI, uvicorn and openai (transformers' server): "
                      "pip install 'eagle-hf[serve]'")

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from transformers import StopStringCriteria

#: the transformers versions whose server this module builds on, as pip reads them
SERVER_VERSIONS = ">=5.23,<5.25"

try:
    from transformers.cli.serving.chat_completion import ChatCompletionHandler
    from transformers.cli.serving.completion import CompletionHandler
    from transformers.cli.serving.model_manager import ModelManager
    from transformers.cli.serving.utils import (
        X_REQUEST_ID,
        DirectStreamer,
        GenerateManager,
        GenerationState,
    )
except ImportError as err:  # (5.25 runs generation in a model process: no sequential manager to subclass)
    import transformers

    raise EagleCompatibilityError(
        f"transformers {transformers.__version__} changed the parts of its server that eagle-hf serve builds on "
        f"({err}). eagle-hf serve runs on transformers 5.23 and 5.24: pip install 'transformers{SERVER_VERSIONS}' "
        "(see eagle_hf/hf/serving.py).") from None

from ..serving.metrics import ServerCounters, request_speculation
from ..serving.requests import RequestError, ServedRequest, check_request, error_body, parse_body
from ..speculation.settings import DraftSettings
from ..speculation.stats import last_stats
from .stopping import eos_ids

logger = logging.getLogger(__name__)

#: what eagle_hf calls or overrides in transformers' server: object -> method -> the parameters it relies on
PINNED = {
    ModelManager: {"__init__": ("device", "dtype", "trust_remote_code", "attn_implementation",
                                "continuous_batching", "quantization", "model_timeout", "force_model"),
                   "load_model_and_processor": ("model_id_and_revision", "progress_callback", "tqdm_class",
                                                "gguf_file"),
                   "process_model_name": ("model_id",), "get_model_modality": ("model", "processor"),
                   "shutdown": ()},
    GenerationState: {"__init__": ("continuous_batching", "compile", "cb_config"),
                      "get_manager": ("model_id", "use_cb"), "use_continuous_batching": ("model", "modality")},
    GenerateManager: {"__init__": (),
                      "generate_streaming": ("model", "processor", "inputs", "gen_config", "request_id",
                                             "response_parser"),
                      "generate_non_streaming": ("model", "processor", "inputs", "gen_config", "request_id")},
    DirectStreamer: {"put": ("value",), "end": (), "cancel": ()},
    ChatCompletionHandler: {"__init__": ("model_manager", "generation_state", "chat_template_kwargs"),
                            "handle_request": ("body", "request_id")},
    CompletionHandler: {"__init__": ("model_manager", "generation_state", "chat_template_kwargs"),
                        "handle_request": ("body", "request_id")},
}


def check_server_internals() -> None:
    """Transformers' server as eagle_hf uses it (`PINNED`); else an error that names each change."""
    changed = []
    for owner, methods in PINNED.items():
        for name, wanted in methods.items():
            method = getattr(owner, name, None)
            if method is None:
                changed.append(f"{owner.__name__}.{name} is gone")
                continue
            have = [p for p in inspect.signature(method).parameters if p not in ("self", "args", "kwargs")]
            if list(wanted) != have:
                changed.append(f"{owner.__name__}.{name} takes ({', '.join(have)}), not ({', '.join(wanted)})")
    if changed:
        import transformers

        raise EagleCompatibilityError(
            f"transformers {transformers.__version__} changed the parts of its server that eagle-hf serve builds on: "
            f"{'; '.join(changed)}. eagle-hf serve runs on transformers 5.23 and 5.24: "
            f"pip install 'transformers{SERVER_VERSIONS}' (see eagle_hf/hf/serving.py).")


class ServedModel(ModelManager):
    """Transformers' model manager pinned to one model that eagle_hf loaded: requests name it (or no model), and
    nothing else is ever loaded or unloaded."""

    def __init__(self, name: str, target, tokenizer):
        super().__init__(device="cpu", model_timeout=-1)  # (nothing is loaded from these: the model is given)
        self.force_model = name  # transformers' handlers refuse another name (400)
        self.served = (target, tokenizer)

    def load_model_and_processor(self, model_id_and_revision, progress_callback=None, tqdm_class=None,
                                 gguf_file=None):
        return self.served

    @staticmethod
    def process_model_name(model_id: str) -> str:
        return model_id  # (the served name as it is: no "@main" revision)

    def list_models(self, cache_dir=None) -> list[dict]:
        return [{"id": self.force_model, "object": "model", "created": 0, "owned_by": "eagle_hf"}]

    def shutdown(self) -> None:
        pass  # the model outlives the app (its owner loaded it)


class ServedGeneration(GenerationState):
    """Transformers' generation state with one generation manager for every request."""

    def __init__(self, manager: GenerateManager):
        super().__init__(continuous_batching=False)
        self.manager = manager

    def get_manager(self, model_id: str, use_cb: bool = False) -> GenerateManager:
        return self.manager


class SpeculativeGenerateManager(GenerateManager):
    """Transformers' sequential generation manager (one `generate()` at a time on its inference thread) whose calls
    speculate with the server's drafter (None: plain decoding), with the settings the route checked
    (`requests`, by request id), inside the target's context."""

    def __init__(self, drafter=None, draft_options: dict | None = None, counters: ServerCounters | None = None):
        super().__init__()
        self.drafter, self.draft_options = drafter, dict(draft_options or {})
        self.counters = counters or ServerCounters("")
        self.requests: dict[str, ServedRequest] = {}  # the routes' requests not yet called, by request id

    def generate_streaming(self, model, processor, inputs, gen_config, request_id, response_parser=None):
        call = self._call(model, inputs, gen_config, request_id)
        return super().generate_streaming(call, processor, inputs, gen_config, request_id, response_parser)

    async def generate_non_streaming(self, model, processor, inputs, gen_config, request_id):
        call = self._call(model, inputs, gen_config, request_id)
        return await super().generate_non_streaming(call, processor, inputs, gen_config, request_id)

    def _call(self, target, inputs, gen_config, request_id: str) -> SpeculativeCall:
        """The request's call, its length checked against the target's context (a 400 otherwise)."""
        request = self.requests.pop(request_id, None) or ServedRequest()  # (the route keeps its own reference)
        context = context_length(target)
        prompt = int(inputs["input_ids"].shape[-1])
        room = context - prompt
        if room < 1:
            raise HTTPException(400, f"The prompt is {prompt} tokens long and the model reads at most {context} "
                                     "(its context): shorten the prompt.")
        if request.max_tokens is None:
            gen_config.max_new_tokens = min(gen_config.max_new_tokens or room, room)
        elif request.max_tokens > room:
            raise HTTPException(400, f"max_tokens={request.max_tokens} with a prompt of {prompt} tokens passes the "
                                     f"model's context of {context} tokens: ask for at most {room}.")
        if request.sample:
            gen_config.do_sample = True
        _check_bias(gen_config, target)
        self.counters.submitted()
        return SpeculativeCall(target, self, request)


def context_length(target) -> int:
    """The most tokens the target reads (prompt and output together)."""
    config = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    return int(getattr(config, "max_position_embeddings", None) or 2048)


def _check_bias(gen_config, target) -> None:
    bias = getattr(gen_config, "sequence_bias", None) or {}
    vocab = target.get_output_embeddings().weight.shape[0]
    bad = [ids[0] for ids in bias if not 0 <= ids[0] < vocab]
    if bad:
        raise HTTPException(400, f"logit_bias names token ids {bad} outside the vocabulary (0..{vocab - 1}).")


class SpeculativeCall:
    """The target as transformers' generation manager sees it for one request: its `generate()` speculates with
    the manager's drafter, seeded as the request asked, its streamer fed as plain decoding would feed it
    (`PlainStreamer`); the call's stats land on the request before the stream's end.

    A seeded request drafts a fixed chain (the server's ``num_assistant_tokens``, else the default depth): the
    adaptive schedule chooses its rounds from measured times and from what earlier calls accepted, and other
    rounds draw other random numbers, so the same seed would not give the same text twice."""

    def __init__(self, target, manager: SpeculativeGenerateManager, request: ServedRequest):
        self._target, self._manager, self._request = target, manager, request

    def __getattr__(self, name):
        return getattr(self._target, name)

    def generate(self, streamer=None, generation_config=None, tokenizer=None, **inputs):
        manager, request = self._manager, self._request
        plain = None if streamer is None else PlainStreamer(streamer, generation_config, tokenizer)
        extra = {} if manager.drafter is None else {"assistant_model": manager.drafter, **manager.draft_options}
        if extra and request.seed is not None:  # a fixed chain: the same rounds, so the same random draws
            extra.setdefault("num_assistant_tokens", DraftSettings().depth)
        manager.counters.started()
        try:
            if request.seed is not None:
                torch.manual_seed(request.seed)  # here, on the inference thread, just before the call
            out = self._target.generate(**inputs, streamer=plain, generation_config=generation_config,
                                        tokenizer=tokenizer, **extra)
        except BaseException:
            manager.counters.finished("cancelled" if plain is not None and plain.cancelled else "failed")
            raise
        request.stats = last_stats() if manager.drafter is not None else None
        manager.counters.finished("success", int(out.shape[-1] - inputs["input_ids"].shape[-1]), request.stats)
        if plain is not None and plain.ended:
            plain.finish()
        return out


class PlainStreamer:
    """What a speculative call hands transformers' `DirectStreamer`, made what plain decoding hands it: the prompt,
    then one token at a time, none past plain generate()'s stopping point (`max_new_tokens`, an EOS token, a stop
    string; a round's accepted tokens can run past it, and generate() cuts its output there afterwards); its `end`
    held until the call's stats are in (`finish`). Transformers' assisted loop puts ``[1, n]`` tensors, eagle_hf's
    loop ``[n]`` ones: both are read as n tokens."""

    def __init__(self, inner: DirectStreamer, generation_config, tokenizer):
        self.inner = inner
        self.left = generation_config.max_new_tokens
        self.eos = eos_ids(generation_config)
        stops = generation_config.stop_strings
        self.stop = StopStringCriteria(tokenizer, stops) if stops and tokenizer is not None else None
        self.ids: list[int] | None = None  # the prompt and the tokens passed on
        self.done = self.ended = self.cancelled = False

    def put(self, value: torch.Tensor) -> None:
        tokens = value.reshape(-1).tolist()  # [n] or [1, n] -> n ids
        if self.ids is None:  # the prompt (the streamer skips it)
            self.ids = tokens
            self._hand(value.reshape(1, -1))
            return
        for token in tokens:
            if self.done:
                return
            self._hand(torch.tensor([token]))
            self.ids.append(token)
            self.left = None if self.left is None else self.left - 1
            self.done = self.left == 0 or token in self.eos or self._stop_string()

    def _hand(self, value: torch.Tensor) -> None:
        try:
            self.inner.put(value)
        except Exception:  # the client went away: transformers' streamer raises to stop the call
            self.cancelled = True
            raise

    def _stop_string(self) -> bool:
        if self.stop is None:
            return False
        tail = torch.tensor([self.ids[-self.stop.maximum_token_len:]])  # [1, T]: what the criterion reads
        return bool(self.stop(tail, None).all())

    def end(self) -> None:
        self.ended = True

    def finish(self) -> None:
        self.inner.end()


def build_app(target, tokenizer, drafter=None, *, name: str = "default", draft_options: dict | None = None
              ) -> FastAPI:
    """The server's FastAPI app: `target` (and `tokenizer`) served under `name`, every request speculating with
    `drafter` (None: plain decoding) and `draft_options` (generate()'s draft keywords)."""
    check_server_internals()
    counters = ServerCounters(name)
    manager = SpeculativeGenerateManager(drafter, draft_options, counters)
    models, generation = ServedModel(name, target, tokenizer), ServedGeneration(manager)
    handlers = {"chat": ChatCompletionHandler(models, generation), "completion": CompletionHandler(models, generation)}
    app = FastAPI()
    app.state.counters, app.state.manager = counters, manager

    @app.middleware("http")
    async def request_id(request: Request, call_next):
        import uuid

        request.state.request_id = request.headers.get(X_REQUEST_ID) or str(uuid.uuid4())
        response = await call_next(request)
        response.headers[X_REQUEST_ID] = request.state.request_id
        return response

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, err: HTTPException):
        return JSONResponse(error_body(str(err.detail), status=err.status_code), status_code=err.status_code)

    @app.exception_handler(RequestError)
    async def request_error(_request: Request, err: RequestError):
        return JSONResponse(err.body(), status_code=err.status)

    async def complete(request: Request, kind: str):
        body = parse_body(await request.body())
        served = check_request(body, kind, name)
        rid = request.state.request_id
        manager.requests[rid] = served  # (the manager takes it when the handler asks it for the call)
        try:
            response = await handlers[kind].handle_request(body, rid)
        except (ValueError, TypeError) as err:  # a setting that generate() refused (before any token)
            raise RequestError(" ".join(str(err).split()) or type(err).__name__) from None
        finally:
            manager.requests.pop(rid, None)  # (refused before its call)
        if isinstance(response, StreamingResponse):
            response.body_iterator = _with_speculation(response.body_iterator, served)
            return response
        return _json_with_speculation(response, served)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, "completion")

    @app.get("/v1/models")
    def list_models():
        return JSONResponse({"object": "list", "data": models.list_models()})

    @app.get("/health")
    def health():
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    def metrics():
        return PlainTextResponse(counters.prometheus())

    return app


def _json_with_speculation(response: JSONResponse, served: ServedRequest) -> JSONResponse:
    import json

    if served.stats is None:
        return response
    body = json.loads(response.body)
    body["speculation"] = request_speculation(served.stats)
    return JSONResponse(body, status_code=response.status_code)


async def _with_speculation(chunks, served: ServedRequest):
    """The stream's chunks, its last one (the one with `usage`) with the request's `speculation` beside it."""
    import json

    try:
        async for chunk in chunks:
            if served.stats is not None and chunk.startswith("data: {") and '"usage"' in chunk:
                data = json.loads(chunk[len("data: "):])
                if "usage" in data:
                    data["speculation"] = request_speculation(served.stats)
                    chunk = f"data: {json.dumps(data, separators=(',', ':'))}\n\n"
            yield chunk
    finally:  # (a client gone mid-stream: transformers' generator cancels the call)
        await chunks.aclose()


def serve(target, tokenizer, drafter=None, *, name: str = "default", host: str = "127.0.0.1", port: int = 8000,
          draft_options: dict | None = None, log_level: str = "warning") -> None:
    """Serve `target` under `name` on ``http://host:port/v1`` until interrupted (Ctrl-C), every request speculating
    with `drafter` (None: plain decoding) and `draft_options` (generate()'s draft keywords)."""
    import uvicorn

    app = build_app(target, tokenizer, drafter, name=name, draft_options=draft_options)
    if log_level != "info":  # (transformers' server logs every request as a warning)
        logging.getLogger("transformers.cli.serving").setLevel(logging.ERROR)
    logger.info("Serving %s on http://%s:%d/v1", name, host, port)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
