"""The time-to-first-token target of a request: what the brain weighs nodes against, what the router orders the
requests it holds back by, and what the evaluation scores.

    SLO = max(τ0 of the request's slice, SLO_SCALE × its unloaded TTFT)

τ0 is the slice's interactive tolerance, the floor for short prompts; the scaled term takes over for long ones,
which no cluster can prefill within τ0. SLO_SCALE = 5 after DistServe (OSDI'24), which sets TTFT SLOs as multiples
of a single request's baseline latency, and Mooncake (FAST'25), which sets its TTFT threshold as a multiple of a
request's TTFT without interference: a request may wait behind a few prompts of its own size and still meet it.
"""

from __future__ import annotations

from collections.abc import Mapping

from ._modality import Slice

TAU0_MS: Mapping[Slice, float] = {Slice.LLM: 800.0, Slice.VLM: 1200.0, Slice.AV: 250.0, Slice.RAG: 800.0}
"""Each slice's τ0: the TTFT a short interactive request of the slice tolerates, in milliseconds."""
SLO_SCALE = 5.0
"""TTFT SLO as a multiple of the request's unloaded TTFT."""


def ttft_slo_s(slice_: Slice, unloaded_s: float, scale: float = SLO_SCALE) -> float:
    """The TTFT SLO in seconds of a request of `slice_` whose TTFT alone on an idle node is `unloaded_s`; `scale` in
    place of SLO_SCALE for a service whose SLO is another multiple (a router's `Settings.slo_scale`)."""
    return max(TAU0_MS[slice_] / 1000, scale * unloaded_s)
