"""Who may use, replace and delete an adapter: pure checks of a record against a tenant id."""

from __future__ import annotations

from services.common.errors import AdapterPermissionError, quoted
from services.common.registry import AdapterRecord


def check_tenant(record: AdapterRecord, tenant_id: str) -> None:
    """Serving and reading: an adapter registered with a tenant is for that tenant only;
    one registered without one is shared by everyone.

    Raises:
        AdapterPermissionError: ``record`` belongs to another tenant.
    """
    if record.tenant_id and record.tenant_id != tenant_id:
        raise AdapterPermissionError(
            f"adapter {quoted(record.adapter_id)} belongs to another tenant; a request may "
            "use its own tenant's adapters and shared ones (ListAdapters shows them)"
        )


def check_owner(record: AdapterRecord, tenant_id: str, action: str) -> None:
    """Replacing and deleting: only the owner, i.e. the same ``tenant_id`` exactly. A
    shared adapter (registered without a tenant) is the operator's: calls without a
    tenant_id replace or delete it, and no tenant can, or one tenant could swap the
    weights every tenant is served, take the id over and lock the others out of it.

    Args:
        record: The adapter as registered.
        tenant_id: The caller's tenant ("" = none).
        action: ``"replaces"`` or ``"deletes"`` (the message's verb).

    Raises:
        AdapterPermissionError: ``tenant_id`` is not the owner.
    """
    if record.tenant_id == tenant_id:
        return
    hint = "; choose another id" if action == "replaces" else ""
    if not record.tenant_id:
        raise AdapterPermissionError(
            f"adapter {quoted(record.adapter_id)} is shared (registered without a "
            f"tenant_id): only the operator (a call without tenant_id; with API keys, the "
            f"operator key) {action} it{hint}"
        )
    raise AdapterPermissionError(
        f"adapter {quoted(record.adapter_id)} is owned by another tenant: only a call with "
        f"its owner's tenant_id {action} it{hint}"
    )


def visible_to(record: AdapterRecord, tenant_id: str) -> bool:
    """Whether ListAdapters shows ``record`` to ``tenant_id`` ("" = every adapter)."""
    return not tenant_id or record.tenant_id in ("", tenant_id)
