"""Names shared by the worker library (which emits them) and the agent (which reads them)."""

from __future__ import annotations

from typing import Final

# Spans
REQUEST_SPAN: Final = "prism.request"
STAGE_SPAN_PREFIX: Final = "prism.stage."
ATTR_SIGNATURE: Final = "prism.modality.signature"
ATTR_SLICE: Final = "prism.slice"
ATTR_STAGE: Final = "prism.stage"
ATTR_TTFT_MS: Final = "prism.ttft_ms"

STAGES: Final = ("image_decode", "audio_features", "video_decode", "tokenize", "prefill", "decode")
CPU_PREPROCESSING_STAGES: Final = frozenset({"image_decode", "audio_features", "video_decode", "tokenize"})

# Metrics (gauges, one point per GPU, attribute ATTR_GPU = device index)
ATTR_GPU: Final = "gpu.index"
METRIC_FRAGMENTATION: Final = "prism.gpu.allocator.fragmentation"
METRIC_FREE_ENTROPY: Final = "prism.gpu.allocator.free_entropy"
METRIC_LARGEST_FREE_RATIO: Final = "prism.gpu.allocator.largest_free_ratio"
METRIC_LARGEST_FREE_BYTES: Final = "prism.gpu.allocator.largest_free_bytes"
METRIC_FREE_BYTES: Final = "prism.gpu.allocator.free_bytes"
METRIC_RESERVE_ADVICE_BYTES: Final = "prism.gpu.allocator.reserve_advice_bytes"
