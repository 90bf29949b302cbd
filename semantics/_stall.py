"""The network stall a request can expect on a node: what a lost segment costs, counted where it is lost.

One rule for both ends of the link. A node's agent counts the segments its host retransmitted (the replies' and
first tokens' losses: `prism_agent` eBPF, the brain's `stall_ms`); a router counts those its own connections to the
node retransmitted (the requests' losses, which the node's kernel never sends again: `TCP_INFO`). Each divides by
the requests those segments served and prices a retransmission at Linux's minimum timeout."""

from __future__ import annotations

RTO_MIN_MS = 200.0
"""Linux's minimum TCP retransmission timeout (`TCP_RTO_MIN`): what one lost segment of a request costs at the
least when nothing follows it in flight to trigger a fast retransmit, as with a request's or a first token's
last segments."""
MAX_RETRANSMITS_PER_REQUEST = 10.0
"""Retransmits per request are capped here (2 s of stall): more says that the requests are too few to divide by,
or that the link is down, which the node's failing requests tell the routers sooner."""

STALL_SMOOTHING_S = 15.0
"""Time constant of the exponential averages a stall is taken from, at both ends: one window's noise, or one
unlucky request, cannot swing a node's expected time, and a link that heals is forgiven within a minute."""


def network_stall_ms(retransmits: float, requests: float) -> float:
    """The stall in ms one request can expect where `retransmits` segments were retransmitted for `requests`
    requests (both counts, or both rates, over the same span; `requests` > 0)."""
    return min(retransmits / requests, MAX_RETRANSMITS_PER_REQUEST) * RTO_MIN_MS
