"""What the gateway's hop costs: time to the first streamed chunk and to the answer's end, straight to an engine,
through nginx's reverse proxy, through `prism gateway` and through the in-process async transport, in one run.

Run: .venv/bin/python bench/gateway.py [--requests 400] [--concurrency 1,16]

The engine is a stand-in (no GPU here, and the hop's cost does not depend on what answers): a threading HTTP/1.1
server that streams eight OpenAI-style chunks at once for every chat POST and answers `/tokenize` as vLLM does, in
its own process. nginx (Debian's, one worker, upstream keep-alive, `proxy_buffering off` so chunks pass as they
come) and the gateway (`Gateway` on a table of that one engine: every request is described, tokenized by the
engine, placed, leased and relayed as in production; and again with `--tokenize text`) each run in their own
process too, and the load generator (httpx, asyncio) in this one, each proxy's turn after the other's on
the same engine. The in-process routes are the load generator's own client through `AsyncPrismTransport` (its
default, which asks the engine's `/tokenize` over the event loop; and with `tokenize=None`): the router's cost
where it is embedded, on the caller's CPU. Reported per route and concurrency: p50 and p99 of the time to the
first chunk and to the end, requests per second, and each proxy's p50 added to the direct route's.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Literal

import httpx

from prismlb.demo import free_port, percentile, spawn, stop, wait_healthy
from prismlb.router import AsyncPrismTransport, Gateway, GatewayConfig, Router
from prismlb.service import NoDelayHandler, reply_json
from prismlb.wire import RoutingTable, SliceTable, TableNode

CHUNKS = 8
GATEWAYS = {"prism gateway": "engine", "prism gateway, text blocks": "text"}
"""The gateway's routes by `--tokenize`: its default, a round trip to the engine's `/tokenize` before each request
is placed, and the text blocks alone."""
IN_PROCESS = {"prism transport, in-process": "engine", "prism transport, in-process, text blocks": "text"}
"""The in-process routes by the async transport's `tokenize`, as `GATEWAYS`."""
BODY = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "What does the report say? " * 40}]}


class _Engine(NoDelayHandler):
    """The stand-in engine: `CHUNKS` chunks of a streamed chat completion at once, chunked, keep-alive, each write
    sent at once as real engines' servers send it."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        if self.path == "/tokenize":  # vLLM's answer: an id per 4 bytes of the body, as a tokenizer's count goes
            reply_json(self, 200, {"count": len(body) // 4, "tokens": list(range(len(body) // 4))})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for i in range(CHUNKS):
            piece = b'data: {"choices": [{"index": 0, "delta": {"content": "token %d"}}]}\n\n' % i
            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        self.wfile.write(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")

    def log_message(self, format: str, *args: object) -> None:
        pass


class _EngineServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 2048
    """The listen backlog uvicorn (vLLM's and SGLang's API servers) asks for: with socketserver's 5, a burst of new
    connections (the proxies' pools filling, the tokenize client's) overflows it and waits a second for the SYN to
    be sent again, which no real engine would cost."""


def serve_engine(port: int) -> None:
    server = _EngineServer(("127.0.0.1", port), _Engine)
    server.serve_forever()


def one_engine_router(engine: str) -> Router:
    """A router on a table of the one engine, whose KV events reach it as through a brain: the ids are asked."""
    node = TableNode(node_id="engine", endpoint=engine, weight=1.0)
    table = RoutingTable(epoch=1, version=1, issued_unix_s=time.time(), slices=[SliceTable(name="llm", nodes=[node])])
    router = Router.from_table(table)
    router.apply_kv("engine", False, (), ())
    return router


def serve_gateway(port: int, engine: str, tokenize: str) -> None:
    with Gateway(one_engine_router(engine), GatewayConfig(port=port, tokenize=tokenize)):  # type: ignore[arg-type]
        threading.Event().wait()  # until the bench terminates this process


NGINX_CONF = """worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log;
daemon off;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    upstream engine {{ server 127.0.0.1:{engine}; keepalive 256; }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""


async def load(
    url: str, requests: int, concurrency: int, tokenize: str | None = None
) -> tuple[list[float], list[float], float]:
    """`requests` streamed completions to `url`, `concurrency` at a time: seconds to each one's first chunk and to
    its end, and the wall time of them all. With `tokenize` ("engine" or "text"), `url` is the engine's, reached
    through an `AsyncPrismTransport` of the client's own that tokenizes so."""
    first: list[float] = []
    whole: list[float] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    transport: httpx.AsyncBaseTransport | None = None
    if tokenize is not None:
        inner = httpx.AsyncHTTPTransport(limits=limits)
        chosen: Literal["engine"] | None = "engine" if tokenize == "engine" else None
        transport = AsyncPrismTransport(one_engine_router(url), transport=inner, tokenize=chosen)
        url = "http://prism.invalid"
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30, transport=transport) as client:
        queue = list(range(requests))

        async def worker() -> None:
            while queue:
                queue.pop()
                sent = time.perf_counter()
                async with client.stream("POST", "/v1/chat/completions", json=BODY) as response:
                    if response.status_code != 200:
                        raise RuntimeError(f"{url}: HTTP {response.status_code}")
                    got = None
                    async for chunk in response.aiter_raw():
                        if chunk and got is None:
                            got = time.perf_counter() - sent
                first.append(got if got is not None else float("nan"))
                whole.append(time.perf_counter() - sent)

        for _ in range(min(requests, 20)):  # warm the connections and the proxies' pools
            async with client.stream("POST", "/v1/chat/completions", json=BODY) as response:
                await response.aread()
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return first, whole, time.perf_counter() - started


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=400, help="requests per route and concurrency")
    parser.add_argument("--concurrency", default="1,16", help="comma-separated numbers of requests at once")
    parser.add_argument("--serve-engine", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--serve-gateway", nargs=3, metavar=("PORT", "ENGINE", "TOKENIZE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_engine:
        serve_engine(args.serve_engine)
        return 0
    if args.serve_gateway:
        serve_gateway(int(args.serve_gateway[0]), args.serve_gateway[1], args.serve_gateway[2])
        return 0
    levels = [int(c) for c in args.concurrency.split(",") if c]
    nginx = shutil.which("nginx", path="/usr/sbin:/usr/bin")
    logs = Path(tempfile.mkdtemp(prefix="prism-bench-gateway-"))
    engine_port, nginx_port = free_port(), free_port()
    engine_url = f"http://127.0.0.1:{engine_port}"
    routes: dict[str, str] = {"direct": engine_url}
    rows: list[str] = []
    procs: list[subprocess.Popen[bytes]] = []
    try:
        engine = spawn([__file__, "--serve-engine", str(engine_port)], logs / "engine.log")
        procs.append(engine)
        if not wait_healthy(f"{engine_url}/health", engine, time.monotonic() + 20):
            print("the stand-in engine did not start", file=sys.stderr)
            return 1
        if nginx is not None:
            conf = logs / "nginx.conf"
            conf.write_text(NGINX_CONF.format(prefix=logs, engine=engine_port, port=nginx_port))
            proxy = spawn(["-p", str(logs), "-c", str(conf)], logs / "nginx.log", executable=nginx)
            procs.append(proxy)
            if wait_healthy(f"http://127.0.0.1:{nginx_port}/health", proxy, time.monotonic() + 20):
                routes["nginx"] = f"http://127.0.0.1:{nginx_port}"
            else:
                rows.append(f"nginx did not start: {(logs / 'error.log').read_text()[-300:]}")
        else:
            rows.append("nginx is not installed (Debian: apt-get install -y nginx): its row is left out")
        for route, tokenize in GATEWAYS.items():
            port, log = free_port(), logs / f"gateway-{tokenize}.log"
            gateway = spawn([__file__, "--serve-gateway", str(port), engine_url, tokenize], log)
            procs.append(gateway)
            if not wait_healthy(f"http://127.0.0.1:{port}/health", gateway, time.monotonic() + 30):
                print(f"the gateway did not start: {log.read_text()[-500:]}", file=sys.stderr)
                return 1
            routes[route] = f"http://127.0.0.1:{port}"
        print(f"{args.requests} streamed completions of {CHUNKS} chunks per route and concurrency; logs in {logs}")
        print("| concurrency | route | first chunk p50 | p99 | end p50 | p99 | requests/s | p50 added to direct |")
        print("|---|---|---|---|---|---|---|---|")
        routed: dict[str, tuple[str, str | None]] = {name: (url, None) for name, url in routes.items()}
        routed.update({name: (engine_url, tokenize) for name, tokenize in IN_PROCESS.items()})
        for level in levels:
            direct_p50 = None
            for name, (url, transported) in routed.items():
                first, whole, wall = asyncio.run(load(url, args.requests, level, transported))
                p50, p99 = percentile(first, 0.5) or 0.0, percentile(first, 0.99) or 0.0
                e50, e99 = percentile(whole, 0.5) or 0.0, percentile(whole, 0.99) or 0.0
                direct_p50 = p50 if direct_p50 is None else direct_p50
                added = "–" if name == "direct" else f"{(p50 - direct_p50) * 1e3:+.2f} ms"
                print(
                    f"| {level} | {name} | {p50 * 1e3:.2f} ms | {p99 * 1e3:.2f} ms | {e50 * 1e3:.2f} ms | "
                    f"{e99 * 1e3:.2f} ms | {args.requests / wall:.0f} | {added} |",
                    flush=True,
                )
    finally:
        stop(procs)
    for row in rows:
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
