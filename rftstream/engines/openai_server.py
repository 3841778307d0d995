"""An OpenAI-compatible HTTP API for a :class:`~rftstream.engines.model_wrapper.ModelWrapper`.

:class:`OpenAIServer` serves ``/v1/chat/completions``, ``/v1/completions``,
``/v1/models`` and ``/health`` on a free loopback port with ``aiohttp``. Every
request goes to the wrapper's rollout engine, so concurrent HTTP requests are
batched together with the workflows' ``model.chat()`` calls, and (with
``enable_history``) every completion it serves is recorded as an
:class:`~rftstream.experience.Experience`.

Where it runs: on an asyncio event loop the server lives ON the engine's loop
(no extra thread; a workflow's worker thread that blocks on a synchronous
``openai.OpenAI`` request never blocks the loop, which serves it). Under any
other anyio backend (trio) aiohttp runs on its own asyncio loop in a daemon
thread, and each request is handed to the engine's loop with
``anyio.from_thread.run``. Either way all engine work happens on the engine's
loop.

Sessions: ``/v1/...`` is served by the wrapper that created the server;
``/s/<session>/v1/...`` by one of its :meth:`ModelWrapper.clone` views, so the
history of each workflow stays its own (the runner gives every workflow a
clone when history is on).

The wire format (request parsing, message normalisation, tool-call parsing,
response bodies) is pure, in :mod:`rftstream.engines.openai_protocol`. The server
serves any :class:`ServedModel` (a wrapper and its clones) and does not import the
wrapper's module: the wrapper starts its server.

Request fields understood, beyond the usual ``n``, ``temperature``,
``top_p``, ``max_tokens`` / ``max_completion_tokens``, ``stop``, ``seed``:
chat ``logprobs`` + ``top_logprobs``, ``tools`` / ``tool_choice`` (``"none"``
disables them), ``stream`` (the whole completion is generated, then sent as
server-sent events), ``stream_options.include_usage``; completions
``logprobs: int``, ``echo``, prompts as text, token ids or lists of either;
vLLM's extensions ``top_k``, ``stop_token_ids``, ``chat_template`` (a Jinja
template for this request), ``chat_template_kwargs``,
``return_token_ids`` (adds ``prompt_token_ids`` / ``token_ids``) and
``return_tokens_as_token_ids`` (logprob tokens as ``"token_id:<id>"``). Other
fields (penalties, ``user``, ...) are ignored. Defaults: ``max_tokens`` is the
wrapper's ``max_response_tokens`` for chat and 16 for completions (as
OpenAI); ``temperature`` is the wrapper's ``default_temperature`` (1.0).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread

from rftstream.engines.base import RolloutEngine, SamplingParams
from rftstream.engines.openai_protocol import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    MAX_TOP_LOGPROBS,
    ApiError,
    chat_logprobs,
    completion_logprobs,
    sampling_from_request,
    sse_chat_chunks,
    sse_completion_chunks,
)
from rftstream.errors import RftError
from rftstream.experience import Experience

log = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = ["OpenAIServer", "ServedModel"]


class ServedModel(Protocol):
    """What the server uses of a :class:`~rftstream.engines.model_wrapper.ModelWrapper`
    (the root wrapper or a session clone); the wrapper implements it and starts the server."""

    engine: RolloutEngine
    model_path: str
    served_model_name: str
    session_id: str
    max_response_tokens: int
    default_temperature: float

    @property
    def tokenizer(self) -> Any: ...

    @property
    def _tok_lock(self) -> contextlib.AbstractContextManager[Any]: ...

    async def _chat_for_api(
        self,
        messages: Any,
        params: SamplingParams,
        *,
        tools: list[dict[str, Any]] | None,
        template_kwargs: dict[str, Any],
        chat_template: str | None = None,
    ) -> tuple[list[int], list[Experience]]: ...

    async def _complete_for_api(
        self, prompts: list[str | list[int]], params: SamplingParams
    ) -> list[tuple[str, list[int], list[Experience]]]: ...


# ---------------------------------------------------------------------------
# Request handling (runs on the engine's event loop)
# ---------------------------------------------------------------------------


async def _tokenizing(
    wrapper: ServedModel, size: int, fn: Callable[..., T], *args: Any, **kw: Any
) -> T:
    """``fn(*args, **kw)`` under the wrapper's tokenizer lock; in a worker thread when large."""

    def call() -> T:
        with wrapper._tok_lock:
            return fn(*args, **kw)

    if size > 2048:
        return await anyio.to_thread.run_sync(call)
    return call()


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _top_count(value: Any, param: str) -> int:
    if value is None or value is False:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ApiError(f"`{param}` must be a non-negative integer, got {value!r}", param=param)
    if value > MAX_TOP_LOGPROBS:
        raise ApiError(f"`{param}` must be at most {MAX_TOP_LOGPROBS}", param=param)
    return int(value)


async def handle_chat(wrapper: ServedModel, body: dict[str, Any]) -> dict[str, Any]:
    """Serve one ``/v1/chat/completions`` body with ``wrapper``; returns the response body."""
    params = sampling_from_request(
        body,
        default_max_tokens=wrapper.max_response_tokens,
        default_temperature=wrapper.default_temperature,
    )
    tools = body.get("tools") or None
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    ):
        raise ApiError("`tools` must be a list of objects", param="tools")
    if body.get("tool_choice") == "none":
        tools = None
    template_kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(template_kwargs, dict):
        raise ApiError("`chat_template_kwargs` must be an object", param="chat_template_kwargs")
    chat_template = body.get("chat_template")
    if chat_template is not None and not isinstance(chat_template, str):
        raise ApiError("`chat_template` must be a string", param="chat_template")
    want_logprobs = bool(body.get("logprobs"))
    top = _top_count(body.get("top_logprobs"), "top_logprobs") if want_logprobs else 0
    as_ids = bool(body.get("return_tokens_as_token_ids"))
    prompt_ids, exps = await wrapper._chat_for_api(
        body.get("messages"),
        params,
        tools=tools,
        template_kwargs=template_kwargs,
        chat_template=chat_template or None,
    )
    choices = []
    completion_tokens = 0
    for i, exp in enumerate(exps):
        resp_ids = exp.tokens[exp.prompt_length :].tolist()
        completion_tokens += len(resp_ids)
        reply = exp.messages[-1] if exp.messages else {"content": exp.response_text}
        message: dict[str, Any] = {
            "role": "assistant",
            "content": exp.response_text,
            "refusal": None,
        }
        finish = exp.info.get("finish_reason", "stop")
        if reply.get("tool_calls"):
            message["content"] = reply.get("content")
            message["tool_calls"] = reply["tool_calls"]
            finish = "tool_calls" if finish == "stop" else finish
        choice: dict[str, Any] = {"index": i, "message": message, "finish_reason": finish}
        choice["logprobs"] = None
        if want_logprobs:
            alts = None
            if top > 0:
                scores = await wrapper.engine.score(
                    exp.tokens.tolist(),
                    start=exp.prompt_length,
                    temperature=params.temperature,
                    top_logprobs=top,
                )
                alts = scores.top_logprobs
            choice["logprobs"] = await _tokenizing(
                wrapper,
                len(resp_ids) * (1 + top),
                chat_logprobs,
                wrapper.tokenizer,
                resp_ids,
                exp.logprobs.tolist(),
                alts,
                as_ids=as_ids,
            )
        if body.get("return_token_ids"):
            choice["token_ids"] = resp_ids
        choices.append(choice)
    out: dict[str, Any] = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": wrapper.served_model_name,
        "choices": choices,
        "usage": _usage(len(prompt_ids), completion_tokens),
    }
    if body.get("return_token_ids"):
        out["prompt_token_ids"] = list(prompt_ids)
    return out


def _prompts_of(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise ApiError(
        "`prompt` must be a string, a list of strings, a list of token ids or a list of those",
        param="prompt",
    )


async def handle_completion(wrapper: ServedModel, body: dict[str, Any]) -> dict[str, Any]:
    """Serve one ``/v1/completions`` body with ``wrapper``; returns the response body."""
    params = sampling_from_request(
        body,
        default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS,
        default_temperature=wrapper.default_temperature,
    )
    prompts = _prompts_of(body.get("prompt"))
    k = _top_count(body.get("logprobs"), "logprobs")
    want_logprobs = body.get("logprobs") is not None and body.get("logprobs") is not False
    echo = bool(body.get("echo"))
    as_ids = bool(body.get("return_tokens_as_token_ids"))
    tok = wrapper.tokenizer
    results = await wrapper._complete_for_api(prompts, params)
    choices = []
    prompt_total = completion_total = 0
    for p_index, (prompt_text, prompt_ids, exps) in enumerate(results):
        prompt_total += len(prompt_ids)
        prompt_scores = None
        if echo and want_logprobs:
            prompt_scores = await wrapper.engine.score(
                prompt_ids, start=1, temperature=params.temperature, top_logprobs=k
            )
        for j, exp in enumerate(exps):
            resp_ids = exp.tokens[exp.prompt_length :].tolist()
            completion_total += len(resp_ids)
            text = exp.response_text or ""
            choice: dict[str, Any] = {
                "index": p_index * params.n + j,
                "text": (prompt_text + text) if echo else text,
                "logprobs": None,
                "finish_reason": exp.info.get("finish_reason", "stop"),
            }
            if want_logprobs:
                ids = list(resp_ids)
                lps: list[float | None] = list(exp.logprobs.tolist())
                alts: list[Any] | None = None
                if k > 0:
                    scores = await wrapper.engine.score(
                        exp.tokens.tolist(),
                        start=exp.prompt_length,
                        temperature=params.temperature,
                        top_logprobs=k,
                    )
                    alts = list(scores.top_logprobs or [])
                if echo and prompt_scores is not None:
                    ids = list(prompt_ids) + ids
                    lps = [None, *prompt_scores.logprobs, *lps]
                    if alts is not None:
                        alts = [None, *(prompt_scores.top_logprobs or []), *alts]
                choice["logprobs"] = await _tokenizing(
                    wrapper,
                    len(ids) * (1 + k),
                    completion_logprobs,
                    tok,
                    ids,
                    lps,
                    alts,
                    as_ids=as_ids,
                )
            if body.get("return_token_ids"):
                choice["token_ids"] = resp_ids
                choice["prompt_token_ids"] = list(prompt_ids)
            choices.append(choice)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": wrapper.served_model_name,
        "choices": choices,
        "usage": _usage(prompt_total, completion_total),
    }


def models_body(wrapper: ServedModel) -> dict[str, Any]:
    """The ``/v1/models`` body: the one served model (``id`` = its served name)."""
    entry: dict[str, Any] = {
        "id": wrapper.served_model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "rftstream",
        "root": wrapper.model_path,
        "parent": None,
    }
    max_len = getattr(wrapper.engine, "max_model_len", None)
    if isinstance(max_len, int) and max_len < 1 << 30:
        entry["max_model_len"] = max_len
    return {"object": "list", "data": [entry]}


# ---------------------------------------------------------------------------
# The server
# ---------------------------------------------------------------------------


class OpenAIServer:
    """The HTTP server of one model (a root wrapper and its session clones). See the module docstring.

    :meth:`bind` (sync, idempotent) reserves the loopback port, so clients can
    be built before :meth:`start` (async, idempotent, must run on the
    engine's event loop) begins to serve it; connections made in between wait
    in the listen backlog. :meth:`aclose` stops serving.
    """

    def __init__(self, root: ServedModel, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.root = root
        self.host = host
        self._port = int(port)
        self._sock: socket.socket | None = None
        self._sessions: weakref.WeakValueDictionary[str, ServedModel] = (
            weakref.WeakValueDictionary()
        )
        self._bind_lock = threading.Lock()
        self._ready: anyio.Event | None = None
        self._start_error: BaseException | None = None
        self.started = False
        self.closed = False
        self._mode = ""  # "loop" (aiohttp on the engine's asyncio loop) or "thread"
        self._runner: Any = None
        self._token: Any = None
        self._thread: threading.Thread | None = None
        self._thread_loop: asyncio.AbstractEventLoop | None = None
        self._thread_stop: asyncio.Future[None] | None = None
        self._bridge: concurrent.futures.ThreadPoolExecutor | None = None
        self.requests = 0

    # ------------------------------------------------------------ addresses
    @property
    def port(self) -> int:
        self.bind()
        return self._port

    @property
    def url(self) -> str:
        """``http://host:port`` (no path)."""
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI ``base_url`` of the root wrapper: ``http://host:port/v1``."""
        return f"{self.url}/v1"

    def register(self, wrapper: ServedModel) -> str:
        """The ``base_url`` of ``wrapper``: ``/v1`` for the root, ``/s/<session>/v1`` for a clone."""
        if wrapper is self.root:
            return self.base_url
        self._sessions[wrapper.session_id] = wrapper
        return f"{self.url}/s/{wrapper.session_id}/v1"

    def bind(self) -> None:
        """Bind and listen on the port (blocking but instant; idempotent)."""
        with self._bind_lock:
            if self._sock is not None:
                return
            if self.closed:
                raise RftError("the OpenAI API server is closed")
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((self.host, self._port))
            except OSError as exc:
                sock.close()
                raise RftError(
                    f"cannot bind the OpenAI API server to {self.host}:{self._port}: {exc}"
                ) from exc
            sock.listen(1024)
            sock.setblocking(False)
            self._sock = sock
            self._port = int(sock.getsockname()[1])

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Serve the bound port (idempotent). Call it on the engine's event loop.

        On asyncio the aiohttp site is started on this loop and this returns at
        once; on other backends a daemon thread with its own asyncio loop is
        started first (waits for it in a worker thread).
        """
        if self._ready is not None:
            await self._ready.wait()
            if self._start_error is not None:
                raise RftError(f"the OpenAI API server failed to start: {self._start_error}")
            return
        self._ready = anyio.Event()
        try:
            self.bind()
            self._token = anyio.lowlevel.current_token()
            if _on_asyncio():
                self._mode = "loop"
                self._runner = await _start_site(self._app(), self._sock)
            else:
                self._mode = "thread"
                self._bridge = concurrent.futures.ThreadPoolExecutor(
                    max_workers=256, thread_name_prefix="rft-openai-bridge"
                )
                await anyio.to_thread.run_sync(self._start_thread)
            self.started = True
            log.info("OpenAI API of %s on %s", self.root.model_path, self.base_url)
        except BaseException as exc:
            self._start_error = exc
            raise
        finally:
            self._ready.set()

    async def aclose(self) -> None:
        """Stop serving and release the port (idempotent). In-flight requests are dropped."""
        self.closed = True
        if self._runner is not None:
            runner, self._runner = self._runner, None
            with anyio.CancelScope(shield=True):
                await runner.cleanup()
        if self._thread is not None and self._thread_loop is not None:
            loop, stop = self._thread_loop, self._thread_stop
            if stop is not None:
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(lambda: stop.done() or stop.set_result(None))
            thread, self._thread = self._thread, None
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(thread.join, 10.0)
        if self._bridge is not None:
            self._bridge.shutdown(wait=False, cancel_futures=True)
            self._bridge = None
        with self._bind_lock:
            if self._sock is not None:
                with contextlib.suppress(OSError):
                    self._sock.close()
                self._sock = None
        self.started = False

    def _start_thread(self) -> None:
        ready = threading.Event()
        errors: list[BaseException] = []

        async def main() -> None:
            loop = asyncio.get_running_loop()
            self._thread_loop = loop
            self._thread_stop = loop.create_future()
            try:
                runner = await _start_site(self._app(), self._sock)
            except BaseException as exc:
                errors.append(exc)
                ready.set()
                raise
            ready.set()
            try:
                await self._thread_stop
            finally:
                await runner.cleanup()

        def target() -> None:
            with contextlib.suppress(BaseException):
                asyncio.run(main())
            ready.set()

        self._thread = threading.Thread(target=target, name="rft-openai-server", daemon=True)
        self._thread.start()
        ready.wait(30.0)
        if errors:
            raise errors[0]
        if not ready.is_set():
            raise RftError("the OpenAI API server thread did not start within 30 s")

    # ------------------------------------------------------------ HTTP
    def _app(self) -> Any:
        from aiohttp import web

        app = web.Application(client_max_size=64 * 1024 * 1024)
        for prefix in ("", "/s/{session}"):
            app.router.add_post(f"{prefix}/v1/chat/completions", self._chat)
            app.router.add_post(f"{prefix}/v1/completions", self._completions)
            app.router.add_get(f"{prefix}/v1/models", self._models)
        app.router.add_get("/health", self._health)
        return app

    def _wrapper(self, request: Any) -> ServedModel:
        sid = request.match_info.get("session")
        if sid is None:
            return self.root
        wrapper = self._sessions.get(sid)
        if wrapper is None:
            raise ApiError(f"unknown session {sid!r}", status=404, type="not_found_error")
        return wrapper

    async def _on_engine_loop(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``fn(*args)`` on the engine's loop (directly when the server lives there)."""
        if self._mode == "loop":
            return await fn(*args)
        loop = asyncio.get_running_loop()
        call = lambda: anyio.from_thread.run(fn, *args, token=self._token)  # noqa: E731
        return await loop.run_in_executor(self._bridge, call)

    async def _json_response(
        self, request: Any, handler: Callable[[ServedModel, dict[str, Any]], Awaitable[Any]]
    ) -> Any:
        from aiohttp import web

        self.requests += 1
        try:
            wrapper = self._wrapper(request)
            try:
                body = await request.json()
            except (ValueError, UnicodeDecodeError) as exc:
                raise ApiError(f"the request body is not valid JSON: {exc}") from exc
            if not isinstance(body, dict):
                raise ApiError("the request body must be a JSON object")
            if getattr(wrapper.engine, "_closed", False):
                raise ApiError("the rollout engine is closed", status=503, type="server_error")
            result = await self._on_engine_loop(handler, wrapper, body)
        except ApiError as exc:
            return web.json_response(exc.body(), status=exc.status)
        except RftError as exc:
            return web.json_response(ApiError(str(exc)).body(), status=400)
        except Exception as exc:  # noqa: BLE001 - reported to the client
            log.exception("OpenAI API request failed")
            err = ApiError(f"{type(exc).__name__}: {exc}", status=500, type="server_error")
            return web.json_response(err.body(), status=500)
        if not body.get("stream"):
            return web.json_response(result)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        chunks = (
            sse_chat_chunks(result, include_usage)
            if result["object"] == "chat.completion"
            else sse_completion_chunks(result, include_usage)
        )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in chunks:
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _chat(self, request: Any) -> Any:
        return await self._json_response(request, handle_chat)

    async def _completions(self, request: Any) -> Any:
        return await self._json_response(request, handle_completion)

    async def _models(self, request: Any) -> Any:
        from aiohttp import web

        try:
            wrapper = self._wrapper(request)
        except ApiError as exc:
            return web.json_response(exc.body(), status=exc.status)
        return web.json_response(models_body(wrapper))

    async def _health(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"status": "ok"})


def _on_asyncio() -> bool:
    import sniffio

    try:
        return sniffio.current_async_library() == "asyncio"
    except sniffio.AsyncLibraryNotFoundError:
        return False


async def _start_site(app: Any, sock: socket.socket | None) -> Any:
    from aiohttp import web

    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.SockSite(runner, sock, shutdown_timeout=0.5)
    await site.start()
    return runner
