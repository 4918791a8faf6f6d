"""API keys (only their SHA-256 is stored), per-key rate limits in Redis, the gateway's guard."""
