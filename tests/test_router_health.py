"""Failures: passive health (nginx max_fails / fail_timeout), the circuit breaker, retries, panic and fallbacks."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from prismlb.router import Circuit, Outcome, Request, Router, Settings
from prismlb.wire import RoutingTable, SliceTable, TableNode

from .conftest import Clock


def table(*slices: SliceTable, version: int = 1) -> RoutingTable:
    return RoutingTable(epoch=1, version=version, issued_unix_s=time.time(), slices=list(slices))


def llm(*ids: str, endpoints: dict[str, str] | None = None) -> SliceTable:
    addresses = endpoints or {}
    return SliceTable(
        name="llm", nodes=[TableNode(node_id=i, endpoint=addresses.get(i, f"{i}:8000"), weight=1.0) for i in ids]
    )


def router(clock: Clock | None = None, **settings: object) -> Router:
    """A router over nodes a, b and c; on `clock` (the test moves it) when given, else on the monotonic clock."""
    return Router.from_table(
        table(llm("a", "b", "c")),
        settings=Settings(**settings),  # type: ignore[arg-type]
        clock=time.monotonic if clock is None else clock,
    )


def key_owned_by(r: Router, node_id: str) -> str:
    return next(k for k in (f"key-{i}" for i in range(10_000)) if r.route(k).node_id == node_id)


def fail(r: Router, key: str, outcome: Outcome) -> str:
    with r.request(key) as lease:
        lease.fail(outcome)
    return lease.node_id


def test_a_failed_attempt_makes_the_endpoint_unavailable_for_fail_timeout() -> None:
    clock = Clock()
    r = router(clock, max_fails=1, fail_timeout_s=0.3)
    key = key_owned_by(r, "a")
    assert fail(r, key, Outcome.CONNECT) == "a"
    assert not r.status()["a"].available
    moved = r.route(key).node_id
    assert moved != "a"
    assert r.route(key).node_id == moved  # the next probe, every time
    clock.now += 0.29
    assert not r.status()["a"].available
    clock.now += 0.02
    assert r.status()["a"].available and r.route(key).node_id == "a"  # back after fail_timeout
    assert fail(r, key, Outcome.ERROR) == "a" and not r.status()["a"].available  # and out again on a failure


def test_max_fails_counts_failures_within_fail_timeout_only() -> None:
    clock = Clock()
    r = router(clock, max_fails=3, fail_timeout_s=0.3)
    key = key_owned_by(r, "b")
    fail(r, key, Outcome.CONNECT)
    fail(r, key, Outcome.CONNECT)
    clock.now += 0.35  # the window passed: the count starts again
    fail(r, key, Outcome.CONNECT)
    assert r.status()["b"].available
    fail(r, key, Outcome.ERROR)
    with r.request(key):
        pass  # a success clears the count
    fail(r, key, Outcome.ERROR)
    fail(r, key, Outcome.ERROR)
    assert r.status()["b"].available
    fail(r, key, Outcome.ERROR)
    assert not r.status()["b"].available
    assert r.status()["b"].outcomes == {Outcome.CONNECT: 3, Outcome.ERROR: 4, Outcome.OK: 1}


def test_max_fails_zero_never_marks_an_endpoint_down() -> None:
    r = router(max_fails=0)
    key = key_owned_by(r, "c")
    for _ in range(10):
        fail(r, key, Outcome.CONNECT)
    assert r.status()["c"].available and r.route(key).node_id == "c"


def test_exceptions_leaving_the_block_are_classified() -> None:
    r = router(max_fails=0)
    key = key_owned_by(r, "a")
    for exc, outcome in [
        (ConnectionRefusedError(), Outcome.CONNECT),
        (TimeoutError(), Outcome.TIMEOUT),
        (ConnectionResetError(), Outcome.ERROR),
        (ValueError("the caller's own bug"), Outcome.NONE),
    ]:
        with pytest.raises(type(exc)), r.request(key):
            raise exc
        assert r.status()["a"].outcomes[outcome] == 1
    assert r.status()["a"].inflight == 0


def slow(r: Router, clock: Clock, key: str, delay_s: float = 0.03) -> str:
    """One request to `key` whose first token comes `delay_s` after it starts, on the router's `clock`."""
    with r.request(key) as lease:
        clock.now += delay_s
        lease.first_token()
    return lease.node_id


def test_three_slow_first_tokens_in_a_row_open_the_circuit_until_a_trial_succeeds() -> None:
    clock = Clock()
    r = router(clock, slow_s=0.02, open_s=0.3)
    key = key_owned_by(r, "a")
    slow(r, clock, key)
    slow(r, clock, key)
    slow(r, clock, key, delay_s=0)  # a fast one resets the count
    assert r.status()["a"].circuit is Circuit.NORMAL
    for _ in range(3):
        assert slow(r, clock, key) == "a"
    assert r.status()["a"].circuit is Circuit.OPEN and r.status()["a"].available is False
    assert r.status()["a"].outcomes[Outcome.SLOW] == 5
    assert r.route(key).node_id != "a"
    clock.now += 0.29
    assert r.status()["a"].circuit is Circuit.OPEN
    clock.now += 0.02  # open_s without requests: half-open
    assert r.status()["a"].circuit is Circuit.HALF_OPEN
    with r.request(key) as trial:
        assert trial.node_id == "a"
        assert r.request(key).node_id != "a"  # one trial at a time
    assert r.status()["a"].circuit is Circuit.NORMAL
    assert r.route(key).node_id == "a"


def test_a_failed_trial_opens_the_circuit_again() -> None:
    clock = Clock()
    r = router(clock, slow_s=0.02, open_s=0.2, max_fails=0)
    key = key_owned_by(r, "b")
    for _ in range(3):
        slow(r, clock, key)
    clock.now += 0.22
    assert slow(r, clock, key) == "b"  # the trial is slow too
    assert r.status()["b"].circuit is Circuit.OPEN
    assert r.route(key).node_id != "b"
    clock.now += 0.22
    with r.request(key) as trial:
        trial.fail(Outcome.TIMEOUT)
    assert trial.node_id == "b" and r.status()["b"].circuit is Circuit.OPEN


@pytest.mark.parametrize(("share", "opened"), [(0.1, 1), (0.25, 2), (1.0, 8)])
def test_open_circuits_are_capped_at_a_share_of_the_endpoints(share: float, opened: int) -> None:
    """Every endpoint timing out (an overloaded cluster, not a broken endpoint) opens at most `max_open_share` of
    the circuits (one at least); the rest stay closed and keep taking requests."""
    ids = [f"n{i}" for i in range(8)]
    r = Router.from_table(table(llm(*ids)), settings=Settings(max_fails=0, max_open_share=share))
    for node_id in ids:
        key = key_owned_by(r, node_id)
        for _ in range(3):
            assert fail(r, key, Outcome.TIMEOUT) == node_id
    states = r.status()
    assert sum(states[i].circuit is Circuit.OPEN for i in ids) == opened
    assert sum(states[i].available for i in ids) == 8 - opened


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield sock
    sock.close()


def refused_address() -> str:
    """A loopback address nothing listens on (the port was free a moment ago)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def connect(lease_address: str) -> str:
    host, port = lease_address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=2):
        return lease_address


def test_a_refused_connection_is_retried_on_the_next_probe(listener: socket.socket) -> None:
    live = f"127.0.0.1:{listener.getsockname()[1]}"
    r = Router.from_table(table(llm("dead", "live", endpoints={"dead": refused_address(), "live": live})))
    key = key_owned_by(r, "dead")
    assert r.call(key, lambda lease: connect(lease.address)) == live
    assert r.status()["dead"].outcomes == {Outcome.CONNECT: 1} and not r.status()["dead"].available
    assert r.status()["live"].outcomes == {Outcome.OK: 1}
    # With one try, the refusal reaches the caller (and the dead node is now skipped anyway).
    fresh = Router.from_table(table(llm("dead", "live", endpoints={"dead": refused_address(), "live": live})))
    with pytest.raises(ConnectionRefusedError):
        fresh.call(key, lambda lease: connect(lease.address), tries=1)
    assert fresh.call(key, lambda lease: connect(lease.address), tries=1) == live


def test_other_errors_are_not_retried() -> None:
    r = router()
    calls: list[str] = []

    def boom(lease: object) -> None:
        calls.append(str(lease))
        raise TimeoutError("read timed out")

    with pytest.raises(TimeoutError):
        r.call("k", boom, tries=3)
    assert len(calls) == 1


def test_with_every_endpoint_down_requests_still_go_somewhere() -> None:
    r = router(max_fails=1, fail_timeout_s=10)
    for node in ("a", "b", "c"):
        fail(r, key_owned_by(r, node), Outcome.CONNECT)
    assert not any(status.available for status in r.status().values())
    key = key_owned_by(Router.from_table(table(llm("a", "b", "c"))), "b")
    assert r.route(key).node_id == "b"  # panic: as if all were up, rather than fail every request
    with r.request(key) as lease:
        assert lease.node_id == "b"
    assert r.status()["b"].available  # that request succeeded


def test_a_slice_whose_endpoints_are_all_down_sends_its_requests_to_its_fallback() -> None:
    vlm = SliceTable(name="vlm", nodes=[TableNode(node_id="v", endpoint="v:8000", weight=1.0)], fallback="llm")
    r = Router.from_table(table(llm("a", "b"), vlm))
    assert r.route(Request(key="k", modality="image")).node_id == "v"
    fail(r, Request(key="k", modality="image"), Outcome.CONNECT)  # type: ignore[arg-type]
    assert r.route(Request(key="k", modality="image")).node_id in {"a", "b"}


def test_health_survives_a_new_table_and_goes_with_the_node() -> None:
    r = router(max_fails=1, fail_timeout_s=10)
    key = key_owned_by(r, "a")
    fail(r, key, Outcome.CONNECT)
    assert r.apply(table(llm("a", "b", "c", "d"), version=2))
    assert not r.status()["a"].available and r.route(key).node_id != "a"
    assert r.apply(table(llm("b", "c", "d"), version=3))
    assert "a" not in r.status()
    assert r.apply(table(llm("a", "b", "c", "d"), version=4))
    assert r.status()["a"].available  # a node that left and came back starts afresh


def test_settings_are_checked() -> None:
    for bad in ({"balance": 0.5}, {"max_fails": -1}, {"fail_timeout_s": 0.0}, {"connect_tries": 0}, {"open_s": -1.0}):
        with pytest.raises(ValueError):
            Settings(**bad)  # type: ignore[arg-type]
    assert Settings(balance=0).balance == 0 and Settings(max_fails=0).max_fails == 0


def test_a_lease_counts_once() -> None:
    r = router()
    lease = r.request("k")
    assert lease.end() is None  # never begun: nothing to report
    with lease:
        with pytest.raises(RuntimeError, match="already in flight"):
            lease.begin()
        assert r.status()[lease.node_id].inflight == 1
    assert lease.end() is None
    assert r.status()[lease.node_id].inflight == 0 and r.status()[lease.node_id].outcomes == {Outcome.OK: 1}


def test_an_endpoints_first_token_speed_is_its_streamed_requests_tokens_over_their_waits() -> None:
    clock = Clock()
    r = router(clock)
    node = r.route("k").node_id
    others = {label for label in r.status() if label != node}
    assert r.status()[node].first_token_speed is None
    with r.request(Request(key="k", cost=3000), exclude=others) as lease:
        clock.now += 0.5
        lease.first_token()
        clock.now += 0.5
        lease.first_token()  # a later call: the first token came once
    with r.request(Request(key="k", cost=1000), exclude=others) as lease:
        clock.now += 1.5
    lease.first_token()  # after the lease ended: no wait to count
    with r.request(Request(key="k", cost=1000), exclude=others) as lease:
        clock.now += 1.5
        lease.first_token()
    assert r.status()[node].first_token_speed == pytest.approx(4000 / 2.0)
    assert all(r.status()[label].first_token_speed is None for label in others)
