"""API keys: who calls the gateway, and which tenant each call acts as.

An operator lists the keys in a file (``--api-keys-file``) by their sha256 hashes, never the
keys, each with whom it acts as: one tenant, or the operator. A client sends its key as gRPC
metadata ``authorization: Bearer <key>`` (RFC 6750's header). :class:`ApiKeyInterceptor`
refuses a call without a known key (UNAUTHENTICATED) before any servicer runs, on every
service but health and reflection; the servicer then asks :func:`effective_tenant` which
tenant a request acts as. Keys are compared in constant time (``hmac.compare_digest`` of
their hashes against every entry) and never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import yaml  # type: ignore[import-untyped]

from services.common.errors import (
    ConfigError,
    InvalidRequestError,
    TenantMismatchError,
    UnauthenticatedError,
    quoted,
)
from services.common.grpc_util import refusing_handler
from services.gateway.validation import check_tenant_id

#: The metadata key of the credentials (gRPC metadata keys are lower case).
AUTHORIZATION = "authorization"

#: The refusal of a call without a known key: the same whether the key is missing,
#: malformed or unknown, so it tells a caller nothing about the keys the server holds.
UNAUTHENTICATED_MESSAGE = (
    "a valid API key is required: send gRPC metadata 'authorization: Bearer <key>' "
    "(the CLI sends $PLORA_API_KEY)"
)

#: Largest keys file read (bytes): a few hundred thousand keys.
MAX_KEYS_FILE_BYTES = 16 << 20

#: Fields a key entry may have: ``name`` is a label for people, never used to authenticate.
_ENTRY_FIELDS = {"sha256", "tenant", "operator", "name"}

_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class Principal:
    """Whom an API key acts as.

    Attributes:
        tenant: The tenant of a tenant key ("" for the operator).
        operator: The operator's key: every adapter, shared ones included, and every call a
            cluster without keys accepts.
    """

    tenant: str = ""
    operator: bool = False


def key_digest(key: str) -> bytes:
    """The sha256 of an API key's UTF-8 text (32 bytes), as the keys file lists it in hex."""
    return hashlib.sha256(key.encode()).digest()


class KeyRing:
    """The API keys a gateway accepts, by hash.

    Args:
        entries: ``(sha256 digest of the key, whom it acts as)`` pairs.
    """

    def __init__(self, entries: Sequence[tuple[bytes, Principal]]) -> None:
        self._entries = list(entries)

    def __len__(self) -> int:
        return len(self._entries)

    @classmethod
    def from_file(cls, path: str | Path) -> KeyRing:
        """Load a keys file: JSON (a ``.json`` name) or YAML (any other name) of the form
        ``{"keys": [{"sha256": "<hex>", "tenant": "acme"}, {"sha256": "<hex>",
        "operator": true}]}``.

        Raises:
            ConfigError: the file cannot be read, is larger than
                :data:`MAX_KEYS_FILE_BYTES`, or is malformed (:meth:`parse`); the message
                names the file and the entry.
        """
        where = f"--api-keys-file / PLORA_API_KEYS_FILE {str(path)!r}"
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_KEYS_FILE_BYTES + 1)
        except OSError as exc:
            raise ConfigError(f"{where}: cannot read it ({exc.strerror})") from None
        if len(raw) > MAX_KEYS_FILE_BYTES:
            raise ConfigError(f"{where}: larger than {MAX_KEYS_FILE_BYTES >> 20} MiB")
        try:
            text = raw.decode()
            data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
        except (UnicodeDecodeError, ValueError, yaml.YAMLError) as exc:
            kind = "JSON" if str(path).endswith(".json") else "YAML"
            detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ConfigError(f"{where}: not valid {kind} ({detail})") from None
        return cls.parse(data, where)

    @classmethod
    def parse(cls, data: Any, where: str = "keys file") -> KeyRing:
        """Check a loaded keys file and build its ring.

        Each entry has ``sha256`` (64 hex digits: the hash of the key, not the key) and
        either ``tenant`` (a tenant id, as a request's ``tenant_id``) or ``operator: true``;
        optionally ``name``, a label for people. No two entries share a hash.

        Raises:
            ConfigError: anything else; the message names ``where`` and the entry.
        """
        if not isinstance(data, dict) or not isinstance(data.get("keys"), list):
            raise ConfigError(
                f'{where}: expected {{"keys": [{{"sha256": "<hex sha256 of the key>", '
                f'"tenant": "<id>"}} or {{"sha256": ..., "operator": true}}, ...]}}'
            )
        if set(data) != {"keys"}:
            raise ConfigError(f"{where}: unknown top-level field(s) {sorted(set(data) - {'keys'})}")
        if not data["keys"]:
            raise ConfigError(f"{where}: no keys listed; every call would be refused")
        entries: list[tuple[bytes, Principal]] = []
        seen: set[bytes] = set()
        for i, entry in enumerate(data["keys"]):
            digest, principal = _parse_entry(entry, f"{where}: keys[{i}]")
            if digest in seen:
                raise ConfigError(f"{where}: keys[{i}] repeats the sha256 of an earlier entry")
            seen.add(digest)
            entries.append((digest, principal))
        return cls(entries)

    def principal_for(self, key: str) -> Principal | None:
        """Whom ``key`` acts as, or None for a key not in the ring.

        Every entry is compared (``hmac.compare_digest``), so the time taken does not depend
        on which entry matches or how much of a hash a guess shares.
        """
        digest = key_digest(key)
        found: Principal | None = None
        for entry_digest, principal in self._entries:
            if hmac.compare_digest(digest, entry_digest):
                found = principal
        return found

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Principal:
        """Whom a call's ``authorization: Bearer <key>`` metadata acts as.

        Raises:
            UnauthenticatedError: no such metadata, or a key not in the ring
                (:data:`UNAUTHENTICATED_MESSAGE` either way).
        """
        key = bearer_key(metadata)
        principal = self.principal_for(key) if key else None
        if principal is None:
            raise UnauthenticatedError(UNAUTHENTICATED_MESSAGE)
        return principal


def _parse_entry(entry: Any, where: str) -> tuple[bytes, Principal]:
    """One keys-file entry as ``(digest, principal)``.

    Raises:
        ConfigError: a missing, unknown or malformed field (named with ``where``).
    """
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: expected a mapping with sha256 and tenant or operator")
    unknown = set(entry) - _ENTRY_FIELDS
    if unknown:
        raise ConfigError(
            f"{where}: unknown field(s) {sorted(map(str, unknown))}; an entry has sha256, "
            "tenant or operator, and optionally name"
        )
    digest_hex = entry.get("sha256")
    if not (
        isinstance(digest_hex, str) and len(digest_hex) == 64 and set(digest_hex.lower()) <= _HEX
    ):
        # the value is not echoed: a key pasted here by mistake must not reach a log
        raise ConfigError(
            f"{where}: sha256 must be the 64 hex digits of the key's sha256, never the key "
            "itself (printf %s KEY | sha256sum)"
        )
    operator = entry.get("operator", False)
    tenant = entry.get("tenant", "")
    if not isinstance(operator, bool):
        raise ConfigError(f"{where}: operator must be true or false")
    if not isinstance(tenant, str):
        raise ConfigError(f"{where}: tenant must be a string (a tenant id)")
    if operator == bool(tenant):
        raise ConfigError(
            f"{where}: give exactly one of tenant (the tenant the key acts as) and operator: true"
        )
    try:
        check_tenant_id(tenant)
    except InvalidRequestError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return bytes.fromhex(digest_hex), Principal(tenant=tenant, operator=operator)


def bearer_key(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The key of the first ``authorization`` metadata entry of the form ``Bearer <key>``
    (the scheme in any case, as RFC 6750 allows); "" when there is none."""
    for name, value in metadata or ():
        if name != AUTHORIZATION:
            continue
        text = value.decode(errors="replace") if isinstance(value, bytes) else value
        scheme, _, key = text.strip().partition(" ")
        if scheme.lower() == "bearer" and key.strip():
            return key.strip()
    return ""


def effective_tenant(principal: Principal | None, requested: str) -> str:
    """The tenant a request acts as: without keys (``principal`` None) or with the
    operator's key, its own ``tenant_id`` ("" = every adapter, and the owner of shared
    ones); with a tenant's key, that tenant, which ``tenant_id`` may repeat but not change.

    Raises:
        TenantMismatchError: a tenant key's request names another tenant.
    """
    if principal is None or principal.operator:
        return requested
    if requested and requested != principal.tenant:
        raise TenantMismatchError(
            f"tenant_id {quoted(requested)} is not the tenant of this API key "
            f"({quoted(principal.tenant)}): leave tenant_id empty or set it to the key's tenant"
        )
    return principal.tenant


def sees_everything(principal: Principal | None) -> bool:
    """Whether a caller sees every adapter's source and the whole cluster: without keys,
    or with the operator's key."""
    return principal is None or principal.operator


class ApiKeyInterceptor(grpc.ServerInterceptor):
    """Refuses, UNAUTHENTICATED, every call without a known API key to a service not in
    ``open_services`` (health and reflection stay open: load balancers and ``grpcurl``
    probe them without keys), before its request is read or parsed
    (:func:`~services.common.grpc_util.refusing_handler`).

    Args:
        keyring: The accepted keys.
        open_services: Full names of the services answered without a key
            (``"grpc.health.v1.Health"``).
        on_refusal: Called once per refused call (a metric); never with the key.
    """

    def __init__(
        self,
        keyring: KeyRing,
        open_services: Iterable[str],
        on_refusal: Callable[[], None] | None = None,
    ) -> None:
        self.keyring = keyring
        self.open_services = frozenset(open_services)
        self.on_refusal = on_refusal

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method: str = handler_call_details.method
        service = method.lstrip("/").partition("/")[0]
        if service in self.open_services:
            return continuation(handler_call_details)
        try:
            self.keyring.authenticate(handler_call_details.invocation_metadata)
        except UnauthenticatedError:
            if self.on_refusal is not None:
                self.on_refusal()
            handler = continuation(handler_call_details)
            if handler is None:
                return None
            return refusing_handler(
                handler, grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE
            )
        return continuation(handler_call_details)
