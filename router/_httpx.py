"""httpx transports that send each request to the endpoint a Router picks, so an OpenAI-compatible client routes
through Prism unchanged: `httpx.Client(transport=PrismTransport(router))` as its `http_client`.

The affinity key is the `X-Prism-Affinity-Key` header, else `prefix_key` of the JSON body's conversation (chat
`messages` in order, or a completion `prompt`); the modality is the `X-Modality-Signature` header, else the kinds of
the messages' content parts; the cost (what `load="prefill"` balances) is the prompt's tokens, or the conversation's
estimated tokens; the block hashes (`Request.blocks`, which the router matches against its prefix index; all three
from `Request.with_prompt`) are `block_hashes` of a prompt given as token ids, or of the ids the transport's
`tokenize` gives for the body (the model's tokenizer and chat template, as the engine applies them; by default an
`EngineTokenizer` asks the engines themselves), which match the engines' KV events; else `text_block_hashes` of
the conversation, which match this router's own placements (media parts stand in as digests of themselves, so they
hash by content). A `tokenize` that raises or gives no token ids leaves that request on the text fallback, counted
(`tokenize` in the router's rejects), one that gives None leaves it there uncounted; media parts' blocks carry the
engine's extra keys, which token ids alone do not, so with media the ids match up to the first media part only. The
async transport asks the engines over its event loop and calls any other `tokenize` on a worker thread. Session,
context signature, request class and the request's own TTFT SLO (`X-SLO-TTFT-Ms`, milliseconds; a bad value is
counted as `slo` and the router's SLO applies) come from their headers. The request goes to the endpoint's scheme,
host and port (its path prefix, if any, before the request's path).

A response's status is the endpoint's outcome: a 5xx or a 429 is a failure (passive health), any other status a
success (a 4xx is the caller's fault). A request whose connection was refused, or that got a 503 or 429 back (the
endpoint did not take it), goes again to an endpoint it has not tried, up to `tries` attempts (`Attempts`); the
last attempt's response reaches the caller whatever its status, so the client sees what the endpoint said. The
lease ends when the response is closed; before that, the segments its connection retransmitted for it (the caller's
kernel's count, `_tcpinfo`) are counted on the endpoint, which adds the loss on the way there to its expected time to
first token (`Settings.client_stall`). For a successful `"stream": true` request the first non-empty chunk of
the body is the first token (the head comes at once; the first chunk once the prompt is prefilled); a response
that is not streamed has no first token, so its whole time is not judged and its load is released at its end.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Generic, Literal, TypeVar

import httpx

from prismlb.wire import RejectCounter

from ._attempts import Attempts
from ._health import Outcome
from ._keys import BLOCK_SIZE, PREFIX_TOKENS
from ._lease import Lease
from ._request import TTFT_SLO_HEADER, Request
from ._router import Router
from ._tcpinfo import Retransmits
from ._tokenize import EngineTokenizer, endpoint_url

_Stream = TypeVar("_Stream", httpx.SyncByteStream, httpx.AsyncByteStream)
_Transport = TypeVar("_Transport", httpx.BaseTransport, httpx.AsyncBaseTransport)
_Counted = tuple[Retransmits, object]
"""A transport's count of its connections' retransmits, and the connection (network stream) a response came over."""

_PART_MODALITY = {
    "text": "text",
    "input_text": "text",
    "image_url": "image",
    "input_image": "image",
    "image": "image",
    "input_audio": "audio",
    "audio_url": "audio",
    "video_url": "video",
    "video": "video",
}


def _part_text(part: Any) -> tuple[str, str]:
    """(modality, text for the key) of one content part; non-text parts stand in as a digest of themselves."""
    if isinstance(part, str):
        return "text", part
    if not isinstance(part, dict):
        return "text", repr(part)
    kind = str(part.get("type", "text"))
    if isinstance(part.get("text"), str):
        return _PART_MODALITY.get(kind, "text"), part["text"]
    digest = hashlib.blake2b(json.dumps(part, sort_keys=True).encode(), digest_size=16).hexdigest()
    return _PART_MODALITY.get(kind, "text"), f"<{kind}:{digest}>"


def _conversation(body: Any) -> tuple[str | None, set[str]]:
    """The conversation as text, in order (None when the body has none), and the modalities of its parts."""
    if not isinstance(body, dict):
        return None, set()
    if isinstance(body.get("prompt"), str):
        return body["prompt"], {"text"}
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None, set()
    kinds: set[str] = set()
    pieces: list[str] = []
    for message in messages:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        parts = content if isinstance(content, list) else [content if isinstance(content, str) else ""]
        texts = []
        for part in parts:
            kind, text = _part_text(part)
            kinds.add(kind)
            texts.append(text)
        pieces.append(f"{message.get('role', '')}\n{''.join(texts)}\n")
    return "".join(pieces), kinds


Tokenize = Callable[[dict[str, Any]], Sequence[int] | None]
"""A JSON request body's prompt token ids as the engine computes them; None for a body it leaves on its text
blocks (not a failure: nothing is counted)."""


@dataclass(frozen=True)
class _Prompt:
    """What a request's headers and JSON body say before any tokenizing: the router's view without the prompt,
    the body, its conversation as text and the token ids it gives itself (a completion's prompt as ids)."""

    described: Request
    body: Any
    text: str | None
    tokens: list[int] | None
    streamed: bool

    @classmethod
    def of(cls, request: httpx.Request, block_size: int, rejects: RejectCounter | None) -> _Prompt:
        body: Any = None
        if request.content and "json" in request.headers.get("content-type", ""):
            try:
                body = json.loads(request.content)
            except ValueError:
                body = None
        described = Request.from_headers(request.headers)
        text, kinds = _conversation(body)
        modality = described.modality or ("+".join(sorted(kinds)) if kinds else None)
        slo_s = _slo_s(request.headers.get(TTFT_SLO_HEADER), rejects)
        described = replace(described, modality=modality, block_size=block_size, slo_s=slo_s)
        streamed = isinstance(body, dict) and body.get("stream") is True
        return cls(described, body, text, _prompt_tokens(body), streamed)

    @property
    def asks(self) -> bool:
        """Whether a tokenize is asked for this prompt's ids: a conversation without ids of its own."""
        return self.tokens is None and self.text is not None

    def request(self, tokens: list[int] | None, prefix_tokens: int) -> Request:
        """The router's view, its key, cost and blocks from `tokens` (the engines' ids) or else the text."""
        if tokens is not None:  # the prompt as token ids: its blocks are the ones the engine's events name
            return self.described.with_prompt(tokens, prefix_tokens=prefix_tokens)
        if self.text is not None:
            return self.described.with_prompt(text=self.text, prefix_tokens=prefix_tokens)
        return self.described


def describe(
    request: httpx.Request,
    block_size: int,
    prefix_tokens: int,
    tokenize: Tokenize | None = None,
    rejects: RejectCounter | None = None,
) -> tuple[Request, bool]:
    """The router's view of an HTTP request (body already read), and whether it asks for a streamed response;
    `tokenize` failures are counted in `rejects`."""
    prompt = _Prompt.of(request, block_size, rejects)
    tokens = prompt.tokens
    if tokenize is not None and prompt.asks:
        tokens = _token_ids(_outcome(tokenize, prompt.body), rejects)
    return prompt.request(tokens, prefix_tokens), prompt.streamed


def _slo_s(raw: str | None, rejects: RejectCounter | None) -> float | None:
    """The request's own TTFT SLO in seconds from its `TTFT_SLO_HEADER` (milliseconds); None without one, and None
    (counted) for a value that is no positive, finite number: the request then goes by the router's SLO rule."""
    if raw is None:
        return None
    try:
        ms = float(raw)
    except ValueError:
        ms = math.nan
    if math.isfinite(ms) and ms > 0:
        return ms / 1000
    if rejects is not None:
        problem = f"{TTFT_SLO_HEADER} {raw[:32]!r} is no positive number of milliseconds"
        rejects.count("slo", f"{problem}; the request goes by the router's SLO")
    return None


def _outcome(tokenize: Tokenize, body: Any) -> Sequence[int] | None | Exception:
    """What `tokenize(body)` gives, or the exception it raises (the caller's tokenizer: whatever it raises, the
    request goes on as text)."""
    try:
        return tokenize(body)
    except Exception as exc:
        return exc


async def _aoutcome(
    tokenize: Callable[[Any], Awaitable[Sequence[int] | None]], body: Any
) -> Sequence[int] | None | Exception:
    """`_outcome` for a coroutine tokenize."""
    try:
        return await tokenize(body)
    except Exception as exc:
        return exc


def _token_ids(given: Sequence[int] | None | Exception, rejects: RejectCounter | None) -> list[int] | None:
    """A tokenize's outcome as a list of token ids; None (counted unless it gave None) for anything else. The one
    rule for the sync transport's call, the async one's worker thread and its engine round trip."""
    if given is None:
        return None
    if isinstance(given, Exception):
        problem = f"{type(given).__name__}: {given}"
    else:
        tokens = list(given)
        if tokens and all(type(t) is int and 0 <= t < 2**32 for t in tokens):
            return tokens
        problem = "no token ids" if not tokens else "ids that are not 32-bit unsigned integers"
    if rejects is not None:
        rejects.count("tokenize", f"the transport's tokenize gave {problem}; the request's blocks are its text's")
    return None


def _prompt_tokens(body: Any) -> list[int] | None:
    """A completions request's prompt given as token ids, else None."""
    prompt = body.get("prompt") if isinstance(body, dict) else None
    if isinstance(prompt, list) and prompt and all(type(t) is int and 0 <= t < 2**32 for t in prompt):
        return prompt
    return None


def outcome_of(exc: BaseException) -> Outcome:
    """The endpoint outcome an httpx exception stands for."""
    if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
        return Outcome.CONNECT
    if isinstance(exc, httpx.TimeoutException):
        return Outcome.TIMEOUT
    if isinstance(exc, httpx.TransportError):
        return Outcome.ERROR
    return Outcome.NONE


REFUSED_STATUSES = frozenset({429, 503})
"""Statuses with which an endpoint says it did not take the request (overloaded, rate-limited): such a request
was not run, so it goes again to another endpoint. Other failures (a 500, a 502 from a proxy that had sent it
on, a 504) may have run it, and are handed to the caller."""


def outcome_of_status(status: int) -> Outcome:
    """The endpoint outcome a response status stands for: a 5xx or a 429 is the endpoint's failure; any other
    status is its success (a 4xx is the caller's fault, and says nothing about the endpoint's health)."""
    return Outcome.ERROR if status >= 500 or status == 429 else Outcome.OK


def _forward(request: httpx.Request, lease: Lease) -> httpx.Request:
    """The request re-addressed to the lease's endpoint, with the lease's session headers."""
    target = endpoint_url(lease.address)
    url = request.url.copy_with(
        scheme=target.scheme, host=target.host, port=target.port, path=target.path.rstrip("/") + request.url.path
    )
    headers = httpx.Headers(request.headers)
    del headers["host"]
    headers.update(lease.headers)
    return httpx.Request(request.method, url, headers=headers, content=request.content, extensions=request.extensions)


def _leased(response: httpx.Response, stream: httpx.SyncByteStream | httpx.AsyncByteStream) -> httpx.Response:
    """The response handed to the caller, its body read through `stream`."""
    return httpx.Response(response.status_code, headers=response.headers, stream=stream, extensions=response.extensions)


class _Run:
    """One request's attempts as both transports make them: the lease of each attempt, and what a raised
    exception or a response status means for the next. The transports only send and close (as httpx maps
    exceptions once for its sync and async transports); this does no I/O."""

    def __init__(self, request: httpx.Request, attempts: Attempts, streamed: bool, lease: Lease) -> None:
        self._request = request
        self._attempts = attempts
        self._streamed = streamed
        self.lease = lease
        """The current attempt's lease (the first's from `Attempts.first` or `afirst`, after the request's turn)."""

    def forwarded(self) -> httpx.Request:
        """The request re-addressed to the current attempt's endpoint."""
        return _forward(self._request, self.lease)

    def failed(self, exc: BaseException) -> bool:
        """End the current attempt, which raised `exc` (a cancelled one too: it must not stay in flight); whether
        the request goes again (on the next attempt's lease), else the caller raises `exc`."""
        outcome = outcome_of(exc)
        self.lease.fail(outcome)
        self.lease.end(exc)
        following = self._attempts.retry(self.lease, outcome)
        if following is None:
            return False
        self.lease = following
        return True

    def retried(self, status: int) -> Lease | None:
        """Report the current attempt's response status as its lease's outcome. None hands the response to the
        caller; else the request goes again on the next attempt's lease, and this returns the finished
        attempt's, which the caller ends once it has closed the response."""
        outcome = outcome_of_status(status)
        if outcome is not Outcome.OK:
            self.lease.fail(outcome)
        following = self._attempts.retry(self.lease, outcome, refused=status in REFUSED_STATUSES)
        if following is None:
            return None
        finished, self.lease = self.lease, following
        return finished

    def tokens(self, response: httpx.Response) -> bool:
        """Whether the handed response's first non-empty chunk is the first token: a successful streamed one."""
        return self._streamed and response.is_success


class _LeaseBody(Generic[_Stream]):
    """A response body that ends its lease when closed (a failure while reading is the endpoint's outcome).

    With `tokens` (a successful streamed completion) its first non-empty chunk is the first token: that is
    when the engine has done the prompt's prefill, which the response head, sent at once, says nothing of.
    The sync and async bodies differ only in how they read and close `stream`.
    """

    def __init__(self, stream: _Stream, lease: Lease, tokens: bool, counted: _Counted) -> None:
        self._stream: _Stream = stream
        self._lease = lease
        self._tokens = tokens
        self._counted = counted

    def _chunk(self, chunk: bytes) -> bytes:
        """`chunk`, read; the first non-empty one of a streamed completion reports the first token."""
        if self._tokens and chunk:
            self._tokens = False
            self._lease.first_token()
        return chunk

    def _broken(self, exc: Exception) -> None:
        """Reading the body raised `exc`: the endpoint's outcome."""
        self._lease.fail(outcome_of(exc))

    def _retransmits(self) -> None:
        """Before the connection goes back to the pool (or closes): the segments it retransmitted for this request,
        counted on the lease's endpoint (`Lease.retransmitted`)."""
        retransmits, connection = self._counted
        segments = retransmits.since_last(connection)
        if segments is not None:
            self._lease.retransmitted(segments)


class _LeaseStream(_LeaseBody[httpx.SyncByteStream], httpx.SyncByteStream):
    """`_LeaseBody` for the sync transport."""

    def __iter__(self) -> Iterator[bytes]:
        try:
            for chunk in self._stream:
                yield self._chunk(chunk)
        except Exception as exc:
            self._broken(exc)
            raise

    def close(self) -> None:
        self._retransmits()
        try:
            self._stream.close()
        finally:
            self._lease.end()


class _AsyncLeaseStream(_LeaseBody[httpx.AsyncByteStream], httpx.AsyncByteStream):
    """`_LeaseBody` for the async transport."""

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._stream:
                yield self._chunk(chunk)
        except Exception as exc:
            self._broken(exc)
            raise

    async def aclose(self) -> None:
        self._retransmits()
        try:
            await self._stream.aclose()
        finally:
            self._lease.end()


class _Routing(Generic[_Transport]):
    """What both transports hold, and how they start a request's attempts.

    `tries`: attempts per request at most (None: the router's `Settings.connect_tries`). `tokenize`: a JSON
    body's prompt token ids as the engines compute them (see the module docstring); "engine" (the default), an
    `EngineTokenizer` of `router`, which asks the engines while their KV events reach the router, closed with the
    transport; None keys text by its text blocks alone."""

    _default: Callable[[], _Transport]
    """Makes the transport that sends when none is given."""

    def __init__(
        self,
        router: Router,
        *,
        transport: _Transport | None = None,
        block_size: int = BLOCK_SIZE,
        prefix_tokens: int = PREFIX_TOKENS,
        tries: int | None = None,
        tokenize: Tokenize | Literal["engine"] | None = "engine",
    ) -> None:
        self._router = router
        self._transport: _Transport = transport or self._default()
        self._block_size = block_size
        self._prefix_tokens = prefix_tokens
        self._tries = tries
        self._retransmits = Retransmits()
        self._engines = EngineTokenizer(router) if isinstance(tokenize, str) else None
        """The transport's own tokenizer (`tokenize="engine"`), closed with it."""
        self._tokenize: Tokenize | None = self._engines if isinstance(tokenize, str) else tokenize

    def _attempts(self, request: httpx.Request) -> tuple[Attempts, bool]:
        """The attempts of `request`, its body read, and whether it is streamed: a streamed request reports its
        first token and waits for its turn (`Router.turn`); one read whole does neither."""
        described, streamed = describe(
            request, self._block_size, self._prefix_tokens, self._tokenize, self._router.rejects
        )
        return self._started(described, streamed)

    def _counted(self, response: httpx.Response) -> _Counted:
        """What the handed response's body counts its connection's retransmits with (`_tcpinfo`)."""
        return self._retransmits, response.extensions.get("network_stream")

    def _started(self, described: Request, streamed: bool) -> tuple[Attempts, bool]:
        return Attempts(self._router, described, self._tries, first_tokens=streamed), streamed

    async def _aattempts(self, request: httpx.Request) -> tuple[Attempts, bool]:
        """`_attempts` for a coroutine: the engines asked over the event loop's own connections, another
        `tokenize` (a tokenizer's CPU time) on a worker thread, so that the event loop goes on meanwhile."""
        rejects = self._router.rejects
        prompt = _Prompt.of(request, self._block_size, rejects)
        tokens = prompt.tokens
        if self._tokenize is not None and prompt.asks:
            if self._engines is not None:
                tokens = _token_ids(await _aoutcome(self._engines.acall, prompt.body), rejects)
            else:
                tokens = _token_ids(await asyncio.to_thread(_outcome, self._tokenize, prompt.body), rejects)
        return self._started(prompt.request(tokens, self._prefix_tokens), prompt.streamed)


class PrismTransport(_Routing[httpx.BaseTransport], httpx.BaseTransport):
    """Sends each request of a sync httpx client to the endpoint `router` picks (see the module docstring;
    the keywords are `_Routing`'s)."""

    _default = httpx.HTTPTransport

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.read()
        attempts, streamed = self._attempts(request)
        run = _Run(request, attempts, streamed, attempts.first())
        while True:
            run.lease.begin()
            try:
                response = self._transport.handle_request(run.forwarded())
            except BaseException as exc:
                if run.failed(exc):
                    continue
                raise
            finished = run.retried(response.status_code)
            if finished is None:
                assert isinstance(response.stream, httpx.SyncByteStream)
                counted = self._counted(response)
                return _leased(response, _LeaseStream(response.stream, run.lease, run.tokens(response), counted))
            try:
                response.close()
            finally:
                finished.end()

    def close(self) -> None:
        try:
            self._transport.close()
        finally:
            if self._engines is not None:
                self._engines.close()


class AsyncPrismTransport(_Routing[httpx.AsyncBaseTransport], httpx.AsyncBaseTransport):
    """Sends each request of an async httpx client to the endpoint `router` picks (see the module docstring;
    the keywords are `_Routing`'s)."""

    _default = httpx.AsyncHTTPTransport

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await request.aread()
        attempts, streamed = await self._aattempts(request)
        run = _Run(request, attempts, streamed, await attempts.afirst())
        while True:
            run.lease.begin()
            try:
                response = await self._transport.handle_async_request(run.forwarded())
            except BaseException as exc:
                if run.failed(exc):
                    continue
                raise
            finished = run.retried(response.status_code)
            if finished is None:
                assert isinstance(response.stream, httpx.AsyncByteStream)
                counted = self._counted(response)
                return _leased(response, _AsyncLeaseStream(response.stream, run.lease, run.tokens(response), counted))
            try:
                await response.aclose()
            finally:
                finished.end()

    async def aclose(self) -> None:
        try:
            await self._transport.aclose()
        finally:
            if self._engines is not None:
                self._engines.close()
