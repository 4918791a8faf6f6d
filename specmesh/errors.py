"""Typed errors. Core code raises these; one server interceptor maps them to gRPC status codes."""

from __future__ import annotations


class SpecmeshError(Exception):
    """Base class. `code` names the gRPC status the interceptor answers with."""

    code = "INTERNAL"


class InvalidArgument(SpecmeshError):
    code = "INVALID_ARGUMENT"

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class Unauthenticated(SpecmeshError):
    code = "UNAUTHENTICATED"


class PermissionDenied(SpecmeshError):
    code = "PERMISSION_DENIED"


class ResourceExhausted(SpecmeshError):
    code = "RESOURCE_EXHAUSTED"

    def __init__(self, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unavailable(SpecmeshError):
    code = "UNAVAILABLE"


class DeadlineExceeded(SpecmeshError):
    code = "DEADLINE_EXCEEDED"


class NotFound(SpecmeshError):
    code = "NOT_FOUND"


class FailedPrecondition(SpecmeshError):
    code = "FAILED_PRECONDITION"


class Cancelled(SpecmeshError):
    code = "CANCELLED"


class ModelIntegrityError(FailedPrecondition):
    """Model files are missing, incomplete or corrupted (fix: run `specmesh fetch-model`)."""
