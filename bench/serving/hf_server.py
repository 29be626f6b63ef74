"""A plain transformers model behind the OpenAI API: the baseline a user would hand-roll.

It exists so that benchmarks can put pdserve beside the simplest server that
works. One engine thread runs static batches: it takes up to --max-batch-size
queued requests (waiting --batch-wait-ms for more to arrive), left-pads them and
decodes them together with a KV cache, token by token, until every request of
the batch is done; only then does the next batch start. The asyncio front
(FastAPI on uvicorn) tokenizes, streams tokens as they come and detokenizes.

    python -m bench.serving.hf_server --model DIR --dtype float32 --max-batch-size 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


class BadRequest(Exception):
    """A request the server refuses, with the HTTP status and OpenAI error fields."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param


@dataclass
class Job:
    """One request on its way through the engine thread."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    ignore_eos: bool
    seed: int | None
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False  # set by the front on disconnect or stop string
    num_generated: int = 0  # tokens received by the front

    def emit(self, kind: str, value: Any) -> None:
        """Hand ("token", id) / ("done", reason) / ("error", msg) to the front's event loop."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


class Engine:
    """A model and the thread that runs its static batches."""

    def __init__(self, model, pad_id: int, eos_ids: set[int], max_batch: int, wait_s: float):
        self.model, self.pad_id, self.eos_ids = model, pad_id, eos_ids
        self.max_batch, self.wait_s = max_batch, wait_s
        self.pending: queue.Queue[Job] = queue.Queue()
        threading.Thread(target=self._serve, name="hf-engine", daemon=True).start()

    def _serve(self) -> None:
        while True:
            batch = self._next_batch()
            try:
                with torch.inference_mode():
                    self._run(batch)
            except Exception as error:  # a bug or OOM: fail this batch, keep serving
                for job in batch:
                    job.emit("error", f"{type(error).__name__}: {error}")

    def _next_batch(self) -> list[Job]:
        batch = [self.pending.get()]
        deadline = time.monotonic() + self.wait_s
        while len(batch) < self.max_batch:
            try:
                batch.append(self.pending.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                break
        return batch

    def _run(self, batch: list[Job]) -> None:
        width = max(len(j.prompt_ids) for j in batch)
        ids = torch.tensor(
            [[self.pad_id] * (width - len(j.prompt_ids)) + j.prompt_ids for j in batch]
        )
        mask = torch.tensor(
            [[0] * (width - len(j.prompt_ids)) + [1] * len(j.prompt_ids) for j in batch]
        )
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [batch, width]
        gens = [_generator(j.seed) for j in batch]
        counts = [0] * len(batch)
        done = [False] * len(batch)
        cache = None
        while not all(done):
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            cache = out.past_key_values
            logits = out.logits[:, -1, :].float()  # [batch, vocab]
            next_ids = [self.pad_id] * len(batch)
            for i, job in enumerate(batch):
                if done[i] or job.cancelled:
                    done[i] = True
                    continue
                next_ids[i] = self._sample(logits[i], job, gens[i])
                counts[i] += 1
                job.emit("token", next_ids[i])
                if not job.ignore_eos and next_ids[i] in self.eos_ids:
                    done[i] = True
                    job.emit("done", "stop")
                elif counts[i] >= job.max_tokens:
                    done[i] = True
                    job.emit("done", "length")
            ids = torch.tensor(next_ids).unsqueeze(1)  # [batch, 1]
            mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
            positions = positions[:, -1:] + 1

    @staticmethod
    def _sample(logits: torch.Tensor, job: Job, gen: torch.Generator) -> int:
        if job.temperature == 0:
            return int(logits.argmax())
        probs = torch.softmax(logits / job.temperature, dim=-1)
        if job.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # Keep the smallest prefix whose mass reaches top_p (always the top token).
            drop = sorted_probs.cumsum(-1) - sorted_probs >= job.top_p
            probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
        return int(torch.multinomial(probs, 1, generator=gen))


def _generator(seed: int | None) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed(seed) if seed is not None else gen.seed()
    return gen


class Front:
    """Turns OpenAI requests into jobs, and job events into OpenAI responses."""

    def __init__(self, engine: Engine, tokenizer, name: str, max_len: int) -> None:
        self.engine, self.tokenizer, self.name, self.max_len = engine, tokenizer, name, max_len

    def prompt_ids(self, body: dict[str, Any], chat: bool) -> list[int]:
        """The prompt's token ids: chat messages through the chat template, or the prompt."""
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest("messages must be a non-empty list", param="messages")
            if not self.tokenizer.chat_template:
                raise BadRequest("this model has no chat template; use /v1/completions")
            try:
                text = self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=False
                )
            except Exception as error:
                raise BadRequest(f"bad messages: {error}", param="messages") from error
            return self.tokenizer.encode(text, add_special_tokens=False)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            if not all(0 <= t < len(self.tokenizer) for t in prompt):
                raise BadRequest("prompt token id out of the vocabulary", param="prompt")
            return prompt
        raise BadRequest("prompt must be one non-empty string or token id list", param="prompt")

    def job(self, body: dict[str, Any], chat: bool) -> Job:
        """A validated job for ``body``."""
        if body.get("model") != self.name:
            raise BadRequest(f"model {body.get('model')!r} not served; use {self.name!r}", 404)
        ids = self.prompt_ids(body, chat)
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        max_tokens = self.max_len - len(ids) if max_tokens is None else max_tokens
        temperature = _or_default(body.get("temperature"), 1.0)
        top_p = _or_default(body.get("top_p"), 1.0)
        seed = body.get("seed")
        _check(isinstance(max_tokens, int) and max_tokens >= 1, "max_tokens must be >= 1")
        _check(len(ids) + max_tokens <= self.max_len, f"prompt + max_tokens > {self.max_len}")
        _check(isinstance(temperature, int | float) and temperature >= 0, "temperature >= 0")
        _check(isinstance(top_p, int | float) and 0 < top_p <= 1, "top_p must be in (0, 1]")
        _check(seed is None or isinstance(seed, int), "seed must be an integer")
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        _check(
            isinstance(stop, list) and all(isinstance(s, str) for s in stop),
            "stop must be a string or a list of strings",
        )
        return Job(
            ids,
            max_tokens,
            float(temperature),
            float(top_p),
            bool(body.get("ignore_eos", False)),
            seed,
            [s for s in stop if s],
            asyncio.get_running_loop(),
        )

    async def texts(self, job: Job):
        """Yield (text delta, finish reason or None); the last item has the reason."""
        self.engine.pending.put(job)
        ids: list[int] = []
        sent = text = ""
        try:
            while True:
                kind, value = await job.events.get()
                if kind == "error":
                    raise RuntimeError(value)
                if kind == "done":
                    yield text[len(sent) :], value
                    return
                ids.append(value)
                job.num_generated += 1
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                cut = min((i for i in (text.find(s) for s in job.stop) if i >= 0), default=-1)
                if cut >= 0:
                    job.cancelled = True
                    yield text[len(sent) : max(cut, len(sent))], "stop"
                    return
                if not text.endswith("\ufffd"):  # hold back a partial UTF-8 character
                    end = len(text) - _stop_prefix_len(text, job.stop)
                    yield text[len(sent) : max(end, len(sent))], None
                    sent = text[: max(end, len(sent))]
        finally:
            job.cancelled = True

    async def respond(self, request: Request, chat: bool) -> Response:
        """The whole response, or an SSE stream of chunks."""
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(BadRequest("body is not valid JSON"))
        if not isinstance(body, dict):
            return _error(BadRequest("body must be a JSON object"))
        try:
            job = self.job(body, chat)
        except BadRequest as error:
            return _error(error)
        head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "created": int(time.time()),
            "model": self.name,
        }
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(
                self._sse(job, head, chat, usage), media_type="text/event-stream"
            )
        text, reason = "", "length"
        try:
            async for delta, finish in self.texts(job):
                text, reason = text + delta, finish or reason
        except RuntimeError as error:
            return _error(BadRequest(str(error), 500))
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return JSONResponse(
            {
                **head,
                "object": "chat.completion" if chat else "text_completion",
                "choices": [choice],
                "usage": _usage(job),
            }
        )

    async def _sse(self, job: Job, head: dict, chat: bool, usage: bool):
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, finish: str | None, role: bool = False) -> str:
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
            if chat:
                choice["delta"] = {"role": "assistant", "content": ""} if role else {}
                if text:
                    choice["delta"]["content"] = text
            else:
                choice["text"] = text or ""
            return _event({**head, "object": kind, "choices": [choice]})

        if chat:
            yield chunk(None, None, role=True)
        try:
            async for delta, finish in self.texts(job):
                if delta or finish:
                    yield chunk(delta, finish)
        except RuntimeError as error:
            yield _event({"error": {"message": str(error), "type": "internal_error"}})
        if usage:
            yield _event({**head, "object": kind, "choices": [], "usage": _usage(job)})
        yield "data: [DONE]\n\n"


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """The length of the longest end of ``text`` that may begin a stop string: held back."""
    longest = min(len(text), max((len(s) - 1 for s in stops), default=0))
    return next(
        (k for k in range(longest, 0, -1) if any(s.startswith(text[-k:]) for s in stops)), 0
    )


def _or_default(value: Any, default: Any) -> Any:
    return default if value is None else value


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise BadRequest(message)


def _usage(job: Job) -> dict[str, int]:
    prompt, completion = len(job.prompt_ids), job.num_generated
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"


def _error(error: BadRequest) -> JSONResponse:
    kind = {404: "NotFoundError", 500: "internal_error"}.get(error.status, "BadRequestError")
    body = {"message": str(error), "type": kind, "param": error.param, "code": error.status}
    return JSONResponse({"error": body}, status_code=error.status)


def create_app(front: Front) -> FastAPI:
    """The OpenAI routes over ``front``."""
    app = FastAPI(title="hf-server")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": front.name, "object": "model", "created": 0, "owned_by": "hf-server"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await front.respond(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await front.respond(request, chat=True)

    return app


def load(args: argparse.Namespace) -> Front:
    """Load the model and tokenizer and start the engine thread."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    engine = Engine(model, pad_id, eos_ids, args.max_batch_size, args.batch_wait_ms / 1000)
    max_len = args.max_model_len or model.config.max_position_embeddings
    return Front(engine, tokenizer, args.served_model_name or path.name, max_len)


async def serve(app: FastAPI, host: str, port: int) -> None:
    """Serve ``app`` and print READY with the bound address once it listens."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    config = uvicorn.Config(app, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        bound_host, bound_port = sock.getsockname()[:2]
        print(f"READY hf-server {bound_host}:{bound_port}", flush=True)
    await task


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", required=True, help="a local Hugging Face checkpoint directory")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8001, help="0 picks a free port")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--max-batch-size", type=int, default=16)
    ap.add_argument("--batch-wait-ms", type=float, default=20.0)
    ap.add_argument("--num-threads", type=int, default=None, help="torch threads (default: all)")
    ap.add_argument("--max-model-len", type=int, default=None, help="default: the model's")
    ap.add_argument("--served-model-name", default=None, help="default: the directory's name")
    args = ap.parse_args(argv)
    if not Path(args.model, "config.json").is_file():
        ap.error(f"--model {args.model}: no config.json there")
    if args.max_batch_size < 1 or args.batch_wait_ms < 0:
        ap.error("--max-batch-size must be >= 1 and --batch-wait-ms >= 0")
    if args.num_threads is not None and args.num_threads < 1:
        ap.error("--num-threads must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    app = create_app(load(args))
    asyncio.run(serve(app, args.host, args.port))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
