"""Linear-time matching of the regular expressions an ``adapter_config.json`` carries.

PEFT matches ``target_modules`` / ``exclude_modules`` strings, ``rank_pattern`` /
``alpha_pattern`` keys and ``layers_pattern`` with Python's backtracking :mod:`re`, which
holds the GIL for as long as a match runs: ``(.|.|.)*Z`` over a 40-character module name
never finishes. Here every such pattern is matched with RE2 (``google-re2``), whose matching
time is linear in the name, under PEFT's own rules (peft 0.21):

- ``target_modules`` / ``exclude_modules`` as a string: ``re.fullmatch(pattern, name)``
  (``tuners_utils.check_target_module_exists``, ``other.match_target_against_key``);
- ``rank_pattern`` / ``alpha_pattern``: the first key ``k`` in file order with
  ``re.match(rf"(.*\\.)?({k})$", name)`` (``other.get_pattern_key``);
- ``layers_pattern``: the layer index is ``idx`` of
  ``re.match(rf"(?:^|.*?\\.){p}\\.(?P<idx>\\d+)\\.", name)`` for the first ``p`` that matches,
  or of ``re.match(r".*?\\.[^.]*\\.(?P<idx>\\d+)\\.", name)`` without one.

A pattern is accepted only when both engines accept it and read it alike: it must compile
with :mod:`re` (what PEFT would run; warnings count as errors) and with RE2, and it must not
use the two forms the engines read differently (``{,n}``, a repetition for :mod:`re` and
literal text for RE2; ``[:``, a POSIX class for RE2 and literal text for :mod:`re`). Module
names are ASCII identifiers joined by dots, so the remaining differences (Unicode ``\\d`` /
``\\w``, ``$`` before a final newline) cannot change a match.

Every refusal is :class:`~services.common.errors.InvalidAdapterError` (INVALID_ARGUMENT)
naming the config field and the pattern and saying why.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable

import re2  # type: ignore[import-untyped]  # google-re2 ships no type information

from services.common.errors import InvalidAdapterError, quoted

CONFIG_NAME = "adapter_config.json"

#: Longest pattern accepted, in characters (PEFT configs hold names and short regexes).
MAX_PATTERN_CHARS = 4096
#: Most entries in one of ``target_modules``, ``exclude_modules``, ``rank_pattern``,
#: ``alpha_pattern``, ``layers_pattern`` (a list of every module of an 80-layer model is 560).
MAX_PATTERNS = 1024
#: Memory RE2 may use for one compiled pattern (program and DFA cache), in bytes; a pattern
#: needing more is refused as too complex.
MAX_PATTERN_MEMORY = 256 << 10

#: ``(prefix, suffix)`` PEFT wraps around a ``rank_pattern`` / ``alpha_pattern`` key.
PEFT_KEY_WRAP = (r"(.*\.)?(", r")$")
#: ``(prefix, suffix)`` PEFT wraps around a ``layers_pattern`` entry.
LAYERS_WRAP = (r"(?:^|.*?\.)", r"\.(?P<idx>\d+)\.")
_NO_WRAP = ("", "")

_OPTIONS = re2.Options()
_OPTIONS.log_errors = False
_OPTIONS.max_mem = MAX_PATTERN_MEMORY

#: Layer index of a module name when the config gives no ``layers_pattern`` (PEFT's rule).
_DEFAULT_LAYER_RE = re2.compile(r".*?\.[^.]*\.(?P<idx>\d+)\.", _OPTIONS)

#: RE2 error fragments -> what the pattern uses that RE2 cannot run in linear time.
_RE2_REASONS = (
    ("invalid perl operator: (?<", "lookbehind or named-group syntax RE2 does not have"),
    ("invalid perl operator: (?=", "lookahead"),
    ("invalid perl operator: (?!", "negative lookahead"),
    ("invalid perl operator: (?>", "an atomic group"),
    ("invalid perl operator", "a group construct RE2 does not have"),
    ("invalid escape sequence: \\Z", "\\Z (write $ instead)"),
    ("invalid escape sequence", "a backreference or an escape RE2 does not have"),
    ("bad repetition operator", "a possessive or repeated quantifier"),
    ("invalid repetition size", "a repetition count above 1000"),
    ("pattern too large", f"more than {MAX_PATTERN_MEMORY >> 10} KiB of compiled program"),
)


def _why_re2(error: Exception) -> str:
    raw = error.args[0] if error.args else error
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
    for fragment, why in _RE2_REASONS:
        if fragment in text:
            return why
    return text


def compile_pattern(field: str, pattern: str, wrap: tuple[str, str] = _NO_WRAP) -> re2._Regexp:
    """Check one config pattern and compile it for linear-time matching.

    Args:
        field: Config field it comes from, for messages (``"target_modules"``,
            ``"rank_pattern key"``, ...).
        pattern: The pattern as written in the config.
        wrap: ``(prefix, suffix)`` PEFT puts around it before matching (:data:`PEFT_KEY_WRAP`,
            :data:`LAYERS_WRAP`); the wrapped text is what both engines must accept.

    Returns:
        The compiled RE2 pattern of ``prefix + pattern + suffix``.

    Raises:
        InvalidAdapterError: longer than :data:`MAX_PATTERN_CHARS`; not a valid Python regex
            (PEFT would fail on it too); written with ``{,n}`` or ``[:``; or using a feature
            RE2 does not run in linear time (lookaround, backreferences, possessive
            quantifiers, atomic groups, repetitions above 1000, a program above
            :data:`MAX_PATTERN_MEMORY`).
    """
    shown = quoted(pattern, 80)
    where = f"{CONFIG_NAME}: {field} {shown}"
    if len(pattern) > MAX_PATTERN_CHARS:
        raise InvalidAdapterError(
            f"{where} is {len(pattern)} characters long; at most {MAX_PATTERN_CHARS} are "
            "accepted (list module names or shorten the regex)"
        )
    if "{," in pattern:
        raise InvalidAdapterError(
            f"{where} uses {{,n}}, which RE2 reads as literal text where Python repeats; "
            "write {0,n}"
        )
    if "[:" in pattern:
        raise InvalidAdapterError(
            f"{where} uses '[:', which RE2 reads as a POSIX class where Python reads "
            "literal text; escape it as '\\[:' or list the characters"
        )
    text = wrap[0] + pattern + wrap[1]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            re.compile(text)
    except Warning as e:
        raise InvalidAdapterError(
            f"{where} is ambiguous: Python's re warns {e}; escape the character"
        ) from None
    except (re.error, RecursionError, OverflowError) as e:
        raise InvalidAdapterError(f"{where} is not a valid regex: {e}") from None
    try:
        return re2.compile(text, _OPTIONS)
    except re2.error as e:
        raise InvalidAdapterError(
            f"{where} cannot be matched in linear time: it uses {_why_re2(e)}; patterns are "
            "matched with RE2 (no lookaround, backreferences, possessive quantifiers or atomic "
            "groups): rewrite it without them or list the module names"
        ) from None


def check_count(field: str, entries: Iterable[object]) -> None:
    """Refuse more than :data:`MAX_PATTERNS` entries in one config field.

    Raises:
        InvalidAdapterError: naming the field and the count.
    """
    n = sum(1 for _ in entries)
    if n > MAX_PATTERNS:
        raise InvalidAdapterError(
            f"{CONFIG_NAME}: {field} has {n} entries; at most {MAX_PATTERNS} are accepted "
            "(merge them into fewer regexes)"
        )


def full_match(compiled: re2._Regexp, name: str) -> bool:
    """PEFT's ``re.fullmatch(pattern, name)`` for a pattern from :func:`compile_pattern`."""
    return compiled.fullmatch(name) is not None


def first_key(keys: Iterable[tuple[str, re2._Regexp]], name: str) -> str | None:
    """The first ``key`` (in the given order) whose :data:`PEFT_KEY_WRAP`-compiled pattern
    matches ``name`` from its start: PEFT's ``get_pattern_key``; ``None`` when none does."""
    for key, compiled in keys:
        if compiled.match(name) is not None:
            return key
    return None


def layer_index(layers_patterns: Iterable[re2._Regexp] | None, name: str) -> int | None:
    """The layer index PEFT reads from ``name`` for ``layers_to_transform``.

    Args:
        layers_patterns: ``layers_pattern`` entries compiled with :data:`LAYERS_WRAP`, in
            config order; ``None`` or empty = PEFT's default (the first numbered segment).
        name: Module name, e.g. ``model.layers.3.mlp.up_proj``.

    Returns:
        The index, or ``None`` when no pattern finds one.
    """
    compiled = list(layers_patterns or ())
    m = None
    if not compiled:
        m = _DEFAULT_LAYER_RE.match(name)
    else:
        for c in compiled:
            m = c.match(name)
            if m is not None:
                break
    if m is None:
        return None
    return int(m.group("idx"))
