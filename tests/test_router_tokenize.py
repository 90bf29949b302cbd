"""`EngineTokenizer`: the engines' own `/tokenize` gives a text request the block hashes their KV events name, over
real HTTP to the emulated engine and to the test engines; failures bench an endpoint and leave the text blocks."""

from __future__ import annotations

import argparse
import asyncio
import threading
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry

from prismlb.cli import main
from prismlb.router import (
    BLOCK_SIZE,
    AsyncPrismTransport,
    EngineTokenizer,
    Gateway,
    GatewayConfig,
    PrismTransport,
    Router,
    block_hashes,
)
from prismlb.router._cli import GATEWAY_SETTINGS, gateway_config
from prismlb.router._tokenize import tokenize_body
from prismlb.sim import EmulatedEngine, request_tokens
from prismlb.wire import ConfigError, RoutingTable, SliceTable, TableNode

from ._helpers_engines import Engine
from ._helpers_http import LoopbackServer, QuietHandler, refused_address, serving_http
from .test_router_openai import make_router

CHAT = {
    "model": "m",
    "messages": [
        {"role": "system", "content": "You answer in one sentence, citing the page you read it on. " * 4},
        {"role": "user", "content": [{"type": "text", "text": "What is the tallest mountain in the Alps? " * 3}]},
    ],
    "max_tokens": 4,
    "stream": True,
}


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def hearing(router: Router, *nodes: str) -> Router:
    """`router`, `nodes`' KV events reaching it (an empty change each), as the brain's KV stream makes them."""
    for node in nodes or [n.node_id for s in router.table.slices for n in s.nodes]:  # type: ignore[union-attr]
        router.apply_kv(node, False, (), ())
    return router


def table_router(*endpoints: str) -> Router:
    """A router on a table of `endpoints` whose engines' KV events reach it."""
    nodes = [TableNode(node_id=f"n{i}", endpoint=e, weight=1.0) for i, e in enumerate(endpoints)]
    table = RoutingTable(epoch=1, version=1, issued_unix_s=time.time(), slices=[SliceTable(name="llm", nodes=nodes)])
    return hearing(Router.from_table(table))


def test_the_emulated_engines_tokenize_gives_the_ids_its_kv_events_carry_for_chats_and_prompts() -> None:
    with EmulatedEngine("h100", time_scale=1.0) as engine:
        with EngineTokenizer(table_router(engine.url)) as tokenize:
            assert tokenize(CHAT) == request_tokens(CHAT)
            prompt = {"model": "m", "prompt": "Summarise the following report. " * 10}
            assert tokenize(prompt) == request_tokens(prompt)


def test_only_what_decides_the_tokens_is_sent_and_media_or_promptless_bodies_are_not_sent() -> None:
    assert tokenize_body(CHAT) == {"model": "m", "messages": CHAT["messages"]}
    templated = {**CHAT, "add_generation_prompt": False, "chat_template_kwargs": {"thinking": True}, "n": 2}
    assert set(tokenize_body(templated) or {}) == {"model", "messages", "add_generation_prompt", "chat_template_kwargs"}
    assert tokenize_body({"model": "m", "prompt": "hi", "max_tokens": 3}) == {"model": "m", "prompt": "hi"}
    image = {"type": "image_url", "image_url": {"url": "https://example.invalid/a.png"}}
    with_image = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "what?"}, image]}]}
    for body in (with_image, {"model": "m"}, {"messages": []}, {"messages": ["hi"]}, {"prompt": [1, 2, 3]}):
        assert tokenize_body(body) is None
    router = table_router(refused_address())
    with EngineTokenizer(router) as tokenize:
        assert tokenize(with_image) is None  # no round trip: a refused one would raise


def test_no_engine_is_asked_while_no_kv_events_reach_the_router(engines: tuple[Engine, Engine]) -> None:
    """A gateway on worker URLs alone hears no KV events: the engines' ids would match only its own placements,
    as the text blocks do, so it asks nothing until an engine's events arrive."""
    router = make_router(engines)
    with EngineTokenizer(router) as tokenize:
        assert tokenize(CHAT) is None and router.hears_kv is False
        router.apply_kv(engines[0].name, False, (), ())
        assert router.hears_kv and tokenize(CHAT) == request_tokens(CHAT)
        router.apply_kv(engines[0].name, True, (), ())  # its engine's state reset to unknown: none heard again
        assert tokenize(CHAT) is None
    assert sum(e.tokenized for e in engines) == 1


def test_calls_go_to_the_tables_engines_in_turn(engines: tuple[Engine, Engine]) -> None:
    with EngineTokenizer(hearing(make_router(engines))) as tokenize:
        for _ in range(6):
            assert tokenize(CHAT) == request_tokens(CHAT)
    assert [e.tokenized for e in engines] == [3, 3] and [e.requests for e in engines] == [0, 0]


def test_a_failing_engine_is_passed_over_for_retry_s_and_with_every_engine_failing_the_call_raises(
    engines: tuple[Engine, Engine],
) -> None:
    clock = Clock()
    router = table_router(refused_address(), engines[0].address)
    with EngineTokenizer(router, retry_s=30, clock=clock) as tokenize:
        with pytest.raises(ConnectionRefusedError):
            tokenize(CHAT)  # the refused one's turn comes first
        for _ in range(4):
            assert tokenize(CHAT) == request_tokens(CHAT)
        assert engines[0].tokenized == 4, "the refused engine was not asked again within retry_s"
        clock.now += 31
        with pytest.raises(ConnectionRefusedError):
            for _ in range(2):
                tokenize(CHAT)
    with EngineTokenizer(table_router(refused_address()), retry_s=30, clock=clock) as tokenize:
        with pytest.raises(ConnectionRefusedError):
            tokenize(CHAT)
        with pytest.raises(LookupError, match="all 1 engines failed to tokenize"):
            tokenize(CHAT)


def test_round_trips_are_exported_in_a_histogram_with_the_failed_ones_counted(engines: tuple[Engine, Engine]) -> None:
    registry = CollectorRegistry()
    nodes = [
        TableNode(node_id=f"n{i}", endpoint=e, weight=1.0)
        for i, e in enumerate((refused_address(), engines[0].address))
    ]
    table = RoutingTable(epoch=1, version=1, issued_unix_s=time.time(), slices=[SliceTable(name="llm", nodes=nodes)])
    router = hearing(Router.from_table(table, registry=registry))
    assert registry.get_sample_value("prism_router_tokenize_seconds_count") == 0
    with EngineTokenizer(router) as tokenize:
        with pytest.raises(ConnectionRefusedError):
            tokenize(CHAT)
        for _ in range(3):
            tokenize(CHAT)
        tokenize({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]})  # not asked
    assert registry.get_sample_value("prism_router_tokenize_seconds_count") == 4
    assert registry.get_sample_value("prism_router_tokenize_failures_total") == 1
    assert registry.get_sample_value("prism_router_tokenize_seconds_bucket", {"le": "+Inf"}) == 4
    assert registry.get_sample_value("prism_router_tokenize_seconds_bucket", {"le": "0.5"}) == 4
    assert 0 < (registry.get_sample_value("prism_router_tokenize_seconds_sum") or 0) < 2.0


def test_only_the_engines_text_requests_go_to_are_asked_not_another_slices(engines: tuple[Engine, Engine]) -> None:
    """An audio slice's engine may run another model: its ids would name blocks no text engine's events name."""
    text, audio = (TableNode(node_id=e.name, endpoint=e.address, weight=1.0) for e in engines)
    slices = [SliceTable(name="audio", nodes=[audio]), SliceTable(name="llm", nodes=[text])]
    router = hearing(Router.from_table(RoutingTable(epoch=1, version=1, issued_unix_s=time.time(), slices=slices)))
    with EngineTokenizer(router) as tokenize:
        for _ in range(4):
            assert tokenize(CHAT) == request_tokens(CHAT)
        assert [e.tokenized for e in engines] == [4, 0]
        empty = [SliceTable(name="audio", nodes=[audio]), SliceTable(name="llm", nodes=[], fallback="audio")]
        router.apply(RoutingTable(epoch=1, version=2, issued_unix_s=time.time(), slices=empty))
        assert tokenize(CHAT) == request_tokens(CHAT)  # the empty LLM slice's fallback takes text requests now
        assert [e.tokenized for e in engines] == [4, 1]


class NoRoute(QuietHandler):
    """A server without a `/tokenize` route."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.reply(404, b'{"detail": "Not Found"}', "application/json")


class Refusing(QuietHandler):
    """An engine that refuses every body it is asked to tokenize as invalid."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.reply(400, b'{"error": {"message": "invalid messages"}}', "application/json")


def test_a_body_the_engine_refuses_raises_without_benching_the_engine() -> None:
    """A 400 is the body's fault: a caller sending bad bodies cannot have every engine passed over."""
    with serving_http(LoopbackServer(Refusing)) as (refusing,):
        with EngineTokenizer(table_router(refusing.address)) as tokenize:
            for _ in range(3):
                with pytest.raises(ValueError, match="refused the body: 400"):
                    tokenize(CHAT)


def test_an_engine_without_the_route_is_an_error_and_the_request_goes_on_with_its_text_blocks_counted(
    engines: tuple[Engine, Engine],
) -> None:
    """A 404 (a server without the route), an answer without ids, an engine not answering: each raises, which
    the transport counts (`tokenize`) and the request is relayed on its text blocks, answered as before."""
    with serving_http(LoopbackServer(NoRoute)) as (no_route,):
        with EngineTokenizer(table_router(f"{no_route.address}/")) as tokenize:
            with pytest.raises(ValueError, match="answered 404"):
                tokenize(CHAT)
    router = make_router(engines)
    no_table, refused = EngineTokenizer(hearing(Router(), "n0")), EngineTokenizer(table_router(refused_address()))
    with no_table, refused:
        with pytest.raises(LookupError, match="no table"):
            no_table(CHAT)
        for tokenize in (no_table, refused):
            client = httpx.Client(transport=PrismTransport(router, tokenize=tokenize))
            with client, client.stream("POST", "http://prism.invalid/v1/chat/completions", json=CHAT) as response:
                assert response.status_code == 200 and b"Hello" in response.read()
    assert sum(e.requests for e in engines) == 2 and router.rejects.counts().get("tokenize") == 2


def answered_by(engines: tuple[Engine, Engine], before: list[int]) -> str:
    """The engine whose completion count rose by one since `before`."""
    (name,) = [e.name for e, b in zip(engines, before) if e.requests == b + 1]
    return name


def relay(gateway: Gateway) -> None:
    """One streamed chat through the gateway, read to its end."""
    with httpx.stream("POST", f"http://127.0.0.1:{gateway.port}/v1/chat/completions", json=CHAT, timeout=10) as r:
        assert r.status_code == 200 and b"Hello" in r.read()


def test_the_gateway_places_a_text_chat_by_the_engines_kv_events_unless_told_to_keep_text_blocks(
    engines: tuple[Engine, Engine],
) -> None:
    """Where the router places the chat with nothing cached (by text blocks), then, with the other engine's KV
    events naming the chat's blocks: by default the gateway asks an engine for the ids and goes there; with
    `tokenize="text"` it cannot know and places it as before, asking no engine."""
    blocks = block_hashes(request_tokens(CHAT), BLOCK_SIZE)
    before = [e.requests for e in engines]
    with Gateway(make_router(engines), GatewayConfig(port=0, tokenize="text")) as gateway:
        relay(gateway)
    first = answered_by(engines, before)
    other = next(e.name for e in engines if e.name != first)
    assert sum(e.tokenized for e in engines) == 0
    for mode, expected, asked in (("engine", other, 1), ("text", first, 0)):
        router = hearing(make_router(engines))
        router.apply_kv(other, False, blocks, (), block_size=BLOCK_SIZE)
        before = [e.requests for e in engines]
        tokenized = sum(e.tokenized for e in engines)
        with Gateway(router, GatewayConfig(port=0, tokenize=mode)) as gateway:  # type: ignore[arg-type]
            relay(gateway)
        assert answered_by(engines, before) == expected, mode
        assert sum(e.tokenized for e in engines) - tokenized == asked
        assert "tokenize" not in router.rejects.counts()


def test_the_async_transport_tokenizes_off_the_event_loop_and_places_by_the_kv_events(
    engines: tuple[Engine, Engine],
) -> None:
    router = make_router(engines)
    blocks = block_hashes(request_tokens(CHAT), BLOCK_SIZE)
    for engine in engines:  # both hold the system prompt's blocks; one the whole prompt
        router.apply_kv(engine.name, False, blocks[: len(blocks) // 2], (), block_size=BLOCK_SIZE)
    router.apply_kv(engines[1].name, False, blocks, (), block_size=BLOCK_SIZE)
    loop_threads: set[int] = set()

    def tokenize(body: dict[str, object]) -> list[int]:
        loop_threads.add(threading.get_ident())
        return request_tokens(body)

    async def run() -> int:
        transport = AsyncPrismTransport(router, tokenize=tokenize)
        async with httpx.AsyncClient(transport=transport) as client:
            async with client.stream("POST", "http://prism.invalid/v1/chat/completions", json=CHAT) as response:
                assert response.status_code == 200 and b"gpu-b" in await response.aread()
        return threading.get_ident()

    assert asyncio.run(run()) not in loop_threads and len(loop_threads) == 1
    assert [e.requests for e in engines] == [0, 1]


def test_the_async_transport_asks_the_engines_over_its_event_loop_and_counts_a_failed_ask(
    engines: tuple[Engine, Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No worker thread per request: the round trip is the event loop's, and a failed one leaves the request on its
    text blocks, counted, as the sync transport's does."""

    def no_thread(*args: object) -> None:
        raise AssertionError("the engines were asked from a worker thread")

    monkeypatch.setattr(asyncio, "to_thread", no_thread)
    blocks = block_hashes(request_tokens(CHAT), BLOCK_SIZE)
    nodes = [TableNode(node_id=e.name, endpoint=e.address, weight=1.0) for e in engines]
    refused = TableNode(node_id="gone", endpoint=refused_address(), weight=1.0)
    table = RoutingTable(epoch=1, version=1, issued_unix_s=time.time(), slices=[SliceTable(name="llm", nodes=nodes)])
    router = hearing(Router.from_table(table))
    router.apply_kv(engines[1].name, False, blocks, (), block_size=BLOCK_SIZE)
    url = "http://prism.invalid/v1/chat/completions"

    async def run() -> None:
        async with httpx.AsyncClient(transport=AsyncPrismTransport(router)) as client:
            for _ in range(3):
                async with client.stream("POST", url, json=CHAT) as response:
                    assert response.status_code == 200 and b"gpu-b" in await response.aread()
            slices = [SliceTable(name="llm", nodes=[refused, *nodes])]
            router.apply(RoutingTable(epoch=1, version=2, issued_unix_s=time.time(), slices=slices))
            async with client.stream("POST", url, json=CHAT) as response:  # the refused one's turn
                assert response.status_code == 200 and b"Hello" in await response.aread()

    asyncio.run(run())
    assert sum(e.tokenized for e in engines) == 3 and engines[1].requests >= 3 and sum(e.requests for e in engines) == 4
    assert router.rejects.counts().get("tokenize") == 1


def test_the_gateways_tokenize_setting_resolves_and_refuses_anything_but_engine_or_text(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = argparse.ArgumentParser()
    GATEWAY_SETTINGS.add_arguments(parser)
    assert gateway_config(GATEWAY_SETTINGS.resolve(parser.parse_args([]), {})).tokenize == "engine"
    given = GATEWAY_SETTINGS.resolve(parser.parse_args([]), {"PRISM_GATEWAY_TOKENIZE": "Text"})
    assert gateway_config(given).tokenize == "text"
    flag = GATEWAY_SETTINGS.resolve(parser.parse_args(["--tokenize", "engine"]), {"PRISM_GATEWAY_TOKENIZE": "text"})
    assert gateway_config(flag).tokenize == "engine"
    with pytest.raises(ConfigError, match="tokenize must be 'engine' or 'text', got 'tokens'"):
        GATEWAY_SETTINGS.resolve(parser.parse_args([]), {"PRISM_GATEWAY_TOKENIZE": "tokens"})
    with pytest.raises(ConfigError, match="tokenize must be 'engine' or 'text'"):
        GatewayConfig(tokenize="words")  # type: ignore[arg-type]
    assert main(["gateway", "--worker-url", "http://127.0.0.1:1", "--tokenize", "both"]) == 2
    assert "--tokenize: tokenize must be 'engine' or 'text', got 'both'" in capsys.readouterr().err


def test_the_transports_ask_the_engines_by_default_once_kv_events_reach_the_router(
    engines: tuple[Engine, Engine],
) -> None:
    """`tokenize="engine"` is the default: no engine is asked while no KV events are heard, then each text request
    is; `tokenize=None` asks none. The async transport asks the same way."""
    router = make_router(engines)
    url = "http://prism.invalid/v1/chat/completions"

    def send(transport: PrismTransport) -> None:
        with httpx.Client(transport=transport) as client, client.stream("POST", url, json=CHAT) as response:
            assert response.status_code == 200 and b"Hello" in response.read()

    send(PrismTransport(router))
    assert sum(e.tokenized for e in engines) == 0
    hearing(router)
    send(PrismTransport(router))
    send(PrismTransport(router, tokenize=None))
    assert sum(e.tokenized for e in engines) == 1

    async def send_async() -> None:
        async with httpx.AsyncClient(transport=AsyncPrismTransport(router)) as client:
            async with client.stream("POST", url, json=CHAT) as response:
                assert response.status_code == 200 and b"Hello" in await response.aread()

    asyncio.run(send_async())
    assert sum(e.tokenized for e in engines) == 2 and sum(e.requests for e in engines) == 4
    assert "tokenize" not in router.rejects.counts()
