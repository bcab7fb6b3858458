"""PEFT ``adapter_config.json`` as P-LoRA reads it: :class:`LoraAdapterConfig`, its parser
(:func:`parse_adapter_config`, with PEFT's defaults and refusals of the LoRA variants it does
not serve), PEFT's pattern rules (:func:`get_pattern_key`: ``rank_pattern`` /
``alpha_pattern`` keys match a module name's suffix; ``target_modules`` strings full-match),
matched in linear time by :mod:`services.common.patterns`, and the bounds an adapter must
stay within before any of it is read (:class:`InspectionLimits`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.common import patterns
from services.common.errors import (
    InvalidAdapterError,
)
from services.common.patterns import CONFIG_NAME
from services.common.types import ALL_PROJECTION_MODULES

#: Largest ``adapter_config.json`` read by default, in bytes (PEFT writes about 1 KiB).
MAX_CONFIG_BYTES = 1 << 20
#: Largest safetensors header read by default, in bytes (a LoRA of every projection of an
#: 80-layer model needs about 100 KiB).
MAX_HEADER_BYTES = 16 << 20
#: Deepest nesting of JSON arrays and objects accepted in the config and the header (PEFT
#: configs nest 2 deep, safetensors headers 3).
MAX_JSON_DEPTH = 32
#: Largest LoRA rank accepted by default.
MAX_LORA_RANK = 256


@dataclass(frozen=True)
class InspectionLimits:
    """Bounds on what reading an adapter may cost, each checked before the bytes it guards
    are read or parsed.

    Attributes:
        max_config_bytes: Largest ``adapter_config.json`` (checked with ``stat``).
        max_header_bytes: Largest safetensors header (checked on its 8-byte length prefix).
        max_json_depth: Deepest nesting of arrays/objects in either JSON document.
        max_lora_rank: Largest ``r`` (and ``rank_pattern`` value, and tensor rank); ``None``
            = no cap (a worker loading an adapter the gateway already admitted).

    Raises:
        ValueError: a bound below 1.
    """

    max_config_bytes: int = MAX_CONFIG_BYTES
    max_header_bytes: int = MAX_HEADER_BYTES
    max_json_depth: int = MAX_JSON_DEPTH
    max_lora_rank: int | None = MAX_LORA_RANK

    def __post_init__(self) -> None:
        for name in ("max_config_bytes", "max_header_bytes", "max_json_depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_lora_rank is not None and self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")

    def check_rank(self, r: int, what: str) -> None:
        """Refuse a rank above :attr:`max_lora_rank`.

        Args:
            r: The rank.
            what: Where it comes from, e.g. ``"adapter_config.json: r"``.

        Raises:
            InvalidAdapterError: naming ``what``, the rank and the cap.
        """
        if self.max_lora_rank is not None and r > self.max_lora_rank:
            raise InvalidAdapterError(
                f"{what} is {r}, above this server's largest LoRA rank {self.max_lora_rank} "
                "(--max-lora-rank / PLORA_MAX_LORA_RANK); use a smaller rank"
            )


DEFAULT_LIMITS = InspectionLimits()


def _echo(value: object) -> str:
    """``repr(value)`` for a message, cut to 80 characters (a config may hold megabytes)."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:80]}... ({len(text)} characters)"


def _truthy(value: object) -> bool:
    if value is None or value is False:
        return False
    return not (isinstance(value, (list, tuple, dict, str)) and len(value) == 0)


def _number(cfg: Mapping[str, object], name: str, default: float | None) -> float:
    value = cfg.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidAdapterError(f"{CONFIG_NAME}: {name} must be a number, got {_echo(value)}")
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
    _compiled: _CompiledPatterns = field(
        default=None,  # type: ignore[assignment]  # set in __post_init__
        init=False,
        repr=False,
        compare=False,
    )

    def __post_init__(self) -> None:
        """Check and compile every pattern (:func:`services.common.patterns.compile_pattern`).

        Raises:
            InvalidAdapterError: a pattern or a field with too many entries is refused.
        """
        object.__setattr__(self, "_compiled", _CompiledPatterns.of(self))

    def resolve(self, module_name: str) -> tuple[int, float]:
        """``(r, alpha)`` of one module, each resolved through its pattern as PEFT does."""
        c = self._compiled
        r_key = patterns.first_key(c.rank, module_name)
        a_key = patterns.first_key(c.alpha, module_name)
        r = self.r if r_key is None else int(self.rank_pattern[r_key])
        alpha = self.lora_alpha if a_key is None else float(self.alpha_pattern[a_key])
        return r, alpha

    def scaling(self, module_name: str, r: int | None = None) -> float:
        """LoRA scaling of one module: ``alpha / r`` or ``alpha / sqrt(r)`` (rsLoRA)."""
        r_cfg, alpha = self.resolve(module_name)
        return self.scaling_of(alpha, r_cfg if r is None else r)

    def scaling_of(self, alpha: float, r: int) -> float:
        """``alpha / r``, or ``alpha / sqrt(r)`` with ``use_rslora``."""
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    def targets(self, module_name: str) -> bool:
        """Whether PEFT would put this adapter's LoRA on ``module_name``.

        A port of ``check_target_module_exists`` (modules_to_save is refused earlier).
        """
        c = self._compiled
        ex = self.exclude_modules
        if ex:
            if c.exclude is not None:
                if patterns.full_match(c.exclude, module_name):
                    return False
            elif module_name in ex or any(module_name.endswith(f".{k}") for k in ex):
                return False
        tm = self.target_modules
        if isinstance(tm, str):
            if c.target is not None:
                return patterns.full_match(c.target, module_name)
            tm = ALL_PROJECTION_MODULES  # "all-linear": every projection the base has
        if module_name in tm:
            return True
        found = any(module_name.endswith(f".{k}") for k in tm)
        if found and self.layers_to_transform:
            idx = patterns.layer_index(c.layers, module_name)
            return idx is not None and idx in self.layers_to_transform
        return found


@dataclass(frozen=True)
class _CompiledPatterns:
    """A config's patterns compiled once for RE2 (``None`` where the field is no regex)."""

    target: Any
    exclude: Any
    rank: tuple[tuple[str, Any], ...]
    alpha: tuple[tuple[str, Any], ...]
    layers: tuple[Any, ...]

    @staticmethod
    def of(cfg: LoraAdapterConfig) -> _CompiledPatterns:
        tm, ex = cfg.target_modules, cfg.exclude_modules
        for name, value in (("target_modules", tm), ("exclude_modules", ex)):
            if value is not None and not isinstance(value, str):
                patterns.check_count(name, value)
        for name, keys in (
            ("rank_pattern", cfg.rank_pattern),
            ("alpha_pattern", cfg.alpha_pattern),
            ("layers_pattern", cfg.layers_pattern or ()),
            ("layers_to_transform", cfg.layers_to_transform or ()),
        ):
            patterns.check_count(name, keys)
        return _CompiledPatterns(
            target=patterns.compile_pattern("target_modules", tm)
            if isinstance(tm, str) and tm != ALL_LINEAR
            else None,
            exclude=patterns.compile_pattern("exclude_modules", ex)
            if isinstance(ex, str)
            else None,
            rank=tuple(
                (k, patterns.compile_pattern("rank_pattern key", k, patterns.PEFT_KEY_WRAP))
                for k in cfg.rank_pattern
            ),
            alpha=tuple(
                (k, patterns.compile_pattern("alpha_pattern key", k, patterns.PEFT_KEY_WRAP))
                for k in cfg.alpha_pattern
            ),
            layers=tuple(
                patterns.compile_pattern("layers_pattern", p, patterns.LAYERS_WRAP)
                for p in cfg.layers_pattern or ()
            ),
        )


def get_pattern_key(pattern_keys: Sequence[str] | Any, key_to_match: str) -> str:
    """PEFT's ``get_pattern_key``: the first pattern ``k`` with ``(.*\\.)?(k)$`` matching,
    matched with RE2 (:func:`services.common.patterns.first_key`).

    Returns ``key_to_match`` itself when no pattern matches (so ``dict.get(.., default)``
    falls back to the config's default), exactly as PEFT does.

    Raises:
        InvalidAdapterError: a key :func:`services.common.patterns.compile_pattern` refuses.
    """
    compiled = [
        (str(k), patterns.compile_pattern("pattern key", str(k), patterns.PEFT_KEY_WRAP))
        for k in pattern_keys
    ]
    key = patterns.first_key(compiled, key_to_match)
    return key_to_match if key is None else key


def _str_list(value: object, name: str) -> tuple[str, ...] | str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value  # compiled (and refused when bad) by LoraAdapterConfig
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise InvalidAdapterError(
        f"{CONFIG_NAME}: {name} must be a list of module names or a regex string, "
        f"got {_echo(value)}"
    )


def _pattern(cfg: Mapping[str, object], name: str) -> dict[str, float]:
    value = cfg.get(name) or {}
    if not isinstance(value, dict):
        raise InvalidAdapterError(f"{CONFIG_NAME}: {name} must be an object, got {_echo(value)}")
    out: dict[str, float] = {}
    for k, v in value.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise InvalidAdapterError(
                f"{CONFIG_NAME}: {name}[{_echo(k)}] must be a positive number, got {_echo(v)}"
            )
        out[str(k)] = v
    return out


def parse_adapter_config(
    cfg: Mapping[str, object], limits: InspectionLimits = DEFAULT_LIMITS
) -> LoraAdapterConfig:
    """Validate a PEFT ``adapter_config.json`` dict and keep what changes the math.

    Unknown fields (written by newer PEFT versions) are ignored. Refused, each with
    :class:`InvalidAdapterError`: ``peft_type`` other than ``LORA``; non-empty
    ``modules_to_save``; ``bias`` other than ``"none"``; DoRA and the other LoRA variants with
    a different forward pass (:data:`_UNSUPPORTED_FEATURES`); ``init_lora_weights`` of a method
    that modified the base weights (PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA) and was not converted;
    a missing or non-positive ``r`` / ``lora_alpha``; ``r`` or a ``rank_pattern`` value above
    ``limits.max_lora_rank``; a pattern :func:`services.common.patterns.compile_pattern`
    refuses, or a field with more than :data:`services.common.patterns.MAX_PATTERNS` entries.

    Args:
        cfg: The parsed JSON object.
        limits: Bounds to enforce (the rank cap here).

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
            f"{CONFIG_NAME}: peft_type is {_echo(peft_type)}; only LoRA adapters "
            '(peft_type "LORA") can be served'
        )
    if _truthy(cfg.get("modules_to_save")):
        raise InvalidAdapterError(
            f"{CONFIG_NAME}: modules_to_save={_echo(cfg.get('modules_to_save'))} replaces whole "
            "base modules, which a shared base model cannot serve per adapter; retrain without "
            "modules_to_save (or merge the adapter into its own model)"
        )
    bias = cfg.get("bias", "none")
    if bias not in (None, "none"):
        raise InvalidAdapterError(
            f"{CONFIG_NAME}: bias={_echo(bias)} trains base-model biases, which a shared base "
            'model cannot serve per adapter; only bias "none" is supported'
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
            f"{CONFIG_NAME}: init_lora_weights={_echo(init)} modified the base weights during "
            "training; save the adapter with save_pretrained(..., "
            "path_initial_model_for_weight_conversion=...) to convert it to a plain LoRA"
        )

    r = _number(cfg, "r", None)
    if r != int(r) or r < 1:
        raise InvalidAdapterError(
            f"{CONFIG_NAME}: r must be a positive integer, got {_echo(cfg.get('r'))}"
        )
    limits.check_rank(int(r), f"{CONFIG_NAME}: r")
    alpha = _number(cfg, "lora_alpha", 8)
    rank_pattern = _pattern(cfg, "rank_pattern")
    for k, v in rank_pattern.items():
        if v != int(v):
            raise InvalidAdapterError(
                f"{CONFIG_NAME}: rank_pattern[{_echo(k)}] must be an integer, got {_echo(v)}"
            )
        limits.check_rank(int(v), f"{CONFIG_NAME}: rank_pattern[{_echo(k)}]")

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
            f"{CONFIG_NAME}: layers_to_transform must be an int or a list of ints, got {_echo(ltt)}"
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
            f"{CONFIG_NAME}: layers_pattern must be a string or a list of strings, got {_echo(lp)}"
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
