"""The model families the worker serves, chosen from a config's ``model_type`` /
``architectures``.

Each family module declares its quirks as an :class:`~services.worker.families.base.Architecture`
(see :mod:`services.worker.families.base`); :class:`services.worker.model.DecoderModel` runs
them all. Adding a family is one module and one line in :data:`FAMILIES`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.common.errors import ConfigError
from services.worker.families.base import Architecture, Family
from services.worker.families.gemma import GEMMA2, GEMMA3
from services.worker.families.llama import LLAMA, MISTRAL, QWEN2, QWEN3
from services.worker.families.phi3 import PHI3

__all__ = ["FAMILIES", "Architecture", "Family", "describe", "family_for_config", "supported"]

#: Every family, in the order the error message lists them.
FAMILIES: tuple[Family, ...] = (LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA2, GEMMA3, PHI3)
_BY_NAME = {f.name: f for f in FAMILIES}


def supported() -> str:
    """``model_type`` values the worker serves, for error messages."""
    return ", ".join(sorted(t for f in FAMILIES for t in f.model_types))


def family_for_config(config: Mapping[str, Any], where: object = "") -> Family:
    """The family of a ``config.json`` dict: by ``model_type``, else by ``architectures``.

    Raises:
        ConfigError: no family matches; the message names every supported ``model_type``.
    """
    model_type = str(config.get("model_type") or "")
    for f in FAMILIES:
        if model_type in f.model_types:
            return f
    archs = config.get("architectures") or []
    if isinstance(archs, list):
        for f in FAMILIES:
            if any(a in f.architectures for a in archs):
                return f
    prefix = f"{where}: " if where else ""
    raise ConfigError(
        f"{prefix}model_type={model_type!r} architectures={archs!r} is not served by P-LoRA's "
        f"worker; supported model_type values: {supported()}"
    )


def family_by_name(name: str) -> Family:
    """The family registered as ``name`` (``ModelSpec.family``).

    Raises:
        ConfigError: unknown name.
    """
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ConfigError(f"unknown model family {name!r} (known: {', '.join(_BY_NAME)})") from None


def describe(config: Mapping[str, Any], where: object = "") -> Architecture:
    """The :class:`Architecture` of a ``config.json`` dict.

    Raises:
        ConfigError: an unsupported family, or a config switch the decoder does not implement.
    """
    return family_for_config(config, where).describe(config)
