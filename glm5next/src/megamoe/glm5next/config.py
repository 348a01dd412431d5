"""The MoE settings of a GLM-5.3-Flash ``config.json`` (DeepSeek-V3-style keys)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megamoe.core.formats import BLOCK_FP8_DEFAULT

MODEL_NAME = "GLM-5.3-Flash"
SCORING_FUNC = "sigmoid"  # the only router scoring GLM-5.3-Flash uses
HIDDEN_ACT = "silu"  # experts are SwiGLU MLPs
ROUTER_TOP2 = 2  # a group's score is the sum of its best two expert scores


def _int(config: Mapping[str, Any], key: str, default: int | None = None, minimum: int = 1) -> int:
    """``config[key]`` as an int >= ``minimum``, or a ValueError naming the key."""
    if key not in config or config[key] is None:
        if default is None:
            raise ValueError(f"config.json: {key!r} is missing; a {MODEL_NAME} config sets it")
        return default
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(
            f"config.json: {key}={value!r} must be an integer >= {minimum}; fix the config"
        )
    return value


def _block_size(quantization_config: Mapping[str, Any] | None) -> tuple[int, int]:
    """``weight_block_size`` of the quantization config, (128, 128) when absent."""
    if not quantization_config or quantization_config.get("weight_block_size") is None:
        return BLOCK_FP8_DEFAULT
    block = quantization_config["weight_block_size"]
    if (
        not isinstance(block, list | tuple)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ValueError(
            f"config.json: quantization_config.weight_block_size={block!r} must be two "
            "positive integers [rows, columns], e.g. [128, 128]"
        )
    return int(block[0]), int(block[1])


@dataclass(frozen=True)
class Glm5NextConfig:
    """What megamoe needs from a GLM-5.3-Flash ``config.json``.

    Attributes:
        hidden_size: model width H.
        n_routed_experts: routed experts per MoE layer E.
        num_experts_per_tok: experts each token is routed to (top-k).
        moe_intermediate_size: width I of one routed expert's MLP.
        n_shared_experts: shared experts per layer; their MLP is ``n_shared_experts * I``
            wide.
        n_group: expert groups the router first chooses among.
        topk_group: groups kept per token.
        routed_scaling_factor: multiplies the routing weights.
        norm_topk_prob: renormalize the chosen weights to sum to one before scaling.
        num_hidden_layers: decoder layers of the main model.
        first_k_dense_replace: leading layers with a dense MLP instead of MoE.
        moe_layer_freq: every ``moe_layer_freq``-th layer (from the first sparse one) is MoE.
        num_nextn_predict_layers: MTP drafter layers (each an MoE layer).
        weight_block_size: rows x columns of one block-FP8 scale.
        quantization_config: the raw ``quantization_config`` (None when absent).
    """

    hidden_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    num_hidden_layers: int
    first_k_dense_replace: int
    moe_layer_freq: int
    num_nextn_predict_layers: int
    weight_block_size: tuple[int, int]
    quantization_config: Mapping[str, Any] | None = None

    @property
    def experts_per_group(self) -> int:
        """Routed experts in one router group."""
        return self.n_routed_experts // self.n_group

    @property
    def shared_intermediate_size(self) -> int:
        """Width of the shared-expert MLP (all shared experts together)."""
        return self.n_shared_experts * self.moe_intermediate_size

    def is_moe_layer(self, layer: int) -> bool:
        """Whether main-model decoder layer ``layer`` has an MoE MLP."""
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> Glm5NextConfig:
        """Read and validate the MoE keys of a ``config.json``.

        Args:
            config: the parsed ``config.json``.

        Returns:
            The validated settings.

        Raises:
            ValueError: a key is missing, has the wrong type or breaks a rule; the
                message names the key, its value and the rule.
            NotImplementedError: a router scoring function or activation other than the
                ones GLM-5.3-Flash uses.
        """
        scoring = config.get("scoring_func", SCORING_FUNC)
        if scoring != SCORING_FUNC:
            raise NotImplementedError(
                f"config.json: scoring_func={scoring!r}; the {MODEL_NAME} router scores "
                f"experts with {SCORING_FUNC!r} only"
            )
        act = config.get("hidden_act", HIDDEN_ACT)
        if act != HIDDEN_ACT:
            raise NotImplementedError(
                f"config.json: hidden_act={act!r}; MegaMoE experts are SwiGLU ({HIDDEN_ACT!r})"
            )
        scaling = config.get("routed_scaling_factor", 1.0)
        if isinstance(scaling, bool) or not isinstance(scaling, int | float) or not scaling > 0:
            raise ValueError(
                f"config.json: routed_scaling_factor={scaling!r} must be a positive number"
            )
        norm = config.get("norm_topk_prob", True)
        if not isinstance(norm, bool):
            raise ValueError(f"config.json: norm_topk_prob={norm!r} must be true or false")
        quant = config.get("quantization_config")
        if quant is not None and not isinstance(quant, Mapping):
            raise ValueError(
                f"config.json: quantization_config={quant!r} must be an object (or absent)"
            )
        cfg = cls(
            hidden_size=_int(config, "hidden_size"),
            n_routed_experts=_int(config, "n_routed_experts"),
            num_experts_per_tok=_int(config, "num_experts_per_tok"),
            moe_intermediate_size=_int(config, "moe_intermediate_size"),
            n_shared_experts=_int(config, "n_shared_experts", default=0, minimum=0),
            n_group=_int(config, "n_group", default=1),
            topk_group=_int(config, "topk_group", default=1),
            routed_scaling_factor=float(scaling),
            norm_topk_prob=norm,
            num_hidden_layers=_int(config, "num_hidden_layers"),
            first_k_dense_replace=_int(config, "first_k_dense_replace", default=0, minimum=0),
            moe_layer_freq=_int(config, "moe_layer_freq", default=1),
            num_nextn_predict_layers=_int(config, "num_nextn_predict_layers", default=0, minimum=0),
            weight_block_size=_block_size(quant),
            quantization_config=quant,
        )
        cfg._check_router()
        return cfg

    def _check_router(self) -> None:
        """The group-limited top-k needs whole groups with room for the chosen experts."""
        if self.n_routed_experts % self.n_group:
            raise ValueError(
                f"config.json: n_routed_experts={self.n_routed_experts} is not divisible by "
                f"n_group={self.n_group}; the router splits experts into equal groups"
            )
        if self.experts_per_group < ROUTER_TOP2:
            raise ValueError(
                f"config.json: n_group={self.n_group} leaves {self.experts_per_group} expert(s) "
                f"per group; a group's score sums its best {ROUTER_TOP2}, so use n_group <= "
                f"{self.n_routed_experts // ROUTER_TOP2}"
            )
        if self.topk_group > self.n_group:
            raise ValueError(
                f"config.json: topk_group={self.topk_group} exceeds n_group={self.n_group}; "
                "the router keeps at most every group"
            )
        room = self.topk_group * self.experts_per_group
        if self.num_experts_per_tok > room:
            raise ValueError(
                f"config.json: num_experts_per_tok={self.num_experts_per_tok} exceeds the "
                f"{room} experts in topk_group={self.topk_group} groups of "
                f"{self.experts_per_group}; raise topk_group or lower num_experts_per_tok"
            )
