"""Modality slices and the `X-Modality-Signature` grammar that picks one.

A signature names a request's parts joined by `+` (also `,` or spaces), in any order and case:
`text`, `image+text`, `audio+video`, `rag+text`. Aliases: txt → text; img, vision → image; speech → audio;
retrieval → rag. The slice is the most demanding part present: rag → RAG, audio or video → AV, image →
VLM, text alone → LLM. An empty or unknown signature maps to DEFAULT_SLICE (LLM) and is reported as unknown.
"""

from __future__ import annotations

import re
from enum import StrEnum

MODALITY_HEADER = "X-Modality-Signature"
ENGINE_LATENCY_KEY = "engine"  # NodeVector.latency key for the engine's own, slice-less histograms


class Slice(StrEnum):
    LLM = "llm"
    VLM = "vlm"
    AV = "av"
    RAG = "rag"


DEFAULT_SLICE = Slice.LLM

_PARTS = {
    "text": "text",
    "txt": "text",
    "image": "image",
    "img": "image",
    "vision": "image",
    "audio": "audio",
    "speech": "audio",
    "video": "video",
    "rag": "rag",
    "retrieval": "rag",
}
_SPLIT = re.compile(r"[+,\s]+")
_MAX_SIGNATURE = 256


def parse_signature(signature: str | None) -> tuple[Slice, bool]:
    """(slice, known) for a modality signature; unknown or empty gives (DEFAULT_SLICE, False)."""
    if not signature or len(signature) > _MAX_SIGNATURE:
        return DEFAULT_SLICE, False
    parts = set()
    for token in _SPLIT.split(signature.strip().lower()):
        if not token:
            continue
        part = _PARTS.get(token)
        if part is None:
            return DEFAULT_SLICE, False
        parts.add(part)
    if not parts:
        return DEFAULT_SLICE, False
    if "rag" in parts:
        return Slice.RAG, True
    if parts & {"audio", "video"}:
        return Slice.AV, True
    if "image" in parts:
        return Slice.VLM, True
    return Slice.LLM, True
