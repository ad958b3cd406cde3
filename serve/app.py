"""An OpenAI-compatible HTTP server over `Model` (FastAPI + uvicorn).

/v1/models, /v1/chat/completions and /v1/completions, streamed as server-sent events or not.
Each worker is one `Model` (a Model generates one sequence at a time) on its share of the
cores; a request waits for a free worker in a bounded queue and gets 429 when the queue is
full. Generation runs on a thread and hands its text pieces to the event loop; a client that
disconnects mid-stream stops it at the next piece, which frees the worker. Bad requests get
OpenAI-style error JSON (400, 404, 422, 429), never a 500 with a stack trace.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import threading
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field

from dflash.runtime import Model


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def error_response(status: int, message: str, kind: str = "invalid_request_error", param=None, headers=None):
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(body, status_code=status, headers=headers)


class Sampling(BaseModel):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    drafter: str | None = None  # extra field: this request's drafter ("none" for plain decoding)


class Message(BaseModel):
    role: str
    content: str


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)


class CompletionRequest(Sampling):
    prompt: str


class Workers:
    """Models waiting for requests, and a bounded count of requests waiting for a model."""

    def __init__(self, models: list[Model], max_waiting: int):
        self.free: asyncio.Queue[Model] = asyncio.Queue()
        for model in models:
            self.free.put_nowait(model)
        self.max_waiting, self.waiting = max_waiting, 0

    async def acquire(self) -> Model:
        if self.free.empty() and self.waiting >= self.max_waiting:
            raise ApiError(429, f"all workers are busy and {self.waiting} requests are waiting; retry shortly",
                           "rate_limit_error")
        self.waiting += 1
        try:
            return await self.free.get()
        finally:
            self.waiting -= 1

    def release(self, model: Model) -> None:
        self.free.put_nowait(model)


class Run:
    """One generation on a thread: its pieces arrive on an asyncio queue; `cancel()` stops it
    after the piece being decoded. The worker goes back to the pool when the thread ends,
    whatever happened to the request (a callback: a cancelled request cannot await it)."""

    DONE = object()
    AHEAD = 4  # pieces decoded ahead of a client that reads slowly (then decoding waits)

    def __init__(self, workers: Workers, model: Model, generation):
        self.loop = asyncio.get_running_loop()
        self.pieces: asyncio.Queue = asyncio.Queue(self.AHEAD)
        self.cancelled = threading.Event()
        self.generation = generation
        self.thread = self.loop.run_in_executor(None, self._run)
        self.thread.add_done_callback(lambda _: workers.release(model))

    @classmethod
    async def start(cls, workers: Workers, kwargs: dict) -> "Run":
        model = await workers.acquire()
        try:  # on a thread: the first use of a drafter measures the verify cost
            generation = await asyncio.get_running_loop().run_in_executor(None, lambda: model.stream(**kwargs))
        except ValueError as e:  # the runtime's message names the problem and the fix
            workers.release(model)
            raise ApiError(400, str(e)) from None
        except BaseException:
            workers.release(model)
            raise
        return cls(workers, model, generation)

    def _run(self) -> None:
        try:
            for piece in self.generation:
                if not self._put(piece):
                    break  # cancelled: leaving the loop closes the generation and frees the model
            else:
                self._put(self.DONE)
        except Exception as e:  # reported to the client as a failed generation
            self._put(e)

    def _put(self, item) -> bool:
        """Hand `item` to the event loop, waiting while the client is behind; False once cancelled."""
        future = asyncio.run_coroutine_threadsafe(self.pieces.put(item), self.loop)
        while True:
            try:
                future.result(timeout=0.05)
                return not self.cancelled.is_set()
            except concurrent.futures.TimeoutError:
                if self.cancelled.is_set():
                    future.cancel()
                    return False

    async def __aiter__(self):
        while True:
            piece = await self.pieces.get()
            if piece is self.DONE:
                return
            if isinstance(piece, Exception):
                raise piece
            yield piece

    def cancel(self) -> None:
        self.cancelled.set()

    @property
    def result(self):
        return self.generation.result


def create_app(bundle: str | Path, drafter: str | None = None, workers: int = 1, max_waiting: int = 8,
               threads: int | None = None, answer_memory: int = 0) -> FastAPI:
    """The app: `workers` Models of `bundle`, each on `threads` cores (default: the cores split
    among the workers) with `answer_memory` (see Model); `drafter` is the default for requests
    that name none."""
    cores = threads or max(1, (os.cpu_count() or 1) // workers)
    models = [Model(bundle, threads=cores, answer_memory=answer_memory) for _ in range(workers)]
    model_id = Path(bundle).resolve().name
    if drafter and drafter not in models[0].drafters:
        raise ValueError(f"{bundle} has no drafter {drafter!r} (it has: {', '.join(models[0].drafters)})")
    state: dict = {}

    @asynccontextmanager
    async def lifespan(app):
        state["workers"] = Workers(models, max_waiting)
        yield

    app = FastAPI(title="dflash-serve", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        headers = {"Retry-After": "1"} if e.status == 429 else None
        return error_response(e.status, e.message, e.kind, e.param, headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, e: RequestValidationError):
        errors = e.errors()
        if any(err.get("type") == "json_invalid" for err in errors):
            return error_response(400, "the request body is not valid JSON")
        first = errors[0]
        where = ".".join(str(p) for p in first.get("loc", ())[1:])
        return error_response(422, f"{where}: {first.get('msg')}", param=where or None)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": 0, "owned_by": "dflash-ort",
                                            "drafters": models[0].drafters}]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest):
        return await respond(body, {"messages": [m.model_dump() for m in body.messages]}, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        return await respond(body, {"prompt": body.prompt}, chat=False)

    async def respond(body: Sampling, inputs: dict, chat: bool):
        if body.model != model_id:
            raise ApiError(404, f"model {body.model!r} does not exist; this server has {model_id!r}", param="model")
        kwargs = dict(inputs, max_new_tokens=body.max_tokens or 256, temperature=body.temperature,
                      top_p=body.top_p, seed=body.seed, stop=body.stop,
                      drafter=None if body.drafter == "none" else (body.drafter or drafter))
        meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", "created": int(time.time()),
                "model": model_id}
        run = await Run.start(state["workers"], kwargs)
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(stream_events(run, meta, chat, include_usage), media_type="text/event-stream")
        try:
            text = "".join([piece async for piece in run])
        finally:
            run.cancel()  # a no-op once it has finished; stops it if this request was cancelled
        return completion_body(meta, run.result, text, chat)

    return app


def completion_body(meta: dict, result, text: str, chat: bool) -> dict:
    finish = "length" if result.finish_reason == "length" else "stop"
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish} if chat
              else {"index": 0, "text": text, "finish_reason": finish, "logprobs": None})
    return {**meta, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
            "usage": usage(result), "dflash": stats(result)}


def usage(result) -> dict:
    s = result.stats
    return {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.new_tokens,
            "total_tokens": s.prompt_tokens + s.new_tokens}


def stats(result) -> dict:
    """Speed figures, in a field OpenAI clients ignore."""
    s = result.stats
    return {"tokens_per_s": round(s.decode_tokens_per_s, 2), "tokens_per_target_call": round(s.mean_accept_len, 3)}


async def stream_events(run: Run, meta: dict, chat: bool, include_usage: bool):
    """Server-sent events: one chunk per text piece, a last chunk with the finish reason, then
    [DONE]. The worker is released when the generation has stopped, even if the client left."""
    kind = "chat.completion.chunk" if chat else "text_completion"

    def event(choice: dict, **extra) -> str:
        return "data: " + json.dumps({**meta, "object": kind, "choices": [choice], **extra}) + "\n\n"

    def piece_choice(text: str) -> dict:
        return ({"index": 0, "delta": {"content": text}, "finish_reason": None} if chat
                else {"index": 0, "text": text, "finish_reason": None})

    try:
        if chat:
            yield event({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
        try:
            async for piece in run:
                yield event(piece_choice(piece))
        except Exception as e:
            yield "data: " + json.dumps({"error": {"message": f"generation failed: {e}", "type": "server_error",
                                                   "param": None, "code": None}}) + "\n\n"
            return
        finish = "length" if run.result.finish_reason == "length" else "stop"
        last = {"index": 0, "delta": {}, "finish_reason": finish} if chat else \
            {"index": 0, "text": "", "finish_reason": finish}
        yield event(last, dflash=stats(run.result), **({"usage": usage(run.result)} if include_usage else {}))
        yield "data: [DONE]\n\n"
    finally:  # also when the client disconnects: the generation stops at its next piece
        run.cancel()
