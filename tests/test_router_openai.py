"""The real `openai` client routed through Prism's httpx transports to real local HTTP servers that answer as
OpenAI-compatible engines do: with completions, streamed chunks, or a 503, 429, 400 or 500."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from prismlb.router import (
    BLOCK_SIZE,
    PREFIX_TOKENS,
    AsyncPrismTransport,
    Circuit,
    Outcome,
    PrismTransport,
    Router,
    Settings,
)
from prismlb.router._httpx import describe
from prismlb.wire import RoutingTable, SliceTable, TableNode

from ._helpers_engines import Engine
from .conftest import Clock, wait_for


def make_router(engines: tuple[Engine, ...], clock: Clock | None = None, **settings: Any) -> Router:
    nodes = [TableNode(node_id=e.name, endpoint=e.address, weight=1.0) for e in engines]
    table = RoutingTable(epoch=1, version=1, issued_unix_s=time.time(), slices=[SliceTable(name="llm", nodes=nodes)])
    return Router.from_table(table, settings=Settings(**settings), clock=clock or time.monotonic)


def client(router: Router, **transport: Any) -> openai.OpenAI:
    """The OpenAI client on Prism; its own retries are off, so that what happens is the transport's doing."""
    http = httpx.Client(transport=PrismTransport(router, **transport))
    return openai.OpenAI(base_url="http://prism.invalid/v1", api_key="-", http_client=http, max_retries=0, timeout=5)


def async_client(router: Router) -> openai.AsyncOpenAI:
    """`client` for asyncio."""
    http = httpx.AsyncClient(transport=AsyncPrismTransport(router))
    return openai.AsyncOpenAI(
        base_url="http://prism.invalid/v1", api_key="-", http_client=http, max_retries=0, timeout=5
    )


def conversation(number: int) -> list[ChatCompletionMessageParam]:
    return [{"role": "user", "content": f"Question {number}: what does the quarterly report say? " * 4}]


def owned_by(router: Router, node: str) -> Iterator[list[ChatCompletionMessageParam]]:
    """Conversations the router places on `node` first now (each checked when it is taken)."""
    for number in itertools.count():
        messages = conversation(number)
        request = httpx.Request("POST", "http://prism.invalid/v1/chat/completions", json={"messages": messages})
        if router.route(describe(request, BLOCK_SIZE, PREFIX_TOKENS)[0]).node_id == node:
            yield messages


def idle(router: Router) -> bool:
    return all(status.inflight == 0 and status.load == 0 for status in router.status().values())


def test_503s_count_against_the_endpoint_and_the_request_goes_to_another(engines: tuple[Engine, Engine]) -> None:
    sick, healthy = engines
    sick.status = 503
    router = make_router(engines, max_fails=5)
    # One connection for the whole pool: a 503 whose body were left open would hold it, and the retry would wait.
    with client(router, transport=httpx.HTTPTransport(limits=httpx.Limits(max_connections=1))) as ai:
        mine = owned_by(router, "gpu-a")
        for attempt in range(1, 6):
            assert router.status()["gpu-a"].available  # still taking requests: fewer than max_fails failures
            reply = ai.chat.completions.create(model="m", messages=next(mine))
            assert reply.choices[0].message.content == "gpu-b"
            assert sick.requests == attempt
        assert router.status()["gpu-a"].outcomes == {Outcome.ERROR: 5}
        assert not router.status()["gpu-a"].available  # five failed attempts: passive health takes it out
        assert router.status()["gpu-b"].outcomes == {Outcome.OK: 5}
        assert ai.chat.completions.create(model="m", messages=conversation(0)).choices[0].message.content == "gpu-b"
    assert sick.requests == 5 and healthy.requests == 6 and idle(router)


def test_when_every_try_is_refused_the_caller_gets_the_last_answer(engines: tuple[Engine, Engine]) -> None:
    for engine in engines:
        engine.status = 429
    router = make_router(engines)
    with client(router) as ai, pytest.raises(openai.RateLimitError) as limited:
        ai.chat.completions.create(model="m", messages=conversation(1))
    assert limited.value.status_code == 429 and "answers 429" in limited.value.message
    assert [e.requests for e in engines] == [1, 1]  # one try on each endpoint, `connect_tries` (2) in all
    assert {s.outcomes[Outcome.ERROR] for s in router.status().values()} == {1} and idle(router)
    engines[0].status = engines[1].status = 503
    one_try = make_router(engines)
    with client(one_try, tries=1) as ai, pytest.raises(openai.InternalServerError) as unavailable:
        ai.chat.completions.create(model="m", messages=conversation(1))
    assert unavailable.value.status_code == 503 and sum(e.requests for e in engines) == 3
    assert idle(one_try)


def test_a_client_error_is_the_callers_and_a_server_error_is_not_retried(engines: tuple[Engine, Engine]) -> None:
    target, other = engines
    router = make_router(engines)
    target.status = 400
    with client(router) as ai:
        with pytest.raises(openai.BadRequestError) as bad:
            ai.chat.completions.create(model="m", messages=next(owned_by(router, "gpu-a")))
        assert bad.value.status_code == 400
        status = router.status()["gpu-a"]
        assert status.outcomes == {Outcome.OK: 1} and status.available and status.circuit is Circuit.NORMAL
        assert other.requests == 0  # the same request would fail anywhere: not retried
        target.status = 500  # may have been run already: handed to the caller, and held against the endpoint
        with pytest.raises(openai.InternalServerError) as failed:
            ai.chat.completions.create(model="m", messages=next(owned_by(router, "gpu-a")))
    assert failed.value.status_code == 500 and other.requests == 0 and target.requests == 2
    assert router.status()["gpu-a"].outcomes == {Outcome.OK: 1, Outcome.ERROR: 1}
    assert not router.status()["gpu-a"].available and idle(router)


def test_the_first_streamed_chunk_not_the_head_is_the_first_token(engines: tuple[Engine, Engine]) -> None:
    clock = Clock()
    router = make_router(engines[:1], clock, slow_s=1.0)
    engine = engines[0]
    with client(router) as ai:
        engine.gate.clear()
        stream = ai.chat.completions.create(model="m", messages=conversation(1), stream=True)
        status = router.status()["gpu-a"]  # the head has come, the engine is still on the prompt
        assert status.inflight == 1 and status.load > 0  # its prefill still counts against the endpoint
        clock.now += 2.0  # the prefill takes 2 s
        engine.gate.set()
        chunks = iter(stream)
        assert next(chunks).choices[0].delta.content == "Hello"
        status = router.status()["gpu-a"]
        assert status.inflight == 1 and status.load == 0  # the first token: prefill done, still streaming
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == " from gpu-a"
        assert router.status()["gpu-a"].outcomes == {Outcome.SLOW: 1}  # 2 s to the first token: a timeout
        with ai.chat.completions.create(model="m", messages=conversation(2), stream=True) as quick:
            assert next(iter(quick)).choices[0].delta.content == "Hello"
            clock.now += 2.0  # a long decode after a prompt quick to prefill
            assert len(list(quick)) == 2
        assert router.status()["gpu-a"].outcomes == {Outcome.SLOW: 1, Outcome.OK: 1}
    assert idle(router)


def test_the_async_transport_retries_a_503_and_times_the_first_chunk(engines: tuple[Engine, Engine]) -> None:
    sick, healthy = engines
    sick.status = 503
    clock = Clock()
    router = make_router(engines, clock, slow_s=1.0)
    messages = next(owned_by(router, "gpu-a"))

    async def main() -> str:
        async with async_client(router) as ai:
            healthy.gate.clear()
            stream = await ai.chat.completions.create(model="m", messages=messages, stream=True)
            status = router.status()["gpu-b"]
            assert status.inflight == 1 and status.load > 0
            clock.now += 2.0
            healthy.gate.set()
            return "".join([c.choices[0].delta.content or "" async for c in stream])

    assert asyncio.run(main()) == "Hello from gpu-b"
    assert router.status()["gpu-a"].outcomes == {Outcome.ERROR: 1} and not router.status()["gpu-a"].available
    assert router.status()["gpu-b"].outcomes == {Outcome.SLOW: 1}
    assert sick.requests == 1 and idle(router)


def test_a_request_cancelled_before_its_answer_does_not_stay_in_flight(engines: tuple[Engine, Engine]) -> None:
    engine = engines[0]
    router = make_router(engines[:1])

    async def main() -> None:
        async with async_client(router) as ai:
            engine.gate.clear()
            waiting = asyncio.create_task(ai.chat.completions.create(model="m", messages=conversation(1)))
            assert await asyncio.to_thread(wait_for, lambda: engine.requests == 1, what="the request at the engine")
            assert router.status()["gpu-a"].inflight == 1
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting

    asyncio.run(main())
    assert idle(router)
    assert router.status()["gpu-a"].outcomes == {Outcome.NONE: 1}  # the caller's doing, not the endpoint's
