"""PEFT ``adapter_config.json`` as P-LoRA reads it: :class:`LoraAdapterConfig`, its parser
(:func:`parse_adapter_config`, with PEFT's defaults and refusals of the LoRA variants it does
not serve) and PEFT's pattern rules (:func:`get_pattern_key`: ``rank_pattern`` /
``alpha_pattern`` keys match a module name's suffix; ``target_modules`` strings full-match)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.common.errors import (
    InvalidAdapterError,
)
from services.common.types import PROJECTION_MODULES

CONFIG_NAME = "adapter_config.json"


def _truthy(value: object) -> bool:
    if value is None or value is False:
        return False
    return not (isinstance(value, (list, tuple, dict, str)) and len(value) == 0)


def _number(cfg: Mapping[str, object], name: str, default: float | None) -> float:
    value = cfg.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidAdapterError(f"{CONFIG_NAME}: {name} must be a number, got {value!r}")
    return float(value)


#: PEFT's default LoRA targets for ``model_type == "llama"`` when a config has none
#: (``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING["llama"]``).
LLAMA_DEFAULT_TARGETS: tuple[str, ...] = ("q_proj", "v_proj")

ALL_LINEAR = "all-linear"

#: ``init_lora_weights`` values whose training changed the *base* weights (the adapter only
#: works on that modified base unless converted with ``path_initial_model_for_weight_conversion``).
_BASE_MODIFYING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")

#: Config fields that switch on a LoRA variant with a different forward pass (PEFT tags them
#: ``is_lora_variant``) or structure we do not serve; truthy values are refused.
_UNSUPPORTED_FEATURES: dict[str, str] = {
    "use_dora": "DoRA (use_dora: true) adds a per-module magnitude vector",
    "alora_invocation_tokens": (
        "aLoRA (alora_invocation_tokens) activates only after invocation tokens"
    ),
    "use_qalora": "QA-LoRA (use_qalora: true) pools the input before lora_A",
    "velora_config": "VeLoRA (velora_config) changes the forward pass",
    "monteclora_config": "MonteCLoRA (monteclora_config) samples the LoRA weights",
    "use_bdlora": "block-diagonal LoRA (use_bdlora) changes the tensor layout",
    "arrow_config": "Arrow routing (arrow_config) mixes several adapters per token",
    "kasa_config": "KaSA (kasa_config) adds a singular-value vector",
    "lora_bias": "lora_bias: true adds a bias to lora_B",
    "layer_replication": "layer_replication changes the base model's layer stack",
    "target_parameters": "target_parameters puts LoRA on raw parameters (e.g. MoE experts)",
    "trainable_token_indices": "trainable_token_indices changes embedding rows",
}


@dataclass(frozen=True)
class LoraAdapterConfig:
    """The fields of a PEFT ``LoraConfig`` that change what we serve.

    Every other field a PEFT version writes is ignored (after the refusals in
    :func:`parse_adapter_config`).

    Attributes:
        r: Default rank.
        lora_alpha: Default alpha.
        use_rslora: Scaling ``alpha / sqrt(r)`` instead of ``alpha / r``.
        target_modules: List of names/suffixes, a regex string, or ``"all-linear"``.
        exclude_modules: Same forms as ``target_modules``; ``None`` when absent.
        rank_pattern: Ordered ``pattern -> r``.
        alpha_pattern: Ordered ``pattern -> alpha``.
        layers_to_transform: Layer index or indexes (list ``target_modules`` only).
        layers_pattern: Name(s) of the layer list (``"layers"``), used with the above.
        base_model_name_or_path: What the adapter was trained on (informational).
        peft_version: PEFT version that wrote the file, when recorded.
    """

    r: int
    lora_alpha: float
    use_rslora: bool = False
    target_modules: tuple[str, ...] | str = LLAMA_DEFAULT_TARGETS
    exclude_modules: tuple[str, ...] | str | None = None
    rank_pattern: Mapping[str, int] = field(default_factory=dict)
    alpha_pattern: Mapping[str, float] = field(default_factory=dict)
    layers_to_transform: tuple[int, ...] | None = None
    layers_pattern: tuple[str, ...] | None = None
    base_model_name_or_path: str = ""
    peft_version: str = ""

    def resolve(self, module_name: str) -> tuple[int, float]:
        """``(r, alpha)`` of one module, each resolved through its pattern as PEFT does."""
        r_key = get_pattern_key(self.rank_pattern.keys(), module_name)
        a_key = get_pattern_key(self.alpha_pattern.keys(), module_name)
        return int(self.rank_pattern.get(r_key, self.r)), float(
            self.alpha_pattern.get(a_key, self.lora_alpha)
        )

    def scaling(self, module_name: str, r: int | None = None) -> float:
        """LoRA scaling of one module: ``alpha / r`` or ``alpha / sqrt(r)`` (rsLoRA)."""
        r_cfg, alpha = self.resolve(module_name)
        r = r_cfg if r is None else r
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    def targets(self, module_name: str) -> bool:
        """Whether PEFT would put this adapter's LoRA on ``module_name``.

        A port of ``check_target_module_exists`` (modules_to_save is refused earlier).
        """
        ex = self.exclude_modules
        if ex:
            if isinstance(ex, str):
                if re.fullmatch(ex, module_name):
                    return False
            elif module_name in ex or any(module_name.endswith(f".{k}") for k in ex):
                return False
        tm = self.target_modules
        if isinstance(tm, str):
            if tm == ALL_LINEAR:
                tm = PROJECTION_MODULES
            else:
                return re.fullmatch(tm, module_name) is not None
        if module_name in tm:
            return True
        found = any(module_name.endswith(f".{k}") for k in tm)
        if found and self.layers_to_transform:
            if not self.layers_pattern:
                m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module_name)
            else:
                m = None
                for pattern in self.layers_pattern:
                    m = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", module_name)
                    if m is not None:
                        break
            if m is None:
                return False
            return int(m.group("idx")) in self.layers_to_transform
        return found


def get_pattern_key(pattern_keys: Sequence[str] | Any, key_to_match: str) -> str:
    """PEFT's ``get_pattern_key``: the first pattern ``k`` with ``(.*\\.)?(k)$`` matching.

    Returns ``key_to_match`` itself when no pattern matches (so ``dict.get(.., default)``
    falls back to the config's default), exactly as PEFT does.
    """
    for key in pattern_keys:
        if re.match(rf"(.*\.)?({key})$", key_to_match):
            return str(key)
    return key_to_match


def _str_list(value: object, name: str) -> tuple[str, ...] | str | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            re.compile(value)
        except re.error as e:
            raise InvalidAdapterError(
                f"{CONFIG_NAME}: {name} {value!r} is not a valid regex: {e}"
            ) from None
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise InvalidAdapterError(
        f"{CONFIG_NAME}: {name} must be a list of module names or a regex string, got {value!r}"
    )


def _pattern(cfg: Mapping[str, object], name: str) -> dict[str, float]:
    value = cfg.get(name) or {}
    if not isinstance(value, dict):
        raise InvalidAdapterError(f"{CONFIG_NAME}: {name} must be an object, got {value!r}")
    out: dict[str, float] = {}
    for k, v in value.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise InvalidAdapterError(
                f"{CONFIG_NAME}: {name}[{k!r}] must be a positive number, got {v!r}"
            )
        try:
            re.compile(k)
        except re.error as e:
            raise InvalidAdapterError(
                f"{CONFIG_NAME}: {name} key {k!r} is not a valid regex: {e}"
            ) from None
        out[str(k)] = v
    return out


def parse_adapter_config(cfg: Mapping[str, object]) -> LoraAdapterConfig:
    """Validate a PEFT ``adapter_config.json`` dict and keep what changes the math.

    Unknown fields (written by newer PEFT versions) are ignored. Refused, each with
    :class:`InvalidAdapterError`: ``peft_type`` other than ``LORA``; non-empty
    ``modules_to_save``; ``bias`` other than ``"none"``; DoRA and the other LoRA variants with
    a different forward pass (:data:`_UNSUPPORTED_FEATURES`); ``init_lora_weights`` of a method
    that modified the base weights (PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA) and was not converted;
    a missing or non-positive ``r`` / ``lora_alpha``.

    Args:
        cfg: The parsed JSON object.

    Returns:
        The validated config.

    Raises:
        InvalidAdapterError: see above; the message names the field and what to do.
    """
    if not isinstance(cfg, Mapping):
        raise InvalidAdapterError(
            f"{CONFIG_NAME} must hold a JSON object, got {type(cfg).__name__}"
        )
    peft_type = cfg.get("peft_type")
    if peft_type != "LORA":
        raise InvalidAdapterError(
            f'{CONFIG_NAME}: peft_type is {peft_type!r}; only LoRA adapters (peft_type "LORA") '
            "can be served"
        )
    if _truthy(cfg.get("modules_to_save")):
        raise InvalidAdapterError(
            f"{CONFIG_NAME}: modules_to_save={cfg.get('modules_to_save')!r} replaces whole base "
            "modules, which a shared base model cannot serve per adapter; retrain without "
            "modules_to_save (or merge the adapter into its own model)"
        )
    bias = cfg.get("bias", "none")
    if bias not in (None, "none"):
        raise InvalidAdapterError(
            f"{CONFIG_NAME}: bias={bias!r} trains base-model biases, which a shared base model "
            'cannot serve per adapter; only bias "none" is supported'
        )
    for name, what in _UNSUPPORTED_FEATURES.items():
        if _truthy(cfg.get(name)):
            raise InvalidAdapterError(
                f"{CONFIG_NAME}: {what}, which this server does not implement; "
                f"retrain as a plain LoRA adapter ({name} unset) or merge it into the base model"
            )
    init = cfg.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_MODIFYING_INITS):
        raise InvalidAdapterError(
            f"{CONFIG_NAME}: init_lora_weights={init!r} modified the base weights during "
            "training; save the adapter with save_pretrained(..., "
            "path_initial_model_for_weight_conversion=...) to convert it to a plain LoRA"
        )

    r = _number(cfg, "r", None)
    if r != int(r) or r < 1:
        raise InvalidAdapterError(
            f"{CONFIG_NAME}: r must be a positive integer, got {cfg.get('r')!r}"
        )
    alpha = _number(cfg, "lora_alpha", 8)
    rank_pattern = _pattern(cfg, "rank_pattern")
    for k, v in rank_pattern.items():
        if v != int(v):
            raise InvalidAdapterError(
                f"{CONFIG_NAME}: rank_pattern[{k!r}] must be an integer, got {v!r}"
            )

    target = _str_list(cfg.get("target_modules"), "target_modules")
    if target is None:
        target = LLAMA_DEFAULT_TARGETS  # PEFT's default for model_type "llama"
    exclude = _str_list(cfg.get("exclude_modules"), "exclude_modules")

    ltt = cfg.get("layers_to_transform")
    layers: tuple[int, ...] | None
    if ltt is None or ltt == []:
        layers = None
    elif isinstance(ltt, int) and not isinstance(ltt, bool):
        layers = (ltt,)
    elif isinstance(ltt, list) and all(isinstance(i, int) for i in ltt):
        layers = tuple(ltt)
    else:
        raise InvalidAdapterError(
            f"{CONFIG_NAME}: layers_to_transform must be an int or a list of ints, got {ltt!r}"
        )
    lp = cfg.get("layers_pattern")
    layers_pattern: tuple[str, ...] | None
    if isinstance(lp, str):
        layers_pattern = (lp,) if lp else None
    elif isinstance(lp, list) and all(isinstance(x, str) for x in lp):
        layers_pattern = tuple(lp) or None
    elif lp is None:
        layers_pattern = None
    else:
        raise InvalidAdapterError(
            f"{CONFIG_NAME}: layers_pattern must be a string or a list of strings, got {lp!r}"
        )
    if isinstance(target, str) and layers is not None:
        raise InvalidAdapterError(
            f"{CONFIG_NAME}: layers_to_transform cannot be used when target_modules is a regex "
            "string (PEFT refuses this too)"
        )

    return LoraAdapterConfig(
        r=int(r),
        lora_alpha=alpha,
        use_rslora=bool(cfg.get("use_rslora", False)),
        target_modules=target,
        exclude_modules=exclude,
        rank_pattern={k: int(v) for k, v in rank_pattern.items()},
        alpha_pattern=dict(_pattern(cfg, "alpha_pattern")),
        layers_to_transform=layers,
        layers_pattern=layers_pattern,
        base_model_name_or_path=str(cfg.get("base_model_name_or_path") or ""),
        peft_version=str(cfg.get("peft_version") or ""),
    )
