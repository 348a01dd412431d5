"""Model configs from Hugging Face ``config.json``: typed key reads and what core reads.

Adapters parse their model's config with the ``*_key`` readers, so that every missing or
invalid key is reported the same way: ``config.json: <key>=<value> must be <rule>``. A key
set to ``null`` counts as absent. The parsed config is the adapter's own class; core reads
it through ``MoEConfig``.

Composite (vision-language) configs keep the text model's keys under ``text_config``;
``text_config`` gives the keys an adapter reads from either shape, with the
``quantization_config`` looked up as transformers does (top level first, then
``text_config``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Protocol, Self

SWIGLU_ACT = "silu"  # MegaMoE fuses SwiGLU: gate activation silu
SWIGLU_ACTS = frozenset({SWIGLU_ACT, "swish"})  # transformers' names of that activation
# Upper bounds of the sizes a config may give, checked when the key is read (before any
# loop or allocation it sizes). Far above every released MoE model: the largest today have
# hidden 7168 (DeepSeek-V3), expert width 2048, dense width 18432, 512 routed experts
# (Qwen4-Exp), top-10, 94 layers, 1 MTP layer.
SIZE_BOUNDS = {
    "hidden_size": 65536,
    "moe_intermediate_size": 65536,
    "shared_expert_intermediate_size": 65536,
    "intermediate_size": 262144,
    "num_experts": 16384,
    "n_routed_experts": 16384,
    "num_experts_per_tok": 1024,
    "n_shared_experts": 64,
    "n_group": 16384,
    "topk_group": 16384,
    "num_hidden_layers": 1024,
    "first_k_dense_replace": 1024,
    "decoder_sparse_step": 1024,
    "num_nextn_predict_layers": 64,
    "mtp_num_hidden_layers": 64,
}
# Keys that decide which layers are MoE layers (besides the layer and MTP counts).
LAYER_RULE_KEYS = frozenset({"mlp_layer_types", "mlp_only_layers"})
TEXT_CONFIG = "text_config"  # sub-config of the text model in composite configs
QUANTIZATION_CONFIG = "quantization_config"


class MoEConfig(Protocol):
    """What core reads from an adapter's parsed model config (layers and expert sizes)."""

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> Self:
        """Read and validate the keys of a parsed ``config.json``.

        Raises:
            ValueError: a missing or invalid key, named with its value and the rule.
            NotImplementedError: a setting megamoe cannot run (named).
        """

    @property
    def hidden_size(self) -> int:
        """Model width H."""

    @property
    def moe_intermediate_size(self) -> int:
        """Width I of one routed expert's MLP."""

    @property
    def num_routed_experts(self) -> int:
        """Routed experts per MoE layer."""

    @property
    def num_experts_per_tok(self) -> int:
        """Experts each token is routed to (top-k)."""

    @property
    def num_hidden_layers(self) -> int:
        """Decoder layers of the main model."""

    @property
    def num_nextn_predict_layers(self) -> int:
        """Layers of the MTP drafter, each an MoE layer."""

    @property
    def quantization_config(self) -> Mapping[str, Any] | None:
        """The checkpoint's ``quantization_config``, None when unquantized."""

    @property
    def swiglu_limit(self) -> float | None:
        """The SwiGLU clamp of the experts (gate <= L, -L <= up <= L), None for none."""

    def is_moe_layer(self, index: int) -> bool:
        """Whether main-model decoder layer ``index`` has an MoE block."""

    @property
    def defaulted(self) -> Mapping[str, Any]:
        """Keys ``config.json`` leaves out whose transformers default was taken, by value."""

    @property
    def mtp_count_key(self) -> str:
        """The key the MTP layer count is read from (or would be, when absent)."""

    def dense_reason(self, index: int) -> tuple[str, str]:
        """Why main-model layer ``index`` is dense, and how to mark it sparse.

        Returns:
            ``(cause, fix)``: the key (or the default taken) that makes the layer dense,
            and the ``config.json`` change that makes it an MoE layer.
        """


class WordedDefault(str):
    """A default described in words (e.g. a layer rule); shown as it is, unquoted."""

    __slots__ = ()

    def __repr__(self) -> str:
        return str(self)


def key_text(key: str, value: object, defaulted: Mapping[str, Any]) -> str:
    """``key=value``, or that ``key`` is absent and transformers' default was assumed."""
    if key in defaulted:
        return f"{key} absent from config.json (transformers' default {value!r} assumed)"
    return f"{key}={value!r}"


def defaults_note(defaulted: Mapping[str, Any], model_type: str) -> str:
    """What an error led to by defaulted size keys adds: the keys and the values assumed.

    Empty when no size key (``SIZE_BOUNDS``, the layer rule) was defaulted.
    """
    sizes = {k: v for k, v in defaulted.items() if k in SIZE_BOUNDS or k in LAYER_RULE_KEYS}
    if not sizes:
        return ""
    taken = ", ".join(f"{k}={v!r}" for k, v in sizes.items())
    return (
        f"config.json leaves out {', '.join(sizes)}, so megamoe assumed transformers' "
        f"{model_type} default(s) {taken}: set the checkpoint's own values in config.json"
    )


def dense_cause(cfg: MoEConfig, index: int) -> tuple[str, str]:
    """``cfg.dense_reason(index)``; a generic one for a config class without it."""
    reason = getattr(cfg, "dense_reason", None)
    if reason is None:
        return "the config's layer rule", "mark the layer sparse in config.json"
    cause, fix = reason(index)
    return str(cause), str(fix)


def defaulted_keys(cfg: MoEConfig) -> Mapping[str, Any]:
    """``cfg.defaulted``; none for a config class without it."""
    return getattr(cfg, "defaulted", None) or {}


def mtp_count_key(cfg: MoEConfig) -> str:
    """``cfg.mtp_count_key``; ``num_nextn_predict_layers`` for a config class without it."""
    return getattr(cfg, "mtp_count_key", "num_nextn_predict_layers")


def mtp_count_text(cfg: MoEConfig) -> str:
    """The MTP layer count with the key it came from (or its default), for messages."""
    return key_text(mtp_count_key(cfg), cfg.num_nextn_predict_layers, defaulted_keys(cfg))


def is_composite(config: Mapping[str, Any]) -> bool:
    """Whether ``config`` is a composite config with the text model under ``text_config``."""
    return isinstance(config.get(TEXT_CONFIG), Mapping)


def quantization_config(config: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The ``quantization_config`` in force: the top-level one, else ``text_config``'s.

    Raises:
        ValueError: the value found is not a JSON object.
    """
    found = object_key(config, QUANTIZATION_CONFIG)
    if found is None and is_composite(config):
        found = object_key(config[TEXT_CONFIG], QUANTIZATION_CONFIG)
    return found or None


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The text model's keys of a parsed ``config.json``, flat or composite.

    A composite config gives its ``text_config`` (whose keys win over stale copies at the
    top level, as in transformers), with ``quantization_config`` set to the one in force;
    a flat config is returned as it is.

    Raises:
        ValueError: ``text_config`` or ``quantization_config`` is not a JSON object.
    """
    sub = config.get(TEXT_CONFIG)
    if sub is None:
        return config
    if not isinstance(sub, Mapping):
        raise ValueError(
            f"config.json: {TEXT_CONFIG}={sub!r} must be an object holding the text model's "
            "keys (or absent for a flat config)"
        )
    merged = dict(sub)
    quant = quantization_config(config)
    merged.pop(QUANTIZATION_CONFIG, None)
    if quant is not None:
        merged[QUANTIZATION_CONFIG] = quant
    return merged


def is_int(value: object) -> bool:
    """Whether ``value`` is an integer (``bool`` is not)."""
    return isinstance(value, int) and not isinstance(value, bool)


def int_key(
    config: Mapping[str, Any],
    key: str,
    *,
    model: str,
    default: int | None = None,
    minimum: int = 1,
) -> int:
    """``config[key]`` as an integer ``>= minimum`` and within ``SIZE_BOUNDS`` for its key.

    Args:
        config: the parsed ``config.json``.
        key: the key to read.
        model: model name for the message when the key is missing.
        default: the value when the key is absent or null; None makes it required.
        minimum: the smallest valid value.

    Returns:
        The value.

    Raises:
        ValueError: the key is required and absent, not an integer ``>= minimum``, or
            above its bound.
    """
    value = config.get(key)
    if value is None:
        if default is None:
            raise ValueError(f"config.json: {key!r} is missing; a {model} config sets it")
        return default
    if not is_int(value) or value < minimum:
        raise ValueError(
            f"config.json: {key}={value!r} must be an integer >= {minimum}; fix the config"
        )
    bound = SIZE_BOUNDS.get(key)
    if bound is not None and value > bound:
        raise ValueError(
            f"config.json: {key}={value} exceeds {bound}, the largest megamoe accepts (far "
            "above every released model); the config is damaged: fix it"
        )
    return int(value)


def bool_key(config: Mapping[str, Any], key: str, *, default: bool) -> bool:
    """``config[key]`` as a boolean, ``default`` when absent or null.

    Raises:
        ValueError: the value is not ``true`` or ``false``.
    """
    value = config.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"config.json: {key}={value!r} must be true or false")
    return value


def float_key(
    config: Mapping[str, Any], key: str, *, default: float, positive: bool = True
) -> float:
    """``config[key]`` as a finite number (``> 0`` when ``positive``), ``default`` when absent.

    Raises:
        ValueError: the value is not a finite number, or not positive when it must be.
    """
    value = config.get(key)
    if value is None:
        return default
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or (positive and not value > 0)
    ):
        rule = "a positive number" if positive else "a finite number"
        raise ValueError(f"config.json: {key}={value!r} must be {rule}; fix the config")
    return float(value)


def object_key(config: Mapping[str, Any], key: str) -> Mapping[str, Any] | None:
    """``config[key]`` as a JSON object, None when absent or null.

    Raises:
        ValueError: the value is not an object.
    """
    value = config.get(key)
    if value is not None and not isinstance(value, Mapping):
        raise ValueError(
            f"config.json: {key}={value!r} must be an object (or absent), got "
            f"{type(value).__name__}"
        )
    return value


def swiglu_act(config: Mapping[str, Any]) -> str:
    """``hidden_act`` (``silu`` when absent), refused unless it is the SwiGLU MegaMoE fuses.

    ``swish`` is accepted as ``silu``: transformers maps both names to the same function.

    Raises:
        NotImplementedError: any other activation.
    """
    act = config.get("hidden_act", SWIGLU_ACT)
    if act not in SWIGLU_ACTS:
        raise NotImplementedError(
            f"config.json: hidden_act={act!r} is not supported; MegaMoE fuses SwiGLU, so the "
            f"experts must use hidden_act={SWIGLU_ACT!r}"
        )
    return SWIGLU_ACT
