"""The MoE settings of a GLM-5.3-Flash ``config.json`` (DeepSeek-V3-style keys)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megamoe.core.formats import BLOCK_FP8_DEFAULT
from megamoe.core.hf_config import bool_key, int_key, is_int, object_key, swiglu_act

MODEL_NAME = "GLM-5.3-Flash"
SCORING_FUNC = "sigmoid"  # the only router scoring GLM-5.3-Flash uses
ROUTER_TOP2 = 2  # a group's score is the sum of its best two expert scores


def _block_size(quantization_config: Mapping[str, Any] | None) -> tuple[int, int]:
    """``weight_block_size`` of the quantization config, (128, 128) when absent."""
    if not quantization_config or quantization_config.get("weight_block_size") is None:
        return BLOCK_FP8_DEFAULT
    block = quantization_config["weight_block_size"]
    if (
        not isinstance(block, list | tuple)
        or len(block) != 2
        or not all(is_int(b) and b > 0 for b in block)
    ):
        raise ValueError(
            f"config.json: quantization_config.weight_block_size={block!r} must be two "
            "positive integers [rows, columns], e.g. [128, 128]"
        )
    return int(block[0]), int(block[1])


@dataclass(frozen=True)
class Glm5NextConfig:
    """What megamoe needs from a GLM-5.3-Flash ``config.json``.

    ``hidden_size``, ``num_experts_per_tok``, ``moe_intermediate_size``,
    ``num_hidden_layers``, ``num_nextn_predict_layers`` and ``quantization_config`` (None
    when absent) mean what ``megamoe.core.hf_config.MoEConfig`` says.

    Attributes:
        n_routed_experts: routed experts per MoE layer E (``num_routed_experts``).
        n_shared_experts: shared experts per layer; their MLP is ``n_shared_experts * I``
            wide.
        n_group: expert groups the router first chooses among.
        topk_group: groups kept per token.
        routed_scaling_factor: multiplies the routing weights.
        norm_topk_prob: renormalize the chosen weights to sum to one before scaling.
        first_k_dense_replace: leading layers with a dense MLP instead of MoE.
        moe_layer_freq: every ``moe_layer_freq``-th layer (from the first sparse one) is MoE.
        weight_block_size: rows x columns of one block-FP8 scale.
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
    def num_routed_experts(self) -> int:
        """Routed experts per MoE layer (``n_routed_experts``)."""
        return self.n_routed_experts

    @property
    def shared_intermediate_size(self) -> int:
        """Width of the shared-expert MLP (all shared experts together)."""
        return self.n_shared_experts * self.moe_intermediate_size

    def is_moe_layer(self, layer: int) -> bool:
        """Whether main-model decoder layer ``layer`` has an MoE MLP."""
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> Glm5NextConfig:
        """The validated MoE keys of a parsed ``config.json`` (``MoEConfig.from_dict``).

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
        swiglu_act(config)
        scaling = config.get("routed_scaling_factor", 1.0)
        if isinstance(scaling, bool) or not isinstance(scaling, int | float) or not scaling > 0:
            raise ValueError(
                f"config.json: routed_scaling_factor={scaling!r} must be a positive number"
            )
        quant = object_key(config, "quantization_config")
        read = functools.partial(int_key, config, model=MODEL_NAME)
        cfg = cls(
            hidden_size=read("hidden_size"),
            n_routed_experts=read("n_routed_experts"),
            num_experts_per_tok=read("num_experts_per_tok"),
            moe_intermediate_size=read("moe_intermediate_size"),
            n_shared_experts=read("n_shared_experts", default=0, minimum=0),
            n_group=read("n_group", default=1),
            topk_group=read("topk_group", default=1),
            routed_scaling_factor=float(scaling),
            norm_topk_prob=bool_key(config, "norm_topk_prob", default=True),
            num_hidden_layers=read("num_hidden_layers"),
            first_k_dense_replace=read("first_k_dense_replace", default=0, minimum=0),
            moe_layer_freq=read("moe_layer_freq", default=1),
            num_nextn_predict_layers=read("num_nextn_predict_layers", default=0, minimum=0),
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
