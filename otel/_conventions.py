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

STAGES: Final = ("queue", "image_decode", "audio_features", "video_decode", "tokenize", "encode", "prefill", "decode")
CPU_PREPROCESSING_STAGES: Final = frozenset({"image_decode", "audio_features", "video_decode", "tokenize"})

# Metrics (gauges, one point per GPU, attribute ATTR_GPU = device index)
ATTR_GPU: Final = "gpu.index"
METRIC_FRAGMENTATION: Final = "prism.gpu.allocator.fragmentation"
METRIC_FREE_ENTROPY: Final = "prism.gpu.allocator.free_entropy"
METRIC_LARGEST_FREE_RATIO: Final = "prism.gpu.allocator.largest_free_ratio"
METRIC_LARGEST_FREE_BYTES: Final = "prism.gpu.allocator.largest_free_bytes"
METRIC_FREE_BYTES: Final = "prism.gpu.allocator.free_bytes"
METRIC_RESERVE_ADVICE_BYTES: Final = "prism.gpu.allocator.reserve_advice_bytes"
METRIC_RESERVED_BYTES: Final = "prism.gpu.allocator.reserved_bytes"
METRIC_ALLOCATED_BYTES: Final = "prism.gpu.allocator.allocated_bytes"

# OpenTelemetry GenAI semantic conventions, set on the request span
ATTR_GEN_AI_OPERATION: Final = "gen_ai.operation.name"
ATTR_GEN_AI_REQUEST_MODEL: Final = "gen_ai.request.model"
ATTR_GEN_AI_INPUT_TOKENS: Final = "gen_ai.usage.input_tokens"
ATTR_GEN_AI_OUTPUT_TOKENS: Final = "gen_ai.usage.output_tokens"

# Instrumentation scope of the spans and gauges
SCOPE: Final = "prismlb.otel"
