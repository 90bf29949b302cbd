"""Worker library for inference servers: stage spans per modality and GPU-allocator metrics over OTLP."""
