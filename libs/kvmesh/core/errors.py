"""Domain errors, free of gRPC. `kvmesh.rpc.errors` maps each class to one status code."""

from __future__ import annotations


class KvmeshError(Exception):
    """Base of every kvmesh domain error."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(KvmeshError):
    """A request field is invalid (INVALID_ARGUMENT); `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class ResourceExhausted(KvmeshError):
    """Out of capacity (RESOURCE_EXHAUSTED); retry after `retry_after_s` seconds."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unavailable(KvmeshError):
    """The service or a dependency is temporarily unavailable (UNAVAILABLE)."""


class NotFound(KvmeshError):
    """The named entity does not exist (NOT_FOUND)."""


class FailedPrecondition(KvmeshError):
    """The system is not in a state that allows the operation (FAILED_PRECONDITION)."""


class DeadlineExceeded(KvmeshError):
    """The deadline passed before the operation finished (DEADLINE_EXCEEDED)."""


class Unauthenticated(KvmeshError):
    """Missing or invalid credentials (UNAUTHENTICATED)."""


class PermissionDenied(KvmeshError):
    """Authenticated, but not allowed (PERMISSION_DENIED)."""


class Unimplemented(KvmeshError):
    """The operation is part of the contract but not implemented by this service yet (UNIMPLEMENTED)."""


class Aborted(KvmeshError):
    """The operation was aborted, e.g. by a concurrent change; the caller may retry (ABORTED)."""
