"""Coordinator: owns each request's token state and runs the draft -> verify loop."""
