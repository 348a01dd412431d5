"""The Qwen4Exp model configuration, read from a Hugging Face ``config.json``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODEL_TYPE = "qwen4_exp"
ARCHITECTURE = "Qwen4ExpForCausalLM"
SUPPORTED_ACT = "silu"  # the MegaMoE kernel fuses SwiGLU


@dataclass(frozen=True)
class Qwen4ExpConfig:
    """The keys of a Qwen4Exp (Qwen3-Next style) ``config.json`` that its MoE blocks use.

    Attributes:
        hidden_size: model width H.
        num_experts: routed experts per MoE layer E.
        num_experts_per_tok: experts each token is routed to (top-k).
        moe_intermediate_size: routed expert width I.
        shared_expert_intermediate_size: shared expert width.
        num_hidden_layers: decoder layers of the main model.
        norm_topk_prob: renormalize the top-k routing weights to sum to one.
        hidden_act: the experts' activation (``silu``: SwiGLU).
        decoder_sparse_step: every ``decoder_sparse_step``-th layer is an MoE layer.
        mlp_only_layers: layers that are dense MLPs regardless of the step.
        num_nextn_predict_layers: layers of the MTP drafter (each an MoE layer).
        quantization_config: the checkpoint's quantization config, None when unquantized.
    """

    hidden_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    num_hidden_layers: int
    norm_topk_prob: bool = True
    hidden_act: str = SUPPORTED_ACT
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    num_nextn_predict_layers: int = 0
    quantization_config: Mapping[str, Any] | None = field(default=None, compare=False)

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> Qwen4ExpConfig:
        """Read and validate the keys from a ``config.json`` mapping.

        Args:
            config: the parsed ``config.json``.

        Returns:
            The validated config.

        Raises:
            ValueError: a missing or invalid key; the message names the key, the value and
                the rule.
            NotImplementedError: ``hidden_act`` other than ``silu``.
        """
        sizes = {
            key: _positive_int(config, key)
            for key in (
                "hidden_size",
                "num_experts",
                "num_experts_per_tok",
                "moe_intermediate_size",
                "shared_expert_intermediate_size",
                "num_hidden_layers",
            )
        }
        if sizes["num_experts_per_tok"] > sizes["num_experts"]:
            raise ValueError(
                f"config num_experts_per_tok={sizes['num_experts_per_tok']} exceeds "
                f"num_experts={sizes['num_experts']}; a token cannot pick more experts than exist"
            )
        norm = config.get("norm_topk_prob", True)
        if not isinstance(norm, bool):
            raise ValueError(f"config norm_topk_prob must be true or false, got {norm!r}")
        act = config.get("hidden_act", SUPPORTED_ACT)
        if act != SUPPORTED_ACT:
            raise NotImplementedError(
                f"config hidden_act={act!r} is not supported; MegaMoE fuses SwiGLU, so the "
                f"experts must use hidden_act={SUPPORTED_ACT!r}"
            )
        step = _positive_int(config, "decoder_sparse_step", default=1)
        mlp_only = config.get("mlp_only_layers") or []
        num_layers = sizes["num_hidden_layers"]
        if not isinstance(mlp_only, list | tuple) or not all(
            _is_int(i) and 0 <= i < num_layers for i in mlp_only
        ):
            raise ValueError(
                f"config mlp_only_layers={mlp_only!r} must list layer indices in "
                f"[0, num_hidden_layers={num_layers})"
            )
        mtp = _non_negative_int(config, "num_nextn_predict_layers")
        quant = config.get("quantization_config")
        if quant is not None and not isinstance(quant, Mapping):
            raise ValueError(
                f"config quantization_config must be an object, got {type(quant).__name__}"
            )
        return cls(
            **sizes,
            norm_topk_prob=norm,
            hidden_act=act,
            decoder_sparse_step=step,
            mlp_only_layers=tuple(sorted(set(mlp_only))),
            num_nextn_predict_layers=mtp,
            quantization_config=quant or None,
        )

    @classmethod
    def from_json(cls, path: str | Path) -> Qwen4ExpConfig:
        """Read ``config.json`` (or a checkpoint directory holding it).

        Raises:
            FileNotFoundError: no such file.
            ValueError: invalid JSON or keys (see ``from_dict``).
        """
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
        return cls.from_dict(data)

    def is_moe_layer(self, index: int) -> bool:
        """Whether main-model layer ``index`` is a sparse MoE layer (Qwen3-Next rule)."""
        return index not in self.mlp_only_layers and (index + 1) % self.decoder_sparse_step == 0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(config: Mapping[str, Any], key: str, default: int | None = None) -> int:
    """``config[key]`` as an int > 0 (``default`` when absent and one is given)."""
    if key not in config and default is not None:
        return default
    if key not in config:
        raise ValueError(f"config has no {key!r}; a Qwen4Exp config.json needs it")
    value = config[key]
    if not _is_int(value) or value <= 0:
        raise ValueError(f"config {key}={value!r} must be a positive integer")
    return int(value)


def _non_negative_int(config: Mapping[str, Any], key: str) -> int:
    """``config[key]`` as an int >= 0, 0 when absent or null."""
    value = config.get(key) or 0
    if not _is_int(value) or value < 0:
        raise ValueError(f"config {key}={value!r} must be a non-negative integer")
    return int(value)
