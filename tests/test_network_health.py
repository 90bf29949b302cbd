"""The network dimensions of node health without a kernel: hand-computed scores, the agent's TCP window on
synthetic counters and events, the wire bounds of its fields and how fast the brain's weights follow them
(the real eBPF path is tests/test_kernel_health.py)."""

from __future__ import annotations

import pytest

from prismlb.agent._connections import Connection, Role
from prismlb.agent._network import NetworkWindow, TcpCounts
from prismlb.agent._node import NodeSampler, Reading, Source
from prismlb.brain import Registry, compute_weights
from prismlb.brain._registry import quality
from prismlb.semantics import Slice
from prismlb.semantics import health as score
from prismlb.wire import MAX_MS, MAX_VECTOR_BYTES, InvalidFieldError, NodeMetrics, NodeVector, decode, encode

from ._helpers_vectors import node_vector

ZERO = TcpCounts(0, 0, 0, 0, 0)


def test_each_network_dimension_scores_against_its_alarm() -> None:
    """1 − 0.5 × value / alarm, floored at 0; alarms at 0.5 retransmits/conn, 200 ms, 5 resets/s, 1 refused/s."""
    calm = score(NodeMetrics(tcp_retransmits_per_conn=0.0, tcp_resets_per_s=0.0, tcp_refused_per_s=0.0))
    assert (calm.score, calm.alarms) == (1.0, ())
    assert calm.dimensions == ("tcp_retransmits_per_conn", "tcp_resets_per_s", "tcp_refused_per_s")
    for metrics, expected, alarms in [
        (NodeMetrics(tcp_retransmits_per_conn=0.25), 0.75, ()),
        (NodeMetrics(tcp_retransmits_per_conn=0.5), 0.5, ()),  # at the threshold, not over it
        (NodeMetrics(tcp_retransmits_per_conn=0.6), 0.4, ("tcp_retransmits_per_conn",)),
        (NodeMetrics(tcp_retransmits_per_conn=3.0), 0.0, ("tcp_retransmits_per_conn",)),
        (NodeMetrics(tcp_handshake_p95_ms=1.2), 0.997, ()),
        (NodeMetrics(tcp_handshake_p95_ms=1010.0), 0.0, ("tcp_handshake_p95_ms",)),  # a SYN lost
        (NodeMetrics(tcp_resets_per_s=2.5), 0.75, ()),
        (NodeMetrics(tcp_resets_per_s=6.0), 0.4, ("tcp_resets_per_s",)),
        (NodeMetrics(tcp_refused_per_s=0.5), 0.75, ()),  # a dead brain's agent retrying every 2 s
        (NodeMetrics(tcp_refused_per_s=1.5), 0.25, ("tcp_refused_per_s",)),
    ]:
        h = score(metrics)
        assert h.score == pytest.approx(expected), metrics
        assert h.alarms == alarms, metrics


def test_a_lossy_node_keeps_a_third_of_a_sound_ones_quality() -> None:
    """Host at 45% CPU and 45% memory (score 0.75 each, weight 0.1 each), no resets or refusals (weights 0.05 and
    0.1, score 1.0) and retransmits at twice the alarm (weight 0.2, score 0.0): health 0.55 against 0.91, and
    halved for the alarm."""
    host = {"cpu_util_ratio": 0.45, "mem_used_bytes": 45, "mem_total_bytes": 100}
    tcp = {"tcp_resets_per_s": 0.0, "tcp_refused_per_s": 0.0}
    sound = score(NodeMetrics(**host, **tcp, tcp_retransmits_per_conn=0.0))
    lossy = score(NodeMetrics(**host, **tcp, tcp_retransmits_per_conn=1.0))
    assert sound.score == pytest.approx((0.1 * 0.75 * 2 + 0.05 + 0.1 + 0.2) / 0.55)
    assert lossy.score == pytest.approx((0.1 * 0.75 * 2 + 0.05 + 0.1) / 0.55)
    assert lossy.alarms == ("tcp_retransmits_per_conn",)
    assert quality(lossy) / quality(sound) == pytest.approx(0.5 * 0.3 / 0.5)


class _Kernel:
    """Counters and a clock a test sets by hand."""

    def __init__(self) -> None:
        self.counts = ZERO
        self.now = 100.0


def _client(handshake_us: float | None, role: Role = "client") -> Connection:
    return Connection(1, role, "10.0.0.1", 40000, "10.0.0.2", 8000, 0, handshake_us=handshake_us)


def test_window_divides_by_connections_active_in_it_and_by_its_length() -> None:
    kernel = _Kernel()
    window = NetworkWindow(lambda: kernel.counts, lambda: kernel.now)
    for ms in range(1, 21):
        window.established(_client(ms * 1000.0))
    window.established(_client(None, "server"))  # a server has no handshake time: not a sample
    kernel.counts, kernel.now = TcpCounts(opened=4, ended=1, retransmits=6, resets=2, refused=1), 101.0
    assert window.read() == {
        "tcp_retransmits_per_conn": 6 / 4,  # four opened, none ended before the window began
        "tcp_handshake_p95_ms": pytest.approx(19.05),  # rank 0.95 × 19 = 18.05 between 19 and 20 ms
        "tcp_retransmits_per_s": 6.0,
        "tcp_resets_per_s": 2.0,
        "tcp_refused_per_s": 1.0,
    }
    # three still open at the start (4 − 1); every one ends; nothing else happens for two seconds
    kernel.counts, kernel.now = TcpCounts(opened=4, ended=4, retransmits=6, resets=2, refused=1), 103.0
    assert window.read() == {
        "tcp_retransmits_per_conn": 0.0,
        "tcp_handshake_p95_ms": None,
        "tcp_retransmits_per_s": 0.0,
        "tcp_resets_per_s": 0.0,
        "tcp_refused_per_s": 0.0,
    }
    kernel.now = 104.0  # no connection at all: retransmits per connection are not measured, rates are
    assert window.read()["tcp_retransmits_per_conn"] is None


def test_window_counts_a_long_connection_in_every_window_it_spans() -> None:
    """Opened before the window, retransmitting during it, ended after it: its retransmits are this window's."""
    kernel = _Kernel()
    kernel.counts = TcpCounts(opened=1, ended=0, retransmits=0, resets=0, refused=0)
    window = NetworkWindow(lambda: kernel.counts, lambda: kernel.now)
    for retransmits in (3, 5):
        kernel.counts, kernel.now = kernel.counts._replace(retransmits=retransmits), kernel.now + 1.0
        assert window.read()["tcp_retransmits_per_conn"] == {3: 3.0, 5: 2.0}[retransmits]


def test_window_without_length_and_absurd_handshakes_stay_within_the_wire() -> None:
    kernel = _Kernel()
    window = NetworkWindow(lambda: kernel.counts, lambda: kernel.now)
    window.established(_client(1e13))  # 10^10 ms: only with SYN retries raised far past any default
    values = window.read()  # same instant as construction
    assert values["tcp_handshake_p95_ms"] == MAX_MS
    assert values["tcp_resets_per_s"] is None and values["tcp_refused_per_s"] is None
    assert values["tcp_retransmits_per_s"] is None


def _vector(node_id: str, seq: int, period_s: float, **metrics: float) -> NodeVector:
    return node_vector(node_id, seq, period_s=period_s, metrics=NodeMetrics(**metrics))


def test_fields_travel_and_out_of_range_values_are_refused() -> None:
    fields = {"tcp_retransmits_per_conn": 1.5, "tcp_handshake_p95_ms": 3.0, "tcp_resets_per_s": 0.0}
    vector = _vector("n", 1, 1.0, **fields)
    assert decode(encode(vector), (NodeVector,), MAX_VECTOR_BYTES) == vector
    assert b"tcp_refused_per_s" not in encode(vector)[2]  # not measured: absent, never 0
    for name, bad in [("tcp_retransmits_per_conn", -0.1), ("tcp_handshake_p95_ms", 2e7), ("tcp_refused_per_s", 2e9)]:
        with pytest.raises(InvalidFieldError):
            decode(encode(_vector("n", 1, 1.0, **{name: bad})), (NodeVector,), MAX_VECTOR_BYTES)


def test_sampler_carries_the_window_into_the_vector_and_the_brain_alarms_on_it() -> None:
    kernel = _Kernel()
    window = NetworkWindow(lambda: kernel.counts, lambda: kernel.now)
    sampler = NodeSampler([Source("ebpf", 1.0, lambda: Reading(metrics=window.read()))])
    kernel.counts, kernel.now = TcpCounts(opened=2, ended=0, retransmits=3, resets=0, refused=0), 101.0
    state = sampler.tick(0.0)
    assert state.metrics.tcp_retransmits_per_conn == 1.5
    assert state.metrics.tcp_handshake_p95_ms is None  # no handshake in the window
    judged = score(state.metrics)  # what the brain's registry computes from the vector
    assert judged.alarms == ("tcp_retransmits_per_conn",)
    assert judged.score == pytest.approx((0.0 * 0.2 + 1.0 * 0.05 + 1.0 * 0.1) / 0.35)


@pytest.mark.parametrize(("period_s", "first_lower"), [(2.0, 1), (1.0, 2)])
def test_brain_weighs_a_lossy_node_below_a_sound_one_within_two_periods(period_s: float, first_lower: int) -> None:
    """The nodes above from vector 1 on. The brain averages quality over 15 s, so a node's weight moves one step
    (0.075 hysteresis) once its quality fell 0.075 / (1 − 0.3) of the way: after 1.7 s of lossy vectors, the
    first at a 2 s period and the second at 1 s (with the alarm alone, quality ratio 0.5, it takes 2.4 s: the
    third at 1 s). The lossy node's weight then keeps falling."""
    registry = Registry(wall_clock=lambda: 1e6)
    host = {"cpu_util_ratio": 0.45, "mem_used_bytes": 45, "mem_total_bytes": 100}
    tcp = {"tcp_resets_per_s": 0.0, "tcp_refused_per_s": 0.0}
    weights: list[dict[str, float]] = []
    for seq in range(8):
        lossy = 1.0 if seq >= 1 else 0.0
        registry.update(_vector("lossy", seq, period_s, **host, **tcp, tcp_retransmits_per_conn=lossy), seq)
        registry.update(_vector("sound", seq, period_s, **host, **tcp, tcp_retransmits_per_conn=0.0), seq)
        table = compute_weights(registry.nodes, {})
        weights.append({entry.node_id: entry.weight for entry in table[Slice.LLM]})
    assert weights[first_lower - 1] == {"lossy": 1.0, "sound": 1.0}
    assert weights[first_lower]["lossy"] < weights[first_lower]["sound"] == 1.0
    assert weights[-1]["lossy"] < weights[first_lower]["lossy"]
