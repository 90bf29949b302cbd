"""Prompt token ids from the engines' own tokenizer, for callers that send text (`prism gateway`, an OpenAI SDK).

The prefix index matches block hashes of the engine's token ids: the ids vLLM's KV events carry, which only the
model's tokenizer and chat template give. A caller that sends chat text has neither, and without them its blocks
are text blocks, which match this router's own placements (and its peers') for `placed_ttl_s` and never an
engine's event: a conversation back after that, a prefix another caller's request left cached, an eviction the
engine reported, are all unknown to it. `EngineTokenizer` asks an engine of the router's table to tokenize the
body, as vLLM's router does for its KV-aware policy: vLLM's `POST /tokenize` takes the chat `messages` (the
template applied as for the chat request) or a completion `prompt`, and answers `{"tokens": [...]}`.

What it costs: one round trip to an engine's API server before the request is placed, and the tokenizing the
engine would do anyway, done twice. What it does not do:
- ask while no engine's KV events reach the router (a gateway on worker URLs alone): the ids would match only the
  router's own placements, as the text blocks do;
- ask an engine of another slice (audio, image): it may run another model, with another tokenizer;
- ask anything of a conversation with media parts (their placeholder tokens need the media fetched and
  processed): it answers None, and the request keeps its text blocks;
- wait long: a tokenize not answered within `timeout_s` leaves the request on its text blocks;
- ask an endpoint that failed again (refused, timed out, an error status, an answer without ids) before
  `retry_s` has passed: an engine without the route (a 404) costs one round trip per `retry_s`, not one per
  request. A body the engine refuses (400, 413, 422) is that body's fault, and benches nothing.
Its failures raise, and the transport counts them (`tokenize` in the router's rejects) and goes on with the
text blocks: tokenizing never stops a request.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Final

import httpx
import msgspec

from prismlb.wire import NoRouteError, RoutingTable

from ._post import JsonPoster, Target
from ._router import Router

TOKENIZE_PATH: Final = "/tokenize"
"""vLLM's tokenize route. SGLang's server has one of the name for a completion's `prompt`; where an engine's
route refuses chat `messages`, those requests keep their text blocks."""
CHAT_FIELDS: Final = (
    "model",
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
)
"""A chat body's fields that decide its prompt's tokens, passed on as the chat request has them."""
PROMPT_FIELDS: Final = ("model", "prompt", "add_special_tokens")
"""A completion body's fields that decide its prompt's tokens."""
CALLERS_FAULT: Final = frozenset({400, 413, 422})
"""Statuses with which an engine refuses one body (malformed, too long, invalid): the body's fault, not the
engine's, so the engine is not passed over for them; a hostile caller cannot bench every engine."""


class _Tokens(msgspec.Struct):
    """What is read of a `/tokenize` answer."""

    tokens: list[int]


def tokenize_body(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """The `/tokenize` request for a chat or completion body: None for one with media parts, or with neither
    text messages nor a text prompt (nothing the engine can tokenize without fetching something)."""
    if isinstance(body.get("prompt"), str):
        return {k: body[k] for k in PROMPT_FIELDS if k in body}
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    for message in messages:
        if not isinstance(message, dict):
            return None
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") in ("text", "input_text") for p in content):
                return None
        elif content is not None and not isinstance(content, str):
            return None
    return {k: body[k] for k in CHAT_FIELDS if k in body}


def endpoint_url(address: str) -> httpx.URL:
    """A table entry's endpoint as a URL (`host:port` is taken as http)."""
    return httpx.URL(address if "://" in address else f"http://{address}")


class EngineTokenizer:
    """A `PrismTransport(tokenize=...)` that asks the engines of `router`'s table that take text requests (the
    LLM slice's): each call the next endpoint in turn of those not benched (see the module docstring). The
    transports' default (`tokenize="engine"`) is one of these, closed with the transport. Thread-safe; `close` ends
    its connections.

    `timeout_s`: the bound on connecting, sending and each wait for the answer's bytes. `retry_s`: how long an
    endpoint that failed is passed over. The round trips go over kept-alive connections of a lean client of their
    own (`_post.JsonPoster`): through httpx they cost the caller as much CPU as the request they precede."""

    def __init__(
        self,
        router: Router,
        *,
        timeout_s: float = 0.5,
        retry_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not timeout_s > 0 or not retry_s >= 0:
            raise ValueError(f"timeout_s must be positive and retry_s at least 0, got {timeout_s!r}, {retry_s!r}")
        self._router = router
        self._retry_s = retry_s
        self._clock = clock
        self._poster = JsonPoster(timeout_s)
        self._turn = itertools.count()
        self._lock = threading.Lock()
        self._table: RoutingTable | None = None
        self._endpoints: list[tuple[str, Target]] = []
        self._benched: dict[str, float] = {}

    def __call__(self, body: dict[str, Any]) -> list[int] | None:
        """The engine's token ids for `body`'s prompt; None for a body it does not send (media parts, no prompt),
        and for every body while no engine's KV events reach the router (`Router.hears_kv`: a gateway on worker URLs
        alone), where the ids would match nothing the text blocks do not.
        Raises LookupError when every endpoint is benched or there is no table, OSError for a failed round trip,
        ValueError for an answer that is an error or has no token ids."""
        asked = self._ask(body)
        if asked is None:
            return None
        endpoint, target, payload = asked
        started = time.perf_counter()
        try:
            status, answer = self._poster.post(target, payload)
        except Exception:
            self._failed(endpoint, started)
            raise
        return self._tokens(endpoint, status, answer, started)

    async def acall(self, body: dict[str, Any]) -> list[int] | None:
        """`self(body)` for a coroutine, over connections of the event loop's own (the async transport's way: no
        worker thread per request)."""
        asked = self._ask(body)
        if asked is None:
            return None
        endpoint, target, payload = asked
        started = time.perf_counter()
        try:
            status, answer = await self._poster.apost(target, payload)
        except Exception:
            self._failed(endpoint, started)
            raise
        return self._tokens(endpoint, status, answer, started)

    def _ask(self, body: dict[str, Any]) -> tuple[str, Target, bytes] | None:
        """(endpoint, its tokenize target, what to post) for `body`; None where nothing is asked (see `__call__`)."""
        if not self.asks:
            return None
        request = tokenize_body(body)
        if request is None:
            return None
        endpoint, target = self._next()
        return endpoint, target, msgspec.json.encode(request)

    def _tokens(self, endpoint: str, status: int, answer: bytes, started: float) -> list[int]:
        """The ids `endpoint` answered with, the round trip begun at `started` (`time.perf_counter`) recorded; an
        answer that is an error of the engine's, or has no ids, benches it and raises, a refusal of the body
        (`CALLERS_FAULT`) raises alone."""
        if status in CALLERS_FAULT:
            self._router.round_trips.record(time.perf_counter() - started, ok=False)
            raise ValueError(f"{endpoint}{TOKENIZE_PATH} refused the body: {status}")
        try:
            if not 200 <= status < 300:
                raise ValueError(f"{endpoint}{TOKENIZE_PATH} answered {status}")
            tokens = msgspec.json.decode(answer, type=_Tokens).tokens
        except Exception as exc:
            self._failed(endpoint, started)
            if isinstance(exc, msgspec.DecodeError):
                raise ValueError(f"{endpoint}{TOKENIZE_PATH} answered without a tokens list: {exc}") from None
            raise
        self._router.round_trips.record(time.perf_counter() - started, ok=True)
        return tokens

    def _failed(self, endpoint: str, started: float) -> None:
        """A round trip begun at `started` that failed by `endpoint`'s fault: recorded, and the endpoint benched."""
        self._router.round_trips.record(time.perf_counter() - started, ok=False)
        self._bench(endpoint)

    @property
    def asks(self) -> bool:
        """Whether a call may ask an engine now: only while some engine's KV events reach the router."""
        return self._router.hears_kv

    def _bench(self, endpoint: str) -> None:
        """Pass `endpoint` over for `retry_s`."""
        with self._lock:
            self._benched[endpoint] = self._clock() + self._retry_s

    def _next(self) -> tuple[str, Target]:
        """The next endpoint in turn that is not benched, and its tokenize target."""
        table = self._router.table
        now = self._clock()
        with self._lock:
            if table is not self._table:
                self._table = table
                seen = self._text_endpoints(table)
                self._endpoints = list(seen.items())
                self._poster.retain(set(seen.values()))
                self._benched = {e: until for e, until in self._benched.items() if e in seen}
            endpoints = self._endpoints
            if not endpoints:
                raise LookupError("no table to find an engine to tokenize at")
            start = next(self._turn)
            for i in range(len(endpoints)):
                endpoint, target = endpoints[(start + i) % len(endpoints)]
                if self._benched.get(endpoint, 0.0) <= now:
                    self._benched.pop(endpoint, None)
                    return endpoint, target
        raise LookupError(f"all {len(endpoints)} engines failed to tokenize within the last {self._retry_s:g} s")

    def _text_endpoints(self, table: RoutingTable | None) -> dict[str, Target]:
        """The endpoints of the slice text requests go to (the LLM slice, or its fallback while it is empty), in
        table order, with their tokenize targets: only those run the model whose ids the request's blocks must be.
        An audio or image slice's engine may run another model, whose tokenizer would answer with ids no text
        engine's events name. An endpoint that is no http(s) URL is left out."""
        if table is None:
            return {}
        try:
            name = self._router.slice_of()
        except NoRouteError:
            return {}
        targets: dict[str, Target] = {}
        for node in (n for s in table.slices if s.name == name for n in s.nodes):
            url = endpoint_url(node.endpoint)
            with contextlib.suppress(ValueError):
                targets[node.endpoint] = Target.of(url.copy_with(path=url.path.rstrip("/") + TOKENIZE_PATH))
        return targets

    def close(self) -> None:
        self._poster.close()

    def __enter__(self) -> EngineTokenizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
