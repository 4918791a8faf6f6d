"""Gateway: the public gRPC API. Validates, then forwards to a coordinator with the deadline."""
