"""Names shared by the worker library (which emits them) and the agent (which reads them)."""

from __future__ import annotations

from typing import Final

# Spans. The request span is named by the GenAI conventions (`{operation} {model}`), so consumers find it by
# ATTR_SPAN = SPAN_REQUEST; stage spans keep their `prism.stage.<name>` names.
ATTR_SPAN: Final = "prism.span"
SPAN_REQUEST: Final = "request"
STAGE_SPAN_PREFIX: Final = "prism.stage."
ATTR_SIGNATURE: Final = "prism.modality.signature"
ATTR_SLICE: Final = "prism.slice"
ATTR_STAGE: Final = "prism.stage"

# The request span as prismlb.otel emitted it before the GenAI names: deployed servers keep sending it for a
# while, so the agent still reads it.
LEGACY_REQUEST_SPAN: Final = "prism.request"
LEGACY_ATTR_TTFT_MS: Final = "prism.ttft_ms"

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
ATTR_GEN_AI_PROVIDER: Final = "gen_ai.provider.name"
ATTR_GEN_AI_REQUEST_MODEL: Final = "gen_ai.request.model"
ATTR_GEN_AI_INPUT_TOKENS: Final = "gen_ai.usage.input_tokens"
ATTR_GEN_AI_OUTPUT_TOKENS: Final = "gen_ai.usage.output_tokens"
ATTR_GEN_AI_CACHED_TOKENS: Final = "gen_ai.usage.cache_read.input_tokens"
"""Prompt tokens served from the prefix cache (included in ATTR_GEN_AI_INPUT_TOKENS)."""
PROVIDER_OTHER: Final = "_OTHER"
"""`gen_ai.provider.name` when the serving engine is not known (the conventions' fallback value)."""

# Server-side latencies in seconds, as vLLM's own request span (`llm_request`) carries them. The conventions
# define TTFT only as the metric `gen_ai.server.time_to_first_token` (seconds) and, on spans, the client-side
# `gen_ai.response.time_to_first_chunk`; the engine-side span attribute is vLLM's name, so one reader in the
# agent serves both Prism's span and vLLM's.
ATTR_GEN_AI_TTFT_S: Final = "gen_ai.latency.time_to_first_token"
ATTR_GEN_AI_E2E_S: Final = "gen_ai.latency.e2e"

# Instrumentation scope of the spans and gauges
SCOPE: Final = "prismlb.otel"
