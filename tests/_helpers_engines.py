"""Local HTTP servers that answer as OpenAI-compatible engines do (a completion naming the server, streamed chunks
held at a gate, or an error status), for the tests that route real clients to them: the httpx transports and the
gateway. The `engines` fixture (two of them) is in conftest."""

from __future__ import annotations

import json
import threading

from prismlb.sim import request_tokens

from ._helpers_http import LoopbackServer, QuietHandler


class Handler(QuietHandler):
    """POST /v1/chat/completions as an engine answers it: `status` other than 200 with an OpenAI error body;
    else, once `gate` is set, a completion naming the server, or, streamed, the head at once and the chunks once
    `gate` is set. POST /tokenize as vLLM answers it, with the emulated engine's tokenizer, counted apart."""

    server: Engine

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        engine = self.server
        if self.path == "/tokenize":
            with engine.lock:
                engine.tokenized += 1
            tokens = request_tokens(body)
            self.reply(200, json.dumps({"count": len(tokens), "tokens": tokens}).encode(), "application/json")
            return
        with engine.lock:
            engine.requests += 1
        if engine.status != 200:
            error = {"error": {"message": f"{engine.name} answers {engine.status}", "type": "engine", "code": None}}
            self.reply(engine.status, json.dumps(error).encode(), "application/json")
            return
        if body.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.flush()
            engine.gate.wait(10)  # the prefill: the head is out, no token yet
            for piece in ("Hello", " from ", engine.name):
                chunk = {
                    "id": "chatcmpl-1",
                    "object": "chat.completion.chunk",
                    "created": 0,
                    "model": body["model"],
                    "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}],
                }
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
            return
        engine.gate.wait(10)  # the whole answer is held, head and all
        completion = {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 0,
            "model": body["model"],
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": engine.name}, "finish_reason": "stop"}
            ],
        }
        self.reply(200, json.dumps(completion).encode(), "application/json")


class Engine(LoopbackServer):
    def __init__(self, name: str, status: int = 200) -> None:
        super().__init__(Handler)
        self.name = name
        self.status = status
        self.requests = 0
        """Completions asked for (tokenize calls are `tokenized`)."""
        self.tokenized = 0
        self.lock = threading.Lock()
        self.gate = threading.Event()
        self.gate.set()
