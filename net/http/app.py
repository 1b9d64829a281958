"""The OpenAI-compatible HTTP API as a Starlette app over one `Runtime`.

Routes: `POST /v1/chat/completions`, `POST /v1/completions`, `POST /v1/embeddings`, `GET /v1/models[/{model}]`,
`GET /health` (503 until the runtime is attached, and once the server drains), `GET
/metrics` (Prometheus text). A request body is read within `server.max_body_bytes` and
`server.body_timeout_s`, decoded into a typed request (`openai_types`), mapped onto a
`GenerateRequest` (`mapping`) and submitted; its events come back as one JSON response or
as server-sent events ending in `[DONE]`. A client that disconnects, while queued or
mid-stream, cancels its request. Errors use OpenAI's JSON shape, their status taken from
`protocols.errors.ERROR_KINDS`. With `server.api_key` (or `api_keys`), every route but /health needs one.

Anthropic's Messages API is served beside it on the same runtime: `POST /v1/messages` and
`POST /v1/messages/count_tokens` (`anthropic`), with Anthropic's stream events and error JSON.
OpenAI's Responses API too: `POST /v1/responses`, `GET`/`DELETE /v1/responses/{id}` (`responses_api`;
responses kept in memory for `previous_response_id`, `response_store`), with its `response.*` events.
Each request's output object (`outputs.Output`) says how its chunks, terminator and errors go on
the wire, so one streaming loop serves all three.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import anyio
import msgspec
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from net.http import anthropic_types as at
from net.http import embeddings as emb
from net.http import openai_types as oa
from net.http import responses_api_types as ra
from net.http import tokens
from net.http.anthropic import MessagesOutput, map_body
from net.http.choices import Choices, Merged, continuous_usage
from net.http.errors import HttpError, decode_body, error_of
from net.http.forced_tools import with_header_tool_choice
from net.http.mapping import chat_parts, chat_request, check_messages, check_scored_prompt_tokens, choices, completion_requests, prompt_list
from net.http.middleware import Authorization, BrowserGuard, RequestLimit, ResponseCounter, request_owner
from net.http.outputs import ChatOutput, CompletionOutput, Output, ResponseIds, TokenTexts
from net.http.pacing import ClientPacing
from net.http.response_store import server_store
from net.http.responses import JSON, error_body_for, error_response, json_response
from net.http.responses_api import ResponsesOutput, responses_request
from net.http.streaming import CLIENT_LEFT, SseResponse, close_stream, collect, read_body, sse_body, unless_disconnected, whole_response
from protocols.api import GenerateRequest, SamplingParams
from protocols.config import LimitsConfig, ServerConfig
from protocols.errors import InternalError, MlxrtError
from protocols.model import ModelInfo
from runtime import offload
from runtime.metrics import CONTENT_TYPE, PREFIX
from runtime.serving import Serving

log = structlog.get_logger(actor="http")

# A key's share of the Responses store unless the server's limits say otherwise.
DEFAULT_STORE_SHARE = LimitsConfig().max_response_store_share


class Api:
    """The endpoints, and what they serve: the runtime once attached, the server's settings."""

    def __init__(self, config: ServerConfig, model_name: str, allowed_hosts: frozenset[str] | None = None, store_share: float = DEFAULT_STORE_SHARE):
        self.config = config
        self.model_name = model_name
        # Host names requests may address (None: any; see `middleware.BrowserGuard`).
        self.allowed_hosts = allowed_hosts
        self.runtime: Serving | None = None
        self.draining = False
        self._token_texts: dict[str | None, TokenTexts] = {}
        self._fingerprint = ""
        self._created = 0
        # Responses kept for `previous_response_id` and GET/DELETE /v1/responses/{id}.
        self.stored_responses = server_store(config, store_share)
        self.registry = CollectorRegistry(auto_describe=True)
        self.responses = Counter(f"{PREFIX}http_responses", "HTTP responses by route and status.", ["model_name", "route", "status"], registry=self.registry)
        entries = Gauge(f"{PREFIX}responses_store_entries", "Responses kept (server.responses_store_max).", ["model_name"], registry=self.registry)
        entries.labels(model_name).set_function(self.stored_responses.__len__)
        held = Gauge(f"{PREFIX}responses_store_bytes", "Bytes the responses kept hold (server.responses_store_bytes).", ["model_name"], registry=self.registry)
        held.labels(model_name).set_function(lambda: self.stored_responses.num_bytes)
        # Answers the per-client pacing holds back now, by client (`net.http.pacing`).
        self.held_answers: dict[str, int] = {}
        paced = Gauge(
            f"{PREFIX}http_answers_held", "Refusals held back by the per-client pacing (server.client_refusals_per_s).", ["model_name"], registry=self.registry
        )
        paced.labels(model_name).set_function(lambda: sum(self.held_answers.values()))

    def attach(self, runtime: Serving) -> None:
        """Serve this runtime (its model is loaded): /health turns ready."""
        self.runtime = runtime
        self._token_texts = {}
        self._fingerprint = f"mlxrt-{runtime.model_info.model_id[:12]}"
        self._created = int(time.time())

    def _ready(self) -> Serving:
        if self.draining:
            raise HttpError("shutting_down", "the server is shutting down")
        if self.runtime is None:
            raise HttpError("shutting_down", "the model is still loading")
        return self.runtime

    # -- endpoints -------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        status = "draining" if self.draining else "loading" if self.runtime is None else "unavailable" if self.runtime.world_error else "ok"
        return json_response({"status": status, "model": self.model_name}, 200 if status == "ok" else 503)

    async def metrics(self, request: Request) -> Response:
        runtime = self._ready()
        await runtime.stats(fresh=False)  # refreshes the gauges, without waiting for a step
        return Response(runtime.metrics.render() + generate_latest(self.registry), media_type=CONTENT_TYPE)

    async def models(self, request: Request) -> Response:
        runtime = self._ready()
        models = [self._card(name) for name in runtime.known_models()]
        return json_response(oa.ModelList(data=[*models, *(self._card(name, adapter=True) for name in runtime.known_adapters())]))

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        _, adapter = self._check_model(name)
        return json_response(self._card(name, adapter=adapter is not None))

    async def chat_completions(self, request: Request) -> Response:
        runtime = self._ready()
        body = decode_body(await self._read_body(request), oa.ChatCompletionRequest)
        model, adapter = self._check_model(body.model)
        limits = runtime.config.limits
        check_messages(len(body.messages), chat_parts(body.messages), limits)
        generates = choices([msgspec.structs.replace(chat_request(body), model=model, adapter=adapter)], body.n, limits)
        ids = self._ids("chatcmpl", generates[0], body.model)
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        several = len(generates) > 1
        counts = await continuous_usage(runtime, generates, body)
        outputs: list[Output] = [
            ChatOutput(
                ids,
                self._texts(model),
                include_usage=include_usage and not several,
                return_token_ids=body.return_token_ids,
                stream=body.stream,
                index=i,
                usage_prompt_tokens=counts[i],
            )
            for i in range(len(generates))
        ]
        return await self._respond_choices(request, runtime, generates, outputs, endpoint="chat", include_usage=include_usage)

    async def completions(self, request: Request) -> Response:
        runtime = self._ready()
        body = decode_body(await self._read_body(request), oa.CompletionRequest)
        model, adapter = self._check_model(body.model)
        limits = runtime.config.limits
        prompts = [msgspec.structs.replace(g, model=model, adapter=adapter) for g in completion_requests(body, limits)]
        # Prompt logprobs score every prompt token of every choice: bounded before any prompt is
        # rendered (by the token-id prompts' sizes, a text's at least 1), then as rendered.
        scored = "prompt_logprobs" if body.prompt_logprobs is not None else "logprobs" if body.echo and body.logprobs is not None else None
        if scored is not None:
            check_scored_prompt_tokens(body.n * sum(len(g.prompt_ids or [0]) for g in prompts), limits, scored)
        if body.echo or scored is not None:  # the prompt's tokens, as the request renders them, for its echo
            rendered = [await runtime.prompt_token_ids(g) for g in prompts]
            if scored is not None:
                check_scored_prompt_tokens(body.n * sum(len(ids) for ids in rendered), limits, scored)
            prompts = [msgspec.structs.replace(g, prompt=None, prompt_ids=ids) for g, ids in zip(prompts, rendered)]
        if body.echo:
            tokenizer = runtime.tokenizer_for(model)
            texts = [body_prompt if isinstance(body_prompt, str) else None for body_prompt in prompt_list(body.prompt)]
            echoes = [text if text is not None else await anyio.to_thread.run_sync(tokenizer.decode, ids) for text, ids in zip(texts, rendered)]
        generates = choices(prompts, body.n, limits)
        ids = self._ids("cmpl", generates[0], body.model)
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        several = len(generates) > 1
        counts = await continuous_usage(runtime, generates, body)
        outputs: list[Output] = []
        for i, generate in enumerate(generates):
            prompt_index = i // body.n
            outputs.append(
                CompletionOutput(
                    ids,
                    self._texts(model),
                    include_usage=include_usage and not several,
                    return_token_ids=body.return_token_ids,
                    stream=body.stream,
                    want_logprobs=generate.logprobs,
                    index=i,
                    echo_text=echoes[prompt_index] if body.echo else None,
                    echo_ids=generate.prompt_ids if body.echo else None,
                    discard=body.max_tokens == 0,
                    want_prompt_logprobs=body.prompt_logprobs is not None,
                    usage_prompt_tokens=counts[i],
                )
            )
        return await self._respond_choices(request, runtime, generates, outputs, endpoint="completions", include_usage=include_usage)

    async def messages(self, request: Request) -> Response:
        """Anthropic's Messages API. A stream's `message_start` reports the prompt's tokens, so
        they are counted (rendered as the request renders them) before it is submitted."""
        runtime = self._ready()
        name, stream, generate = await self._anthropic_body(request, runtime, at.MessagesRequest)
        model, adapter = self._check_model(name)
        generate = with_header_tool_choice(msgspec.structs.replace(generate, model=model, adapter=adapter), request.headers)
        input_tokens = len(await runtime.prompt_token_ids(generate)) if stream else 0
        message_id = f"msg_{(generate.request_id or '').removeprefix('req-')}"
        output = MessagesOutput(message_id, name, stream=stream, input_tokens=input_tokens)
        return await self._respond(request, runtime, generate, output, endpoint="messages")

    async def count_tokens(self, request: Request) -> Response:
        """The tokens `/v1/messages` would render the same conversation's prompt into."""
        runtime = self._ready()
        name, _, generate = await self._anthropic_body(request, runtime, at.CountTokensRequest)
        model, adapter = self._check_model(name)
        generate = msgspec.structs.replace(generate, model=model, adapter=adapter)
        return json_response(at.CountTokensResponse(input_tokens=len(await runtime.prompt_token_ids(generate))))

    async def _anthropic_body(self, request: Request, runtime: Serving, kind: type[at.CountTokensRequest]) -> tuple[str, bool, GenerateRequest]:
        """A Messages body decoded, checked and mapped (`anthropic.map_body`): here when small,
        in the tokenizer's worker process past `scheduler.bulk_tokenize_bytes`."""
        raw = await self._read_body(request)
        limits, min_size = runtime.config.limits, runtime.config.scheduler.bulk_tokenize_bytes
        if not min_size or len(raw) < min_size:
            return map_body(None, raw, kind, limits)
        return await offload.run(runtime.tokenizer_for(None), map_body, raw, kind, limits, size=len(raw), min_size=min_size)

    async def create_response(self, request: Request) -> Response:
        """OpenAI's Responses API (`responses_api`): the conversation of `previous_response_id`
        (stored) continued by `input`; the response is stored once it ends, unless `store` is false."""
        runtime = self._ready()
        body = decode_body(await self._read_body(request), ra.ResponsesRequest)
        model, adapter = self._check_model(body.model)
        items = body.input if isinstance(body.input, list) else []
        parts = sum(len(item["content"]) for item in items if isinstance(item, dict) and isinstance(item.get("content"), list))
        check_messages(len(items), parts, runtime.config.limits, "input")
        owner = request_owner(request.scope)
        turn = responses_request(body, self.stored_responses, owner=owner, limits=runtime.config.limits)
        generate = with_header_tool_choice(msgspec.structs.replace(turn.generate, model=model, adapter=adapter), request.headers)
        store = self.stored_responses if body.store else None
        output = ResponsesOutput(body, stream=body.stream, store=store, history=turn.history, owner=owner, depth=turn.depth)
        return await self._respond(request, runtime, generate, output, endpoint="responses")

    async def get_response(self, request: Request) -> Response:
        """A stored response, as it was answered (the caller's own: another key's is a 404)."""
        stored = self.stored_responses.get(request.path_params["response_id"], owner=request_owner(request.scope))
        return Response(stored.response, media_type=JSON)

    async def delete_response(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        owner = request_owner(request.scope)
        self.stored_responses.get(response_id, owner=owner)  # (a 404 for an unknown id, or another key's)
        self.stored_responses.delete(response_id, owner=owner)
        return json_response(ra.DeletedResponse(id=response_id))

    async def embeddings(self, request: Request) -> Response:
        """One vector per input from the model's final hidden states (`embeddings`); a client that
        leaves cancels the call at its next forward."""
        runtime = self._ready()
        body = decode_body(await self._read_body(request), emb.EmbeddingRequest)
        model, adapter = self._check_model(body.model)
        if adapter is not None:
            raise HttpError("invalid_request", f"`{body.model}` is a LoRA adapter; embeddings come from the base model", "model")
        emb.inputs_of(body)  # (its shape refused before waiting for anything)
        if model is None:
            emb.check_dimensions(body, runtime.model_info.embedding_size)
        got = await unless_disconnected(request.receive, lambda: emb.embed(runtime, body, model))
        if not got:
            return Response(status_code=CLIENT_LEFT)
        vectors, num_tokens = got[0]
        return Response(await anyio.to_thread.run_sync(emb.encode_response, body, vectors, num_tokens), media_type=JSON)

    async def tokenize(self, request: Request) -> Response:
        body = decode_body(await self._read_body(request), tokens.TokenizeRequest)
        limits = self._ready().config.limits
        tokens.check_sizes(body, limits)
        tokenizer, info = self._tokenizer(body.model)
        model = self._check_model(body.model)[0] if body.model is not None else None
        if (generate := tokens.image_request(body)) is not None:
            # Images: the prompt a chat request would run (each image expanded to its tokens).
            ids = await self._ready().prompt_token_ids(msgspec.structs.replace(generate, model=model))
            return json_response(tokens.token_response(tokenizer, ids, body, info.max_context, self._texts(model)))
        size, min_size = offload.text_size(body.prompt, body.messages, body.tools), self._ready().config.scheduler.bulk_tokenize_bytes
        # (A worker process decodes the token texts itself; the cache of them is this process's.)
        text = self._texts(model) if not min_size or size < min_size else None
        answer = await offload.run(tokenizer, tokens.tokenize_json, body, limits.max_tokenize_bytes, info.max_context, text, size=size, min_size=min_size)
        return Response(answer, media_type=JSON)

    async def detokenize(self, request: Request) -> Response:
        body = decode_body(await self._read_body(request), tokens.DetokenizeRequest)
        tokens.check_sizes(body, self._ready().config.limits)
        tokenizer, info = self._tokenizer(body.model)
        min_size = self._ready().config.scheduler.bulk_tokenize_bytes
        answer = await offload.run(tokenizer, tokens.detokenize_json, body, info.vocab_size, size=4 * len(body.tokens), min_size=min_size)
        return Response(answer, media_type=JSON)

    async def tokenizer_info(self, request: Request) -> Response:
        tokenizer, info = self._tokenizer(request.query_params.get("model"))
        return json_response(tokens.tokenizer_info(tokenizer, info.max_context, info.vocab_size))

    def _tokenizer(self, name: str | None) -> tuple[Any, ModelInfo]:
        """The tokenizer of the model `name` names (the default one when None), and the default
        model's figures (a pool's models share a vocabulary only by chance: their own tokenizer
        is used, their context is not reported)."""
        runtime = self._ready()
        model = self._check_model(name)[0] if name is not None else None
        try:
            return runtime.tokenizer_for(model), runtime.model_info
        except InternalError:
            raise HttpError("unavailable", f"the model `{name}` has not been loaded yet (its first request loads it)", "model") from None

    async def load_lora_adapter(self, request: Request) -> Response:
        body = decode_body(await self._read_body(request), oa.LoadLoraAdapterRequest)
        info = await self._adapter_updates().load_adapter(body.lora_name, body.lora_path)
        return json_response({"status": "ok", "adapter": info})

    async def unload_lora_adapter(self, request: Request) -> Response:
        body = decode_body(await self._read_body(request), oa.UnloadLoraAdapterRequest)
        await self._adapter_updates().unload_adapter(body.lora_name)
        return json_response({"status": "ok"})

    def _adapter_updates(self):
        runtime = self._ready()
        if not self.config.http_adapter_updates:
            raise HttpError("not_found", "runtime LoRA updates are off (server.http_adapter_updates)")
        return runtime

    # -- plumbing --------------------------------------------------------------------

    async def _respond(self, request: Request, runtime: Serving, generate: GenerateRequest, output: Output, *, endpoint: str) -> Response:
        """Submit, wait for the first event (a refusal is a JSON error with its status), then
        stream the rest or collect it; a client that leaves cancels the request."""
        stream = runtime.submit(generate)
        events = aiter(stream)
        headers = {"X-Request-Id": stream.request_id}
        try:
            got = await unless_disconnected(request.receive, lambda: anext(events))
            if not got:
                await close_stream(stream)
                return Response(status_code=CLIENT_LEFT)  # nobody reads it
            first = got[0]
            if output.stream:
                body = sse_body(stream, first, events, output, endpoint)
                return SseResponse(body, stall_s=self.config.client_stall_timeout_s, headers=headers)
            done = await unless_disconnected(request.receive, lambda: collect(first, events, output))
        except BaseException:
            await close_stream(stream)
            raise
        await close_stream(stream)
        return whole_response(done, output, headers)

    async def _respond_choices(
        self, request: Request, runtime: Serving, generates: list[GenerateRequest], outputs: list[Output], *, endpoint: str, include_usage: bool
    ) -> Response:
        """Several choices (`n`, or several prompts), each a request of its own, in one response
        or one stream. Each prompt is rendered first, so a bad one is refused before any starts."""
        if len(generates) == 1:
            return await self._respond(request, runtime, generates[0], outputs[0], endpoint=endpoint)
        # Each prompt rendered once: a bad one is refused before any choice starts.
        groups: dict[bytes, list[int]] = {}
        for i, generate in enumerate(generates):
            groups.setdefault(msgspec.json.encode(msgspec.structs.replace(generate, request_id=None, sampling=SamplingParams())), []).append(i)
        leaders: dict[int, GenerateRequest] = {}
        for members in groups.values():
            first = generates[members[0]]
            length = len(await runtime.prompt_token_ids(first))
            share = len(members) > 1 and runtime.config.kv.prefix_cache_bytes > 0 and first.snapshot_at is None and first.prompt_logprobs is None
            # The first choice keeps the prompt as a prefix once prefilled; the others start from it.
            leaders[members[0]] = msgspec.structs.replace(first, snapshot_at=length - 2) if share and length > 2 else first
        streams: list = []
        try:
            for generate in leaders.values():
                streams.append(runtime.submit(generate))
        except BaseException:
            for stream in streams:
                await close_stream(stream)
            raise
        order = list(leaders)
        followers = [(order.index(members[0]), partial(runtime.submit, generates[i])) for members in groups.values() for i in members[1:]]
        merged = Merged(streams, followers)
        output = Choices(outputs, [g.request_id or "" for g in generates], include_usage=include_usage)
        headers = {"X-Request-Id": merged.request_id}
        if output.stream:
            body = sse_body(merged, None, aiter(merged), output, endpoint)
            return SseResponse(body, stall_s=self.config.client_stall_timeout_s, headers=headers, background=merged.run)

        async def collect_all() -> bool:
            failure: list[Exception] = []  # (raised as itself, not in an exception group)
            async with anyio.create_task_group() as tg:
                tg.start_soon(merged.run)
                events = aiter(merged)
                try:
                    await collect(await anext(events), events, output)
                except Exception as exc:
                    failure.append(exc)
                tg.cancel_scope.cancel()
            if failure:
                raise failure[0]
            return True

        try:
            done = await unless_disconnected(request.receive, collect_all)
        finally:
            await close_stream(merged)
        return whole_response(done, output, headers)

    async def _read_body(self, request: Request) -> bytes:
        return await read_body(request, self.config.max_body_bytes, self.config.body_timeout_s)

    def _check_model(self, model: str) -> tuple[str | None, str | None]:
        """The model (None: the default) and LoRA adapter a request's `model` names: a model
        the runtime serves (several with `[[models]]`), or an adapter of the default model,
        served under its own name as vLLM does; an unknown name is refused."""
        runtime = self._ready()
        if model == self.model_name:
            return None, None
        if model in runtime.known_models():
            return model, None
        if model in runtime.known_adapters():
            return None, model
        served = ", ".join(f"`{name}`" for name in runtime.known_models())
        raise HttpError("model_not_found", f"the model `{model}` does not exist; this server serves {served}", "model")

    def _card(self, name: str, *, adapter: bool = False) -> oa.ModelCard:
        runtime = self._ready()
        return oa.ModelCard(id=name, created=self._created, max_model_len=runtime.model_info.max_context, parent=self.model_name if adapter else None)

    def _ids(self, prefix: str, generate: GenerateRequest, model: str) -> ResponseIds:
        return ResponseIds(id=f"{prefix}-{generate.request_id}", created=int(time.time()), model=model, fingerprint=self._fingerprint)

    def _texts(self, model: str | None) -> TokenTexts:
        """Token texts with the tokenizer of the model the request names (resolved when first
        needed: by then the request's model is loaded)."""
        if model not in self._token_texts:
            runtime = self._ready()
            self._token_texts[model] = TokenTexts(lambda: runtime.tokenizer_for(model))
        return self._token_texts[model]


# -- responses ---------------------------------------------------------------------


# -- the app -----------------------------------------------------------------------


def _endpoint(api: Api, handler: Callable[[Request], Awaitable[Response]], endpoint: str) -> Callable[[Request], Awaitable[Response]]:
    """Every refusal as the error JSON of the route's API (OpenAI's, Anthropic's under
    /v1/messages); a bug is a logged 500 that names no details."""

    async def run(request: Request) -> Response:
        try:
            return await handler(request)
        except (HttpError, MlxrtError) as exc:
            return error_response(error_of(exc, endpoint=endpoint), error_body_for(request.url.path))
        except ClientDisconnect:
            return Response(status_code=CLIENT_LEFT)  # the client left while sending its body
        except Exception:
            log.exception("http_request_failed", path=request.url.path)
            return error_response(HttpError("internal", "the request failed; the server log has the details"), error_body_for(request.url.path))

    return run


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
    response = error_response(HttpError(code, f"{exc.detail}: {request.method} {request.url.path}"), error_body_for(request.url.path))  # type: ignore[arg-type]
    response.headers.update(exc.headers or {})  # a 405's `Allow`
    return response


def build_app(api: Api) -> Starlette:
    routes = [
        Route("/v1/chat/completions", _endpoint(api, api.chat_completions, "chat"), methods=["POST"]),
        Route("/v1/completions", _endpoint(api, api.completions, "completions"), methods=["POST"]),
        Route("/v1/messages", _endpoint(api, api.messages, "messages"), methods=["POST"]),
        Route("/v1/messages/count_tokens", _endpoint(api, api.count_tokens, "messages"), methods=["POST"]),
        Route("/v1/responses", _endpoint(api, api.create_response, "responses"), methods=["POST"]),
        Route("/v1/responses/{response_id}", _endpoint(api, api.get_response, "responses"), methods=["GET"]),
        Route("/v1/responses/{response_id}", _endpoint(api, api.delete_response, "responses"), methods=["DELETE"]),
        Route("/v1/models", _endpoint(api, api.models, "models"), methods=["GET"]),
        Route("/v1/models/{model:path}", _endpoint(api, api.model, "models"), methods=["GET"]),
        Route("/v1/load_lora_adapter", _endpoint(api, api.load_lora_adapter, "adapters"), methods=["POST"]),
        Route("/v1/unload_lora_adapter", _endpoint(api, api.unload_lora_adapter, "adapters"), methods=["POST"]),
        Route("/v1/embeddings", _endpoint(api, api.embeddings, "embeddings"), methods=["POST"]),
        Route("/tokenize", _endpoint(api, api.tokenize, "tokenize"), methods=["POST"]),
        Route("/detokenize", _endpoint(api, api.detokenize, "tokenize"), methods=["POST"]),
        Route("/tokenizer_info", _endpoint(api, api.tokenizer_info, "tokenize"), methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", _endpoint(api, api.metrics, "metrics"), methods=["GET"]),
    ]
    config = api.config
    # Outermost first: count every response, pace each client, refuse what a browser page must not
    # send, refuse past the request limit, answer CORS preflights, then check the key.
    middleware = [
        Middleware(ResponseCounter, counter=api.responses, model_name=api.model_name),
        Middleware(ClientPacing, config=config, held=api.held_answers),
        Middleware(BrowserGuard, allowed_hosts=api.allowed_hosts, json_only=not (config.api_key or config.api_keys)),
        Middleware(RequestLimit, limit=config.http_max_connections),
    ]
    if config.cors_origins:
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=config.cors_origins,
                allow_methods=["GET", "POST", "DELETE"],
                allow_headers=["Authorization", "Content-Type", "x-api-key", "anthropic-version"],
            )
        )
    if config.api_key or config.api_keys:
        middleware.append(Middleware(Authorization, api_keys=[config.api_key, *config.api_keys]))
    return Starlette(routes=routes, middleware=middleware, exception_handlers={HTTPException: _http_exception})
