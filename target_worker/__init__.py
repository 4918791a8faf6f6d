"""Target worker: holds each sequence's KV cache; batched prefill and verification."""
