"""Which nodes serve which modality slice (its pool), from node labels and what the agent measured.

Label keys (`prism agent --label KEY=VALUE`; values are case-insensitive; yes/no also accept true/false,
1/0 and on/off; any other value counts as unset):

| key | values | meaning | when unset |
|---|---|---|---|
| `gpu` | a100, a800, h100, h200, l40s, l4, … | GPU class | from the NVML name of the first GPU |
| `nvlink` | yes / no | GPUs joined by NVLink | yes when a GPU reports NVLink peers |
| `hbm3` | yes / no | HBM3 memory | yes for h100, h800, h200, h20, gh200, b200 (H100 PCIe has HBM2e: `hbm3=no`) |
| `av1` | yes / no | hardware AV1 codec | yes for the Ada classes l40s, l40, l4 |
| `cuda_graphs` | yes / no | the engine captures CUDA Graphs | no (it is an engine setting the agent cannot see) |
| `vectordb` | yes / no | the vector database runs on this host | no |
| `slices` | e.g. `llm,vlm` | the only slices the node's model can serve | every slice its hardware allows |

Pools are tiered: a slice's pool is its preferred nodes while any is live, with the generalists it accepts
(nodes no slice prefers), else its acceptable nodes.

| slice | preferred | acceptable | empty pool falls back to |
|---|---|---|---|
| llm | A100-class GPU (a100, a800) | every node (text runs anywhere; also nodes the agent could not describe) | — |
| vlm | NVLink and HBM3 (H100-class) | NVLink or HBM3 | llm |
| av | AV1 codec and CUDA Graphs (L40S-class) | AV1 codec | vlm |
| rag | vector-database host | — | llm |

A table names, for each empty slice, the nearest non-empty slice along that chain as its fallback.

A non-empty slice also lists, as overflow entries, the other nodes whose model serves it (`slices` label,
default every slice): an H100 without an AV1 codec can still decode audio and video, only it is kept for images.
Routers send a slice's requests there only while its pool is expected to be much slower (`Settings.overflow`).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from enum import IntEnum

from prismlb.semantics import Slice
from prismlb.wire import NodeVector

_SLICES = tuple(Slice)
_EVERY_SLICE = frozenset(Slice)
NEIGHBOUR: Mapping[Slice, Slice] = {Slice.VLM: Slice.LLM, Slice.AV: Slice.VLM, Slice.RAG: Slice.LLM}

A100_CLASS = frozenset({"a100", "a800"})
HBM3_CLASS = frozenset({"h100", "h800", "h200", "h20", "gh200", "b200"})
AV1_CLASS = frozenset({"l40s", "l40", "l4"})

_YES = frozenset({"yes", "true", "1", "on"})
_NO = frozenset({"no", "false", "0", "off"})
_GPU_NAME = re.compile(r"(?<![a-z0-9])(gh200|[abhl]\d{1,3}s?)(?![a-z0-9])")


class Tier(IntEnum):
    """How well a node fits a slice; a pool takes its best tier present."""

    NONE = 0
    ACCEPTABLE = 1
    PREFERRED = 2


@dataclass(frozen=True)
class Capabilities:
    """What a node offers the slices, labels first, then what the agent measured."""

    gpu_class: str | None
    nvlink: bool
    hbm3: bool
    av1: bool
    cuda_graphs: bool
    vectordb: bool
    slices: frozenset[Slice]


def _flag(labels: Mapping[str, str], key: str) -> bool | None:
    value = labels.get(key)
    if value is None:
        return None
    value = value.strip().lower()
    return True if value in _YES else False if value in _NO else None


def gpu_class(vector: NodeVector) -> str | None:
    """The `gpu` label, else the class named in the first GPU's NVML name (`NVIDIA H100 80GB HBM3` → h100)."""
    label = vector.labels.get("gpu", "").strip().lower()
    if label:
        return label
    match = _GPU_NAME.search(vector.gpus[0].name.lower()) if vector.gpus else None
    return str(match.group(1)) if match else None


def _served(labels: Mapping[str, str]) -> frozenset[Slice]:
    raw = labels.get("slices")
    if raw is None:
        return _EVERY_SLICE
    names = {part.strip().lower() for part in raw.split(",")}
    return frozenset(s for s in Slice if s.value in names)


def capabilities(vector: NodeVector) -> Capabilities:
    labels = vector.labels
    cls = gpu_class(vector)
    nvlink = _flag(labels, "nvlink")
    hbm3 = _flag(labels, "hbm3")
    av1 = _flag(labels, "av1")
    return Capabilities(
        gpu_class=cls,
        nvlink=any(g.nvlink_peers for g in vector.gpus) if nvlink is None else nvlink,
        hbm3=cls in HBM3_CLASS if hbm3 is None else hbm3,
        av1=cls in AV1_CLASS if av1 is None else av1,
        cuda_graphs=_flag(labels, "cuda_graphs") or False,
        vectordb=_flag(labels, "vectordb") or False,
        slices=_served(labels),
    )


def tier(caps: Capabilities, slice_: Slice) -> Tier:
    """How well a node with `caps` fits `slice_` (the table in this module's docstring)."""
    if slice_ not in caps.slices:
        return Tier.NONE
    match slice_:
        case Slice.LLM:
            preferred, acceptable = caps.gpu_class in A100_CLASS, True
        case Slice.VLM:
            preferred, acceptable = caps.nvlink and caps.hbm3, caps.nvlink or caps.hbm3
        case Slice.AV:
            preferred, acceptable = caps.av1 and caps.cuda_graphs, caps.av1
        case Slice.RAG:
            preferred, acceptable = caps.vectordb, False
    return Tier.PREFERRED if preferred else Tier.ACCEPTABLE if acceptable else Tier.NONE


def pools(vectors: Iterable[NodeVector]) -> dict[Slice, list[str]]:
    """Node ids per slice, in input order: the preferred nodes and the generalists the slice accepts if any node
    is preferred, else every acceptable node (maybe none).

    A generalist is a node no slice prefers: tiers reserve a node for the slices it is best at, and a node
    reserved for none would otherwise sit idle beside a saturated preferred pool (text on one H100 without
    NVLink, two A100s and one L40S without CUDA Graphs went to the A100s alone: 43% of the prefill capacity)."""
    described = [(vector.node_id, capabilities(vector)) for vector in vectors]
    fits = {node_id: {slice_: tier(caps, slice_) for slice_ in _SLICES} for node_id, caps in described}
    generalists = {node_id for node_id, fit in fits.items() if Tier.PREFERRED not in fit.values()}
    result: dict[Slice, list[str]] = {}
    for slice_ in _SLICES:
        preferred = any(fit[slice_] == Tier.PREFERRED for fit in fits.values())
        result[slice_] = [
            node_id
            for node_id, fit in fits.items()
            if fit[slice_] == Tier.PREFERRED
            or (fit[slice_] == Tier.ACCEPTABLE and (not preferred or node_id in generalists))
        ]
    return result


def overflow(vectors: Iterable[NodeVector], members: Mapping[Slice, Collection[str]]) -> dict[Slice, list[str]]:
    """Node ids per slice, in input order: the nodes outside the slice's pool (`members`, from `pools`) whose
    model serves it; none for an empty pool, whose requests take its fallback slice."""
    described = [(vector.node_id, capabilities(vector).slices) for vector in vectors]
    return {
        slice_: [node_id for node_id, served in described if slice_ in served and node_id not in pool]
        if (pool := set(members.get(slice_, ())))
        else []
        for slice_ in _SLICES
    }


def fallback(slice_: Slice, nonempty: Collection[Slice]) -> Slice | None:
    """Where an empty slice's requests go: the nearest non-empty slice along NEIGHBOUR, None if none is."""
    current = NEIGHBOUR.get(slice_)
    while current is not None and current not in nonempty:
        current = NEIGHBOUR.get(current)
    return current
