"""The checkpoint format of a layer's routed experts, read from ``quantization_config``.

Understands the configs that store experts in a format megamoe loads (SPEC §3.6):

- none: BF16.
- Hugging Face / DeepSeek ``"fp8"`` with ``weight_block_size`` [128, 128]: FP8_BLOCK; experts
  listed in ``modules_to_not_convert`` (or ``ignored_layers``): BF16.
- ``"mxfp8"`` / ``"mxfp4"`` quant methods: MXFP8 / MXFP4 (same ignore lists).
- ``"compressed-tensors"`` with format ``mxfp8-quantized`` / ``mxfp4-pack-quantized`` /
  ``nvfp4-pack-quantized`` (packed weights then named ``weight_packed``): MXFP8 / MXFP4 /
  NVFP4; experts in ``ignore``: BF16.
- NVIDIA ModelOpt ``"modelopt"`` with ``quant_algo`` ``NVFP4`` (or weight-only
  ``W4A16_NVFP4``) and group size 16, at the top level or under ``quantization``: NVFP4;
  experts matching ``ignore`` (or ``exclude_modules``; ``*`` wildcards): BF16.

A checkpoint written by ``megamoe convert`` keeps its original config and lists the converted
expert modules under ``megamoe_converted_experts`` (``mark_converted``); that entry wins for
exactly those modules.

Anything else is a NotImplementedError naming the method or format and the layer prefix:
megamoe never guesses a format it would then load wrongly.

The ignore and ``targets`` lists come from an untrusted ``config.json``: a ``re:`` pattern that
could backtrack for long (``megamoe.core.checkpoint.safe_regex``) is refused before it runs,
as is a list of more than ``MAX_PATTERNS`` patterns (a CheckpointError naming the key and
the pattern).
"""

from __future__ import annotations

import fnmatch
import functools
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from megamoe.core.checkpoint.safe_regex import SAFE_RULE, regex_problem
from megamoe.core.errors import CheckpointError
from megamoe.core.numerics.formats import BLOCK_FP8_DEFAULT, WeightFormat

# quant_method values.
METHOD_FP8 = "fp8"
METHOD_COMPRESSED_TENSORS = "compressed-tensors"
METHOD_MODELOPT = "modelopt"
# ModelOpt quant_algo values whose weights are NVFP4 (W4A4 and weight-only W4A16).
MODELOPT_NVFP4_ALGOS = ("NVFP4", "W4A16_NVFP4")
MODELOPT_IGNORE_KEYS = ("ignore", "exclude_modules")  # config.json and hf_quant_config names
NVFP4_GROUP_SIZE = 16
# MX quant methods of HF-style configs, by their quant_method.
MX_METHODS = {"mxfp8": WeightFormat.MXFP8, "mxfp4": WeightFormat.MXFP4}
# compressed-tensors formats megamoe loads; "dense" leaves the weights in BF16.
COMPRESSED_TENSORS_FORMATS = {
    "dense": WeightFormat.BF16,
    "mxfp8-quantized": WeightFormat.MXFP8,
    "mxfp4-pack-quantized": WeightFormat.MXFP4,
    "nvfp4-pack-quantized": WeightFormat.NVFP4,
}
# Keys HF-style configs use to list the modules kept in high precision.
HF_IGNORE_KEYS = ("modules_to_not_convert", "ignored_layers")
COMPRESSED_TENSORS_IGNORE_KEY = "ignore"
REGEX_PREFIX = "re:"  # compressed-tensors marks regular expressions this way
MAX_PATTERNS = 4096  # re: and wildcard entries in one list (matching them stays fast)
# Key of the experts ``megamoe convert`` rewrote: {"format": "<run format>", "modules": [...]}.
CONVERTED_KEY = "megamoe_converted_experts"
# Linear modules of one routed expert, as named in checkpoints.
EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


def detect_expert_format(
    quantization_config: Mapping[str, Any] | None,
    prefix: str,
    *,
    num_experts: int | None = None,
) -> WeightFormat:
    """How the checkpoint stores the routed experts under ``prefix``.

    Args:
        quantization_config: the ``quantization_config`` of ``config.json``; None or empty
            for an unquantized checkpoint.
        prefix: the experts' module name, e.g. ``model.layers.3.mlp.experts``.
        num_experts: the number of routed experts; given, an ignore list that names some
            of them but not all is detected (and refused) expert by expert.

    Returns:
        The checkpoint format of those experts.

    Raises:
        NotImplementedError: a quantization method, format or block size megamoe cannot
            load, or an ignore list that keeps only part of the experts in BF16; the message
            names it and ``prefix``.
        ValueError: a malformed ``quantization_config`` (the message names the key).
    """
    return _detect(quantization_config, prefix, _expert_modules(prefix, num_experts))


def detect_mlp_format(quantization_config: Mapping[str, Any] | None, prefix: str) -> WeightFormat:
    """How the checkpoint stores one SwiGLU MLP under ``prefix`` (a shared expert).

    As :func:`detect_expert_format`, for the MLP's ``{gate,up,down}_proj``: an ignore list
    that names each of them keeps the MLP in BF16, as one naming ``prefix`` itself does
    (transformers writes either); one that names some of them is refused.

    Raises:
        NotImplementedError: as :func:`detect_expert_format`.
        ValueError: a malformed ``quantization_config``.
    """
    return _detect(quantization_config, prefix, [f"{prefix}.{proj}" for proj in EXPERT_PROJS])


def _detect(
    quantization_config: Mapping[str, Any] | None, prefix: str, modules: Sequence[str]
) -> WeightFormat:
    """:func:`detect_expert_format` with the linear modules ``prefix`` holds (maybe none)."""
    if not quantization_config:
        return WeightFormat.BF16
    converted = _converted_format(quantization_config, prefix)
    if converted is not None:
        return converted
    if set(quantization_config) <= {CONVERTED_KEY}:
        return WeightFormat.BF16  # a BF16 checkpoint whose other experts were converted
    method = quantization_config.get("quant_method")
    if not isinstance(method, str):
        raise ValueError(
            f"{prefix}: quantization_config has no string 'quant_method' (got {method!r}); "
            "remove quantization_config for a BF16 checkpoint or set its quant_method"
        )
    method = method.lower()
    if method == METHOD_COMPRESSED_TENSORS:
        if _ignored(quantization_config, (COMPRESSED_TENSORS_IGNORE_KEY,), prefix, modules):
            return WeightFormat.BF16
        return _compressed_tensors_format(quantization_config, prefix)
    if method == METHOD_FP8 or method in MX_METHODS:
        if _ignored(quantization_config, HF_IGNORE_KEYS, prefix, modules):
            return WeightFormat.BF16
        if method in MX_METHODS:
            return MX_METHODS[method]
        return _fp8_format(quantization_config, prefix)
    if method == METHOD_MODELOPT:
        return _modelopt_format(quantization_config, prefix, modules)
    known = ", ".join([METHOD_FP8, *MX_METHODS, METHOD_COMPRESSED_TENSORS, METHOD_MODELOPT])
    raise NotImplementedError(
        f"{prefix}: quantization_config quant_method={method!r} is not supported for MegaMoE "
        f"experts (supported: {known}, or no quantization_config for BF16); convert the "
        "checkpoint to one of those formats"
    )


def mark_converted(
    quantization_config: Mapping[str, Any] | None, fmt: WeightFormat, prefixes: Iterable[str]
) -> dict[str, Any]:
    """The ``quantization_config`` of a checkpoint whose experts at ``prefixes`` became ``fmt``.

    Every other module keeps the format the original config gives it; the converted expert
    modules are listed under ``CONVERTED_KEY`` (added to any listed before).

    Args:
        quantization_config: the original config (None for an unquantized checkpoint).
        fmt: the format the experts were converted to.
        prefixes: the converted experts' module names (``model.layers.3.mlp.experts``).

    Returns:
        A new config; the original mapping is not changed.

    Raises:
        ValueError: the original config already lists experts converted to another format.
    """
    config = dict(quantization_config or {})
    before = config.get(CONVERTED_KEY) or {}
    if before and before.get("format") != fmt.value:
        raise ValueError(
            f"quantization_config {CONVERTED_KEY} lists experts converted to "
            f"{before.get('format')!r}; convert the original checkpoint to {fmt.value} instead"
        )
    modules = sorted({*before.get("modules", ()), *prefixes})
    config[CONVERTED_KEY] = {"format": fmt.value, "modules": modules}
    return config


def unmark_converted(
    quantization_config: Mapping[str, Any], prefixes: Iterable[str]
) -> dict[str, Any]:
    """``quantization_config`` with ``prefixes`` no longer listed as converted.

    For expert groups ``megamoe convert`` left as stored (``mark_converted`` listed every
    group of a converted layer).

    Args:
        quantization_config: a config ``mark_converted`` returned.
        prefixes: module names to take out of its ``CONVERTED_KEY`` list.

    Returns:
        A new config; the original mapping is not changed.
    """
    config = dict(quantization_config)
    entry = dict(config.get(CONVERTED_KEY) or {})
    dropped = set(prefixes)
    entry["modules"] = [m for m in entry.get("modules", ()) if m not in dropped]
    config[CONVERTED_KEY] = entry
    return config


def _converted_format(config: Mapping[str, Any], prefix: str) -> WeightFormat | None:
    """The format ``CONVERTED_KEY`` gives ``prefix``, None when it does not list it."""
    entry = config.get(CONVERTED_KEY)
    if entry is None:
        return None
    if not isinstance(entry, Mapping) or not isinstance(entry.get("modules"), list):
        raise ValueError(
            f"{prefix}: quantization_config {CONVERTED_KEY} must be an object with 'format' and "
            f"a 'modules' list, got {entry!r}; re-run megamoe convert"
        )
    if prefix not in entry["modules"]:
        return None
    return WeightFormat.parse(entry.get("format", ""))


def _fp8_format(config: Mapping[str, Any], prefix: str) -> WeightFormat:
    """FP8_BLOCK when the config says 128x128 E4M3 blocks, else a refusal naming why."""
    block = config.get("weight_block_size")
    if block is None:
        raise NotImplementedError(
            f"{prefix}: quant_method='fp8' without weight_block_size stores per-tensor or "
            "per-channel FP8, which MegaMoE experts cannot load; use a checkpoint with "
            f"weight_block_size={list(BLOCK_FP8_DEFAULT)}"
        )
    if list(block) != list(BLOCK_FP8_DEFAULT):
        raise NotImplementedError(
            f"{prefix}: quantization_config weight_block_size={list(block)} is not supported; "
            f"MegaMoE reads block-FP8 experts with weight_block_size={list(BLOCK_FP8_DEFAULT)}"
        )
    fmt = config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise NotImplementedError(
            f"{prefix}: quantization_config fmt={fmt!r} is not supported; block-FP8 experts "
            "must be float8 e4m3 (fmt='e4m3')"
        )
    return WeightFormat.FP8_BLOCK


def _modelopt_format(
    config: Mapping[str, Any], prefix: str, modules: Sequence[str]
) -> WeightFormat:
    """NVFP4 for a ModelOpt NVFP4 config (BF16 where it ignores the experts), else a refusal."""
    nested = config.get("quantization")
    settings = nested if isinstance(nested, Mapping) else config
    if _ignored(settings, MODELOPT_IGNORE_KEYS, prefix, modules):
        return WeightFormat.BF16
    algo = str(settings.get("quant_algo") or "").upper()
    if algo not in MODELOPT_NVFP4_ALGOS:
        raise NotImplementedError(
            f"{prefix}: ModelOpt quant_algo={settings.get('quant_algo')!r} is not supported for "
            f"MegaMoE experts (supported: {', '.join(MODELOPT_NVFP4_ALGOS)}); convert the "
            "checkpoint to NVFP4, block-FP8 or an MX format"
        )
    group = settings.get("group_size", NVFP4_GROUP_SIZE)
    if group != NVFP4_GROUP_SIZE:
        raise NotImplementedError(
            f"{prefix}: ModelOpt NVFP4 group_size={group!r} is not supported; NVFP4 has one "
            f"E4M3 scale per {NVFP4_GROUP_SIZE} values"
        )
    return WeightFormat.NVFP4


def _compressed_tensors_format(config: Mapping[str, Any], prefix: str) -> WeightFormat:
    """The format of the compressed-tensors config group that targets the experts."""
    formats: set[str] = set()
    groups = config.get("config_groups") or {}
    top = config.get("format")
    probe = f"{prefix}.0.{EXPERT_PROJS[0]}"
    for name, group in groups.items():
        targets = _entries(group.get("targets") or (), f"config_groups.{name}.targets")
        if _matches_any(targets, (prefix, probe), class_name="Linear"):
            formats.add(str(group.get("format") or top))
    if not formats:
        # No group targets these modules: they stay unquantized (a config without groups
        # applies its top-level format everywhere).
        formats.add("dense" if groups or top is None else top)
    if len(formats) != 1:
        raise NotImplementedError(
            f"{prefix}: compressed-tensors config gives the experts the formats "
            f"{sorted(map(str, formats))}; MegaMoE needs exactly one of "
            f"{', '.join(COMPRESSED_TENSORS_FORMATS)}"
        )
    (name,) = formats
    if name not in COMPRESSED_TENSORS_FORMATS:
        raise NotImplementedError(
            f"{prefix}: compressed-tensors format {name!r} is not supported for MegaMoE "
            f"experts (supported: {', '.join(COMPRESSED_TENSORS_FORMATS)}); integer formats "
            "cannot run on MegaMoE: convert the checkpoint"
        )
    return COMPRESSED_TENSORS_FORMATS[name]


def _expert_modules(prefix: str, num_experts: int | None) -> list[str]:
    """The linear modules of every routed expert (empty when the count is unknown)."""
    if num_experts is None:
        return []
    return [f"{prefix}.{e}.{proj}" for e in range(num_experts) for proj in EXPERT_PROJS]


def _ignored(
    config: Mapping[str, Any], keys: Iterable[str], prefix: str, modules: Sequence[str]
) -> bool:
    """Whether the ignore lists under ``keys`` keep every expert at ``prefix`` unquantized.

    Raises:
        NotImplementedError: they keep only some of the experts (or some projections).
    """
    entries: list[str] = []
    named: list[str] = []
    for key in keys:
        value = config.get(key) or []
        if isinstance(value, str) or not all(isinstance(v, str) for v in value):
            raise ValueError(
                f"{prefix}: quantization_config {key} must be a list of module names, got {value!r}"
            )
        entries.extend(value)
        named.extend([key] if value else [])
    if not entries:
        return False
    checked = _entries(entries, " + ".join(named))
    if _matches_any(checked, (prefix,)):
        return True
    hits: list[str] = []
    missed = False
    if checked.below is not None:
        for module in modules:
            if _matches_any(checked.below, (module,)):
                hits.append(module)
            else:
                missed = True
            if hits and missed:
                break  # some but not all: refused below without matching the rest
    # Plain names below the prefix also say "part of the experts" without a count.
    below = [
        e
        for e in entries
        if not e.startswith(REGEX_PREFIX) and "*" not in e and e.startswith(prefix + ".")
    ]
    if modules and not missed and len(hits) == len(modules):
        return True
    if hits or below:
        shown = (hits or below)[:4]
        raise NotImplementedError(
            f"{prefix}: quantization_config ignores only some of its modules (e.g. "
            f"{', '.join(shown)}); MegaMoE needs all of them in one format: list {prefix} "
            "itself or none of its modules"
        )
    return False


def _may_name_below(entry: str) -> bool:
    """Whether ``entry`` may name a module below an experts prefix that it does not name.

    The modules are ``{prefix}.{e}.{proj}``. A plain entry that names one without naming
    the prefix ends in its expert index or its projection; patterns may name anything.
    Sorting the other entries out first keeps a long ignore list (one per layer's router,
    gate, attention projections) from being matched against every expert of every layer.
    """
    if entry.startswith(REGEX_PREFIX) or "*" in entry:
        return True
    last = entry.rpartition(".")[2]
    return last.isdigit() or last in EXPERT_PROJS


_GLOBAL_FLAGS = re.compile(r"\(\?[aiLmsux]+\)")  # flags for a whole expression: at its start


@dataclass(frozen=True)
class _Entries:
    """An ignore or ``targets`` list sorted by kind, its patterns checked and compiled."""

    raw: frozenset[str]  # the entries as given (class names match as themselves)
    plain: frozenset[tuple[str, ...]]  # dotted components of the plain module names
    # the re: and wildcard entries, one expression where they join (:func:`_joined`)
    patterns: tuple[re.Pattern[str], ...]
    below: _Entries | None = None  # the entries that may name a module below a prefix


def _entries(entries: Iterable[object], key: str) -> _Entries:
    """``entries`` (of ``quantization_config.{key}``) checked once and compiled.

    Raises:
        CheckpointError: an entry is not a string, a ``re:`` pattern could backtrack for
            long (``safe_regex.regex_problem``), or the list holds more than ``MAX_PATTERNS``
            patterns.
    """
    listed = (entries,) if isinstance(entries, str) else tuple(entries)
    names = tuple(e for e in listed if isinstance(e, str))
    if isinstance(entries, str) or len(names) != len(listed):
        raise CheckpointError(
            f"quantization_config.{key} must be a list of module names, got {list(listed)!r}"
        )
    return _checked_entries(names, key)


@functools.lru_cache(maxsize=32)
def _checked_entries(entries: tuple[str, ...], key: str) -> _Entries:
    """:func:`_entries` for one list, once: every layer of a checkpoint reads the same lists."""
    patterns = sum(1 for e in entries if e.startswith(REGEX_PREFIX) or "*" in e)
    if patterns > MAX_PATTERNS:
        raise CheckpointError(
            f"quantization_config.{key} holds {patterns} re: or wildcard patterns, more than "
            f"the {MAX_PATTERNS} megamoe matches; list the modules by name or merge the patterns"
        )
    for entry in entries:
        if entry.startswith(REGEX_PREFIX) and (
            problem := regex_problem(entry[len(REGEX_PREFIX) :])
        ):
            raise CheckpointError(
                f"quantization_config.{key} pattern {entry!r} is refused: {problem}. "
                f"megamoe runs only re: patterns that cannot backtrack for long ({SAFE_RULE}); "
                r"rewrite it (e.g. 're:.*mlp\.experts\.\d+\.gate_proj$') "
                "or list the module names"
            )
    below = tuple(filter(_may_name_below, entries))
    return _sorted_entries(entries, _sorted_entries(below) if below else None)


def _sorted_entries(entries: tuple[str, ...], below: _Entries | None = None) -> _Entries:
    """``entries`` (already checked) sorted by kind; the patterns compiled (:func:`_joined`)."""
    sources = []
    for entry in entries:
        if entry.startswith(REGEX_PREFIX):
            sources.append(entry[len(REGEX_PREFIX) :])
        elif "*" in entry:
            sources.append(fnmatch.translate(entry))  # whole names, as fnmatchcase matches
            if entry.endswith(".*"):  # "x.*" names everything below x, x itself included
                sources.append(fnmatch.translate(entry[:-2]))
    return _Entries(
        raw=frozenset(entries),
        plain=frozenset(
            tuple(e.split(".")) for e in entries if "*" not in e and not e.startswith(REGEX_PREFIX)
        ),
        patterns=_joined(sources),
        below=below,
    )


def _joined(sources: Sequence[str]) -> tuple[re.Pattern[str], ...]:
    """The expressions ``sources`` joined into one alternation where they can share one.

    One C-level match per name in place of a Python loop over the patterns: a
    ``quantization_config`` of 100 patterns runs against every expert module of every layer.
    ``re.match`` of the alternation matches where one of them does (no backreference passes
    ``regex_problem``, so no group number changes meaning). A pattern with global flags
    (``(?i)...``) keeps its own expression, as do all where group names repeat.
    """
    alone = [source for source in sources if _GLOBAL_FLAGS.match(source)]
    shared = [source for source in sources if not _GLOBAL_FLAGS.match(source)]
    compiled = [re.compile(source) for source in alone]
    if len(shared) > 1:
        try:
            return (re.compile("|".join(f"(?:{source})" for source in shared)), *compiled)
        except re.error:
            pass
    return (*(re.compile(source) for source in shared), *compiled)


def _matches_any(entries: _Entries, names: Iterable[str], class_name: str = "") -> bool:
    """Whether an entry names one of ``names`` or a module containing it.

    Plain entries match whole dotted components (``lm_head`` matches ``lm_head``,
    ``mlp.experts`` matches ``model.layers.3.mlp.experts``); ``re:`` entries are regular
    expressions matched from the start of the name; entries with ``*`` are shell-style
    wildcards matched against the whole name (ModelOpt's ``model.layers.*.mlp.gate``; one
    ending in ``.*`` also names the module above it);
    ``class_name`` matches as itself.
    """
    if class_name and class_name in entries.raw:
        return True
    for name in names:
        if entries.plain and any(run in entries.plain for run in _dotted_runs(name)):
            return True
        if any(pattern.match(name) for pattern in entries.patterns):
            return True
    return False


def _dotted_runs(name: str) -> Iterable[tuple[str, ...]]:
    """Every contiguous run of ``name``'s dotted components: the plain entries that name it.

    An entry naming an ancestor (``model.layers.3.mlp``) or a component (``experts``) of
    ``model.layers.3.mlp.experts`` covers those experts; ``gate`` does not cover ``gate_proj``.
    Looking the runs up in a set costs the same for 10 entries or 100,000.
    """
    parts = tuple(name.split("."))
    return (parts[i:j] for i in range(len(parts)) for j in range(i + 1, len(parts) + 1))
