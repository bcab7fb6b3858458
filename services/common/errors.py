"""Domain errors shared by every service, and their one mapping to gRPC status codes.

Domain modules (engine, store, forecaster) raise these and never import ``grpc``; the
servicers translate them with :func:`services.common.grpc_util.status_for` (one mapping,
so a client can tell a missing adapter from a full pool). Every message must tell a person
what to do about it.
"""

from __future__ import annotations


class PLoRAError(Exception):
    """Base class of every error P-LoRA maps to a gRPC status (default INTERNAL)."""

    #: Name of the ``grpc.StatusCode`` member this error maps to.
    status_code_name = "INTERNAL"


class InvalidRequestError(PLoRAError):
    """A request field is out of range or missing (INVALID_ARGUMENT)."""

    status_code_name = "INVALID_ARGUMENT"


#: The refusal of a generate request with neither a prompt nor messages (gateway and worker).
#: ``prompt`` is a plain proto3 string: an empty prompt and none look the same to a server.
EMPTY_REQUEST = (
    "empty request: the prompt is empty and no messages were given; set prompt (raw text) or "
    "messages (chat turns)"
)


class InvalidAdapterError(PLoRAError):
    """An adapter directory is malformed or uses a feature we refuse (INVALID_ARGUMENT)."""

    status_code_name = "INVALID_ARGUMENT"


class IncompatibleAdapterError(PLoRAError):
    """An adapter does not fit the served base model's modules or shapes (FAILED_PRECONDITION)."""

    status_code_name = "FAILED_PRECONDITION"


class AdapterSourceError(PLoRAError):
    """A registered adapter's files can no longer be loaded: removed, or changed since
    registration (FAILED_PRECONDITION: the request is fine, the registered state is not)."""

    status_code_name = "FAILED_PRECONDITION"


class AdapterNotFoundError(PLoRAError):
    """No adapter with that id is registered (NOT_FOUND)."""

    status_code_name = "NOT_FOUND"


class AdapterPermissionError(PLoRAError):
    """The adapter belongs to another tenant (PERMISSION_DENIED)."""

    status_code_name = "PERMISSION_DENIED"


class UnauthenticatedError(PLoRAError):
    """The call carries no API key, or one the server does not know (UNAUTHENTICATED)."""

    status_code_name = "UNAUTHENTICATED"


class TenantMismatchError(PLoRAError):
    """A request names a tenant other than its API key's (PERMISSION_DENIED)."""

    status_code_name = "PERMISSION_DENIED"


class RegistrationConflictError(PLoRAError):
    """A concurrent registration of the same adapter id reserved a later version and won
    (ABORTED)."""

    status_code_name = "ABORTED"


class PoolExhaustedError(PLoRAError):
    """The device pool cannot hold the adapter now or ever (RESOURCE_EXHAUSTED)."""

    status_code_name = "RESOURCE_EXHAUSTED"


class OverloadedError(PLoRAError):
    """A queue is full; the client should back off and retry (RESOURCE_EXHAUSTED)."""

    status_code_name = "RESOURCE_EXHAUSTED"


class NoHealthyWorkerError(PLoRAError):
    """No worker is healthy or reachable (UNAVAILABLE)."""

    status_code_name = "UNAVAILABLE"


class RequestCancelledError(PLoRAError):
    """The client cancelled the request (CANCELLED)."""

    status_code_name = "CANCELLED"


class DeadlineExceededError(PLoRAError):
    """A bounded wait (adapter load, queue) ran out (DEADLINE_EXCEEDED)."""

    status_code_name = "DEADLINE_EXCEEDED"


class ConfigError(PLoRAError):
    """A configuration value is invalid; raised at start-up, before serving."""

    status_code_name = "INVALID_ARGUMENT"


#: Characters of a user's string an error message repeats (:func:`quoted`).
MAX_ECHO = 64

#: Characters of a user's path an error message repeats (its end tells most: more of it).
MAX_ECHO_PATH = 256


def quoted(text: str, limit: int = MAX_ECHO) -> str:
    """``text`` as an error message repeats a user's input: its ``repr``, cut to the first
    ``limit`` characters followed by ``... (N characters)`` when longer, so a huge field (an
    adapter id of 10,000 characters) does not come back whole in the message or the logs.

    Args:
        text: The user's string (a request field, a flag, an environment variable).
        limit: Characters kept (a path may want more than an id).
    """
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"
