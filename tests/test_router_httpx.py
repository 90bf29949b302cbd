"""A real httpx client routed through Prism to real local HTTP servers that speak a slice of the OpenAI API."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import httpx
import pytest

from prismlb.router import (
    BLOCK_SIZE,
    CONTEXT_HEADER,
    PREFIX_TOKENS,
    SESSION_HEADER,
    TTFT_SLO_HEADER,
    AsyncPrismTransport,
    Outcome,
    PrismTransport,
    Router,
    Settings,
    ShedError,
    block_hashes,
    prefix_key,
    text_block_hashes,
)
from prismlb.router._httpx import describe
from prismlb.router._keys import prompt_cost
from prismlb.semantics import MODALITY_HEADER
from prismlb.sim import request_tokens
from prismlb.wire import RoutingTable, SliceTable, TableNode

from ._helpers_http import LoopbackServer, QuietHandler, refused_address, serving_http

DOCUMENT = "Quarterly report. " * 300  # 5,400 bytes: a first turn longer than the key's window


class Handler(QuietHandler):
    """POST /v1/chat/completions: answers which server it is and what it saw; streams when asked to."""

    server: NamedServer

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        delay = float(self.headers.get("X-Test-Delay", "0"))
        time.sleep(delay)
        seen = {
            "node": self.server.name,
            "path": self.path,
            "session": self.headers.get(SESSION_HEADER),
            "context": self.headers.get(CONTEXT_HEADER),
            "host": self.headers.get("Host"),
        }
        if body.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for i in range(3):
                self.wfile.write(f"data: {json.dumps({**seen, 'chunk': i})}\n\n".encode())
                self.wfile.flush()
                time.sleep(0.05)
            self.wfile.write(b"data: [DONE]\n\n")
            return
        self.reply(200, json.dumps({"object": "chat.completion", **seen}).encode(), "application/json")


class NamedServer(LoopbackServer):
    def __init__(self, name: str) -> None:
        super().__init__(Handler)
        self.name = name


@pytest.fixture
def servers() -> Iterator[dict[str, NamedServer]]:
    started = {name: NamedServer(name) for name in ("gpu-a", "gpu-b", "gpu-c")}
    with serving_http(*started.values()):
        yield started


def make_router(addresses: dict[str, str], **settings: object) -> Router:
    nodes = [TableNode(node_id=n, endpoint=a, weight=1.0) for n, a in addresses.items()]
    vlm = [TableNode(node_id="gpu-a", endpoint=addresses["gpu-a"], weight=1.0)]
    table = RoutingTable(
        epoch=1,
        version=1,
        issued_unix_s=time.time(),
        slices=[SliceTable(name="llm", nodes=nodes), SliceTable(name="vlm", nodes=vlm)],
    )
    return Router.from_table(table, settings=Settings(**settings))  # type: ignore[arg-type]


def chat(conversation: int, turns: int) -> dict[str, object]:
    """An OpenAI chat request: a shared system prompt, then one conversation's opening and `turns` turns."""
    messages = [
        {"role": "system", "content": "You are a careful analyst."},
        {"role": "user", "content": f"Conversation {conversation}. {DOCUMENT}"},
    ]
    for turn in range(1, turns):
        messages += [{"role": "assistant", "content": f"answer {turn}"}, {"role": "user", "content": f"more {turn}"}]
    return {"model": "m", "messages": messages}


def idle(router: Router) -> bool:
    return all(status.inflight == 0 for status in router.status().values())


def test_an_openai_style_client_routes_through_prism_unchanged(servers: dict[str, NamedServer]) -> None:
    router = make_router({name: s.address for name, s in servers.items()})
    with httpx.Client(transport=PrismTransport(router), base_url="http://prism.invalid/v1") as client:
        first = {c: client.post("/chat/completions", json=chat(c, 1)).json() for c in range(30)}
        later = {c: client.post("/chat/completions", json=chat(c, 3)).json() for c in range(30)}
    assert all(first[c]["node"] == later[c]["node"] for c in range(30))  # every turn finds its KV cache
    assert len({reply["node"] for reply in first.values()}) == 3  # conversations spread
    assert all(reply["path"] == "/v1/chat/completions" for reply in first.values())
    assert all(reply["host"] == servers[str(reply["node"])].address.removeprefix("http://") for reply in first.values())
    assert idle(router)
    assert sum(s.outcomes.get(Outcome.OK, 0) for s in router.status().values()) == 60


def test_headers_pick_the_slice_and_carry_the_session(servers: dict[str, NamedServer]) -> None:
    router = make_router({name: s.address for name, s in servers.items()})
    image = {
        "model": "m",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is this?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                ],
            }
        ],
    }
    with httpx.Client(transport=PrismTransport(router), base_url="http://prism.invalid") as client:
        assert client.post("/v1/chat/completions", json=image).json()["node"] == "gpu-a"  # the vlm slice
        headers = {MODALITY_HEADER: "image+text"}
        assert client.post("/v1/chat/completions", json=chat(1, 1), headers=headers).json()["node"] == "gpu-a"
        session = {SESSION_HEADER: "user-9", CONTEXT_HEADER: "ctx-9"}
        replies = [client.post("/v1/chat/completions", json=chat(5, t), headers=session).json() for t in range(1, 9)]
        elsewhere = client.post("/v1/chat/completions", json=chat(1, 1), headers=session).json()
    assert len({r["node"] for r in replies}) == 1  # one conversation's turns, one node
    assert elsewhere["node"] == "gpu-a" != replies[0]["node"]  # a prompt cached whole elsewhere goes there
    replies.append(elsewhere)
    assert {(r["session"], r["context"]) for r in replies} == {("user-9", "ctx-9")}


def test_a_refused_connection_is_retried_on_the_next_endpoint(servers: dict[str, NamedServer]) -> None:
    addresses = {name: s.address for name, s in servers.items()}
    addresses["gpu-c"] = refused_address()  # gpu-c is down: nothing listens there
    router = make_router(addresses)
    doomed = next(c for c in range(200) if _owner(router, c) == "gpu-c")
    with httpx.Client(transport=PrismTransport(router), base_url="http://prism.invalid/v1") as client:
        reply = client.post("/chat/completions", json=chat(doomed, 1))
    assert reply.status_code == 200 and reply.json()["node"] in {"gpu-a", "gpu-b"}
    assert router.status()["gpu-c"].outcomes == {Outcome.CONNECT: 1}
    assert not router.status()["gpu-c"].available
    with httpx.Client(transport=PrismTransport(router, tries=1), base_url="http://prism.invalid/v1") as client:
        assert client.post("/chat/completions", json=chat(doomed, 2)).json()["node"] in {"gpu-a", "gpu-b"}
    refused = make_router(addresses)
    with (
        httpx.Client(transport=PrismTransport(refused, tries=1), base_url="http://prism.invalid/v1") as client,
        pytest.raises(httpx.ConnectError),
    ):
        client.post("/chat/completions", json=chat(doomed, 1))
    assert idle(router) and idle(refused)


def _owner(router: Router, conversation: int) -> str:
    """The node the transport will pick first for a conversation (the same key it computes)."""
    request = httpx.Request("POST", "http://prism.invalid/v1/chat/completions", json=chat(conversation, 1))
    described, streamed = describe(request, BLOCK_SIZE, PREFIX_TOKENS)
    assert described.key == prefix_key(
        text=f"system\nYou are a careful analyst.\nuser\nConversation {conversation}. {DOCUMENT}\n"
    )
    assert not streamed
    return router.route(described).node_id


def test_a_streamed_response_stays_in_flight_until_closed_and_its_first_chunk_is_the_first_token(
    servers: dict[str, NamedServer],
) -> None:
    router = make_router({name: s.address for name, s in servers.items()}, slow_s=0.1)
    with httpx.Client(transport=PrismTransport(router), base_url="http://prism.invalid/v1") as client:
        streamed = {**chat(1, 1), "stream": True}
        with client.stream("POST", "/chat/completions", json=streamed) as response:
            lines = response.iter_lines()
            node = json.loads(next(lines).removeprefix("data: "))["node"]
            assert router.status()[node].inflight == 1  # still streaming
            chunks = [line for line in lines if line.startswith("data: {")]
        assert len(chunks) == 2 and idle(router)
        assert router.status()[node].outcomes == {Outcome.OK: 1}  # the body took 150 ms, its first chunk did not
        with client.stream("POST", "/chat/completions", json=streamed, headers={"X-Test-Delay": "0.15"}) as response:
            response.read()
        assert router.status()[node].outcomes == {Outcome.OK: 1, Outcome.SLOW: 1}  # a late first chunk: a timeout
        client.post("/chat/completions", json=chat(1, 1), headers={"X-Test-Delay": "0.15"})
        assert router.status()[node].outcomes[Outcome.OK] == 2  # a non-streamed reply's time is not judged


def test_the_async_transport_routes_an_async_client(servers: dict[str, NamedServer]) -> None:
    router = make_router({name: s.address for name, s in servers.items()})

    async def main() -> tuple[list[str], list[str]]:
        async with httpx.AsyncClient(
            transport=AsyncPrismTransport(router), base_url="http://prism.invalid/v1"
        ) as client:
            one_by_one = [(await client.post("/chat/completions", json=chat(c, 1))).json()["node"] for c in range(20)]
            async with client.stream("POST", "/chat/completions", json={**chat(0, 1), "stream": True}) as response:
                lines = [line async for line in response.aiter_lines() if line.startswith("data: {")]
            one_by_one.append(json.loads(lines[0].removeprefix("data: "))["node"])
            # All at once: the bounded-load step spreads them (1.25 × a third of 30 is at most 13 per node).
            replies = await asyncio.gather(*(client.post("/chat/completions", json=chat(c, 1)) for c in range(30)))
            return one_by_one, [r.json()["node"] for r in replies]

    one_by_one, together = asyncio.run(main())
    sync = make_router({name: s.address for name, s in servers.items()})
    with httpx.Client(transport=PrismTransport(sync), base_url="http://prism.invalid/v1") as client:
        expected = [client.post("/chat/completions", json=chat(c, 1)).json()["node"] for c in range(20)]
    assert one_by_one[:20] == expected and one_by_one[20] == expected[0]
    assert len(together) == 30 and max(together.count(n) for n in servers) <= 13
    assert idle(router)


def test_a_shed_request_class_fails_with_the_typed_error(servers: dict[str, NamedServer]) -> None:
    router = make_router({name: s.address for name, s in servers.items()})
    table = router.table
    assert table is not None
    degraded = RoutingTable(
        epoch=1, version=2, issued_unix_s=time.time(), slices=table.slices, shed_classes=["batch"], guardian="degrade"
    )
    assert router.apply(degraded)
    with httpx.Client(transport=PrismTransport(router), base_url="http://prism.invalid/v1") as client:
        with pytest.raises(ShedError, match="'batch' is shed"):
            client.post("/chat/completions", json=chat(1, 1), headers={"X-Prism-Class": "batch"})
        assert client.post("/chat/completions", json=chat(1, 1)).status_code == 200


def test_the_transport_costs_a_request_by_its_prompt_so_prefill_load_counts_tokens() -> None:
    text = "system\nYou are terse.\nuser\n" + "héllo wörld " * 100 + "\n"  # the conversation as the key reads it
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "héllo wörld " * 100}]
    request = httpx.Request("POST", "http://prism.invalid/v1/chat/completions", json={"messages": messages})
    described, _ = describe(request, BLOCK_SIZE, PREFIX_TOKENS)
    assert described.cost == prompt_cost(text) == -(-len(text.encode()) // 4) > 300
    empty = httpx.Request("POST", "http://prism.invalid/v1/chat/completions", json={"model": "m"})
    assert describe(empty, BLOCK_SIZE, PREFIX_TOKENS)[0].cost == 1 == prompt_cost(None) == prompt_cost("")


def test_the_transport_describes_chat_and_completion_bodies_by_cost_key_and_blocks() -> None:
    url = "http://prism.invalid/v1/completions"
    tokens = list(range(1000, 1090))  # 90 token ids: five full blocks of 16 and a partial one
    by_ids, streamed = describe(httpx.Request("POST", url, json={"prompt": tokens, "stream": True}), 16, 64)
    assert streamed and by_ids.cost == 90 and by_ids.block_size == 16
    assert by_ids.blocks == tuple(block_hashes(tokens, 16)) and len(by_ids.blocks) == 5  # the engines' KV hashes
    assert by_ids.key == prefix_key(tokens, block_size=16, prefix_tokens=64)
    text = "Once upon a time, " * 20  # 360 bytes: an estimated 90 tokens, five full text blocks of 64 bytes
    by_text, _ = describe(httpx.Request("POST", url, json={"prompt": text}), 16, 64)
    assert by_text.cost == prompt_cost(text) == 90 and by_text.modality == "text"
    assert by_text.blocks == tuple(text_block_hashes(text, 16)) and len(by_text.blocks) == 5
    assert by_text.key == prefix_key(text=text, block_size=16, prefix_tokens=64)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    conversation = f"system\nBe brief.\nuser\n{text}\n"
    by_chat, _ = describe(httpx.Request("POST", url, json={"messages": messages}), 16, 64)
    assert by_chat.cost == prompt_cost(conversation) and by_chat.blocks == tuple(text_block_hashes(conversation, 16))
    assert len(by_chat.blocks) == 5 and by_chat.key == prefix_key(text=conversation, block_size=16, prefix_tokens=64)
    assert by_text.blocks[0] != by_chat.blocks[0] != by_ids.blocks[0]


def test_a_tokenize_gives_the_blocks_the_engines_kv_events_name_and_a_failing_one_falls_back_counted() -> None:
    """With the engines' tokenization (here the emulated engine's, `prismlb.sim.request_tokens`, the ids its KV
    events carry: tests/test_kv_events.py shows the agent's re-hash of those events equals `block_hashes` of them)
    a chat body's blocks are the engines' blocks, not its text's."""
    url = "http://prism.invalid/v1/chat/completions"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Once upon a time, " * 20}]
    body = {"model": "m", "messages": messages, "stream": True}
    ids = request_tokens(body)
    assert len(ids) >= 2 * 16
    router = make_router({"gpu-a": "127.0.0.1:1"})
    by_ids, streamed = describe(httpx.Request("POST", url, json=body), 16, 64, request_tokens, router.rejects)
    assert streamed and by_ids.blocks == tuple(block_hashes(ids, 16)) and by_ids.cost == len(ids)
    assert by_ids.key == prefix_key(ids, block_size=16, prefix_tokens=64) and by_ids.modality == "text"
    by_text, _ = describe(httpx.Request("POST", url, json=body), 16, 64)
    assert by_text.blocks != by_ids.blocks, "without a tokenize: the text fallback"

    def broken(_body: dict[str, object]) -> list[int]:
        raise RuntimeError("no tokenizer loaded")

    for tokenize in (broken, lambda _body: [], lambda _body: [1, -2, 3]):
        fallback, _ = describe(httpx.Request("POST", url, json=body), 16, 64, tokenize, router.rejects)
        assert fallback.blocks == by_text.blocks and fallback.cost == by_text.cost
    assert router.rejects.counts().get("tokenize") == 3


def test_a_requests_own_ttft_slo_comes_from_its_header_and_a_bad_one_is_counted() -> None:
    """`X-SLO-TTFT-Ms` (llm-d's `x-slo-ttft-ms`, any case) is the request's deadline in the waiting room; a value
    that is no positive number of milliseconds is counted and leaves the router's SLO rule, the request as it was."""
    url = "http://prism.invalid/v1/chat/completions"
    body = {"model": "m", "messages": [{"role": "user", "content": "hello " * 40}], "stream": True}
    router = make_router({"gpu-a": "127.0.0.1:1"})
    plain, _ = describe(httpx.Request("POST", url, json=body), 16, 64, None, router.rejects)
    assert plain.slo_s is None
    given, _ = describe(httpx.Request("POST", url, json=body, headers={"x-slo-ttft-ms": "250"}), 16, 64)
    assert given.slo_s == 0.25 and given.blocks == plain.blocks and given.cost == plain.cost
    for bad in ("soon", "-5", "0", "nan", "inf"):
        request = httpx.Request("POST", url, json=body, headers={TTFT_SLO_HEADER: bad})
        described, streamed = describe(request, 16, 64, None, router.rejects)
        assert described == plain and streamed
    assert router.rejects.counts().get("slo") == 5


def test_a_streamed_request_waits_for_its_turn_and_one_read_whole_does_not(servers: dict[str, NamedServer]) -> None:
    """One node, room for no queued prompt (`hold_tokens=1`): while a streamed request waits 0.3 s for its first
    chunk, a second streamed one waits at the router for it, and a request read whole goes at once. The second is
    the same prompt, cached on the node once the first is placed there: `hold_cached_tokens=0` has it wait anyway."""
    router = make_router({"gpu-a": servers["gpu-a"].address}, hold_tokens=1, hold_cached_tokens=0)

    async def first_chunk_s(client: httpx.AsyncClient, started: float, delay: str = "0") -> float:
        body = {**chat(1, 1), "stream": True}
        headers = {"X-Test-Delay": delay}
        seen: list[float] = []
        async with client.stream("POST", "/chat/completions", json=body, headers=headers) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    seen.append(time.monotonic() - started)
        return seen[0]

    async def main() -> tuple[float, float, float]:
        transport = AsyncPrismTransport(router)
        async with httpx.AsyncClient(transport=transport, base_url="http://prism.invalid/v1") as client:
            started = time.monotonic()
            slow = asyncio.ensure_future(first_chunk_s(client, started, "0.3"))
            await asyncio.sleep(0.05)
            held = asyncio.ensure_future(first_chunk_s(client, started))
            await asyncio.sleep(0.05)
            assert router.turns.waiting == 1
            whole = (await client.post("/chat/completions", json=chat(2, 1))).json()  # not streamed: goes at once
            assert whole["node"] == "gpu-a"
            whole_s = time.monotonic() - started
            return await slow, await held, whole_s

    slow_s, held_s, whole_s = asyncio.run(main())
    assert whole_s < 0.3 <= slow_s <= held_s
    assert router.turns.counts == {"granted": 2, "expired": 0, "left": 0, "passed": 0} and idle(router)


def test_both_transports_count_each_responses_retransmits_on_its_endpoint(
    servers: dict[str, NamedServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loopback loses nothing, so the kernel's count is stood in for: each read of a connection's `TCP_INFO` says it
    has retransmitted two segments more. Every response, streamed or not, sync or async, is then counted once, on the
    endpoint it came from, with what its connection sent again since the last read."""
    totals: dict[int, int] = {}

    def two_more(sock: object) -> int:
        totals[id(sock)] = totals.get(id(sock), 0) + 2
        return totals[id(sock)]

    monkeypatch.setattr("prismlb.router._tcpinfo.total_retransmits", two_more)
    addresses = {name: s.address for name, s in servers.items()}
    sync, concurrent = make_router(addresses), make_router(addresses)
    with httpx.Client(transport=PrismTransport(sync), base_url="http://prism.invalid/v1") as client:
        for c in range(6):
            client.post("/chat/completions", json=chat(c, 1))
        with client.stream("POST", "/chat/completions", json={**chat(0, 1), "stream": True}) as response:
            response.read()

    async def main() -> None:
        async with httpx.AsyncClient(
            transport=AsyncPrismTransport(concurrent), base_url="http://prism.invalid/v1"
        ) as client:
            await asyncio.gather(*(client.post("/chat/completions", json=chat(c, 1)) for c in range(7)))

    asyncio.run(main())
    for router in (sync, concurrent):
        counted = {label: (sum(s.outcomes.values()), s.retransmitted) for label, s in router.status().items()}
        assert sum(ended for ended, _ in counted.values()) == 7
        assert all(segments == 2 * ended for ended, segments in counted.values()), counted
        assert all((s.stall_s > 0) == (s.retransmitted > 0) for s in router.status().values())
