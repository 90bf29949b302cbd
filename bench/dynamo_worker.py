"""A Dynamo worker for one emulated engine: what `dynamo.vllm` is to a vLLM engine, for `bench/live_routers.py`.

Run by the live bakeoff with the peers' Python (the one `ai-dynamo` is installed in), one per engine:

    python bench/dynamo_worker.py --engine http://127.0.0.1:PORT --kv-events tcp://127.0.0.1:PORT \
        --model-dir DIR --model-name NAME --block-size 16

NVIDIA Dynamo's frontend routes tokenized requests to workers that registered with its runtime, not to HTTP
servers: its KV router picks a worker from the prompt's token ids and the KV events the workers relay. A real
deployment runs the engine inside the worker (`dynamo.vllm` embeds vLLM's engine). The emulated engines are HTTP
servers, so this worker stands between: it registers the model (`--model-dir`, whose tokenizer gives the engines'
own token ids, so the router's block hashes and the engines' events name the same blocks), relays the engine's
vLLM-format KV events over ZeroMQ through Dynamo's `KvEventPublisher`, and serves each request by turning its token
ids back into the prompt's text and streaming the engine's answer, one output token per chunk, with the engine's
usage (its cached tokens included) on the last.

What Dynamo pays here that a real deployment does not: this process's hop (the frontend's TCP request plane to
this worker, then HTTP to the engine), one Python process per engine on the host's cores. Prism's gateway and the
other peers pay one HTTP hop to the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import uvloop
from dynamo.llm import KvEventPublisher, ModelInput, ModelType, WorkerType, register_model
from dynamo.runtime import DistributedRuntime

OUTPUT_TOKEN_ID = 1
"""The id this worker answers each generated token with: the model directory's `tok ` (not its end of sequence, 0,
which would end the answer at its first token)."""


def texts_by_id(model_dir: Path) -> dict[int, str]:
    """Each token id of the model directory's word-level tokenizer to its text (a prompt's 4-character chunk)."""
    vocab: dict[str, int] = json.loads((model_dir / "tokenizer.json").read_text())["model"]["vocab"]
    return {token: text for text, token in vocab.items()}


class Worker:
    """Serves Dynamo's `generate` requests from one emulated engine over HTTP."""

    def __init__(self, engine: str, model_name: str, texts: dict[int, str]) -> None:
        self._url = f"{engine.rstrip('/')}/v1/chat/completions"
        self._model = model_name
        self._texts = texts
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=5.0)
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout)
        return self._session

    async def generate(self, request: dict[str, Any], context: Any = None) -> AsyncIterator[dict[str, Any]]:
        """One tokenized request (Dynamo's preprocessed form: `token_ids`, `stop_conditions`) as the engine's
        streamed answer; an engine that fails ends it with an `error:` finish reason, as Dynamo's backends do."""
        text = "".join(self._texts.get(token, "") for token in request.get("token_ids") or [])
        body: dict[str, Any] = {
            "model": self._model,
            "messages": [{"role": "user", "content": text}],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        max_tokens = (request.get("stop_conditions") or {}).get("max_tokens")
        if max_tokens:  # else the engine's own default, as for a caller that sets none
            body["max_tokens"] = max_tokens
        try:
            async with self._client().post(self._url, json=body) as response:
                if response.status != 200:
                    detail = (await response.text())[:200]
                    yield {"token_ids": [], "finish_reason": f"error: engine answered {response.status}: {detail}"}
                    return
                async for raw in response.content:
                    line = raw.strip()
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    choices = chunk.get("choices") or []
                    if chunk.get("usage"):
                        yield {"token_ids": [], "finish_reason": "length", "completion_usage": chunk["usage"]}
                    elif choices and not choices[0].get("finish_reason"):
                        yield {"token_ids": [OUTPUT_TOKEN_ID]}
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            yield {"token_ids": [], "finish_reason": f"error: {type(exc).__name__}: {exc}"}


async def serve(args: argparse.Namespace) -> None:
    """Register the model on `args.namespace`'s backend endpoint, relay the engine's KV events, serve requests.
    The discovery backend and planes come from Dynamo's own variables (DYN_DISCOVERY_BACKEND, DYN_FILE_KV,
    DYN_REQUEST_PLANE), which the bakeoff sets."""
    runtime = DistributedRuntime(
        asyncio.get_running_loop(),
        os.environ.get("DYN_DISCOVERY_BACKEND", "file"),
        os.environ.get("DYN_REQUEST_PLANE", "tcp"),
    )
    endpoint = runtime.endpoint(f"{args.namespace}.backend.generate")
    worker = Worker(args.engine, args.model_name, texts_by_id(args.model_dir))
    await register_model(
        ModelInput.Tokens,
        ModelType.Chat | ModelType.Completions,
        endpoint,
        str(args.model_dir),
        args.model_name,
        worker_type=WorkerType.Aggregated,
        kv_cache_block_size=args.block_size,
    )
    # The relay lives as long as this reference: a publisher collected unregisters its event channel at once.
    relay = KvEventPublisher(endpoint, kv_block_size=args.block_size, zmq_endpoint=args.kv_events)
    print(f"dynamo worker: {args.engine} registered as {args.model_name}", flush=True)
    try:
        await endpoint.serve_endpoint(worker.generate)
    finally:
        relay.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--engine", required=True, help="the emulated engine's base URL")
    parser.add_argument("--kv-events", required=True, help="the engine's KV event publisher (tcp://host:port)")
    parser.add_argument("--model-dir", type=Path, required=True, help="tokenizer and config of the served model")
    parser.add_argument("--model-name", required=True, help="the name the engine serves its model under")
    parser.add_argument("--block-size", type=int, required=True, help="the engine's KV block size in tokens")
    parser.add_argument("--namespace", default="dynamo")
    uvloop.run(serve(parser.parse_args()))


if __name__ == "__main__":
    main()
