"""gRPC plumbing shared by the services: conversions, the error interceptor, server start-up."""
