"""Model-side engine: loading, fetching, per-sequence KV and batched forwards (no grpc)."""
