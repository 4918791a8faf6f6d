"""Observability: request context, OpenTelemetry tracing, Prometheus metrics, gRPC interceptors."""
