"""The MoE settings of a GLM-5.3-Flash ``config.json`` (DeepSeek-V3-style keys).

The sibling families DeepSeek-V3 and GLM-4.5 share the router and experts, without the
SwiGLU clamp.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from megamoe.core.checkpoint.hf_config import (
    WordedDefault,
    bool_key,
    float_key,
    int_key,
    is_int,
    key_text,
    quantization_config,
    swiglu_act,
    text_config,
)
from megamoe.core.numerics.formats import BLOCK_FP8_DEFAULT

if TYPE_CHECKING:
    import torch

MODEL_NAME = "GLM-5.3-Flash"
SCORING_FUNC = "sigmoid"  # the only router scoring GLM-5.3-Flash uses
ROUTER_TOP2 = 2  # a group's score is the sum of its best two expert scores
GLM5_NEXT = "glm5_next"  # composite config (and flat text-only GLM-5.3-Flash configs)
GLM5_NEXT_TEXT = "glm5_next_text"  # its text sub-config
DEEPSEEK_V3 = "deepseek_v3"  # sibling families with the same router and experts, no clamp
GLM4_MOE = "glm4_moe"
LEGACY_MODEL_TYPE = "glm5next"  # the name megamoe's own synthetic checkpoints once used
MODEL_TYPES = (GLM5_NEXT, GLM5_NEXT_TEXT, DEEPSEEK_V3, GLM4_MOE, LEGACY_MODEL_TYPE)
ARCHITECTURE = "Glm5NextForConditionalGeneration"
ARCHITECTURES = (
    ARCHITECTURE,
    "Glm5NextForCausalLM",  # what other engines register for text-only GLM-5.3-Flash
    "DeepseekV3ForCausalLM",
    "Glm4MoeForCausalLM",
)
MLP_DENSE, MLP_SPARSE = "dense", "sparse"
GLM5_LEADING_DENSE = 3  # mlp_layer_types default: three dense layers, then sparse ones
# transformers' class defaults (Glm5NextTextConfig, DeepseekV3Config, Glm4MoeConfig) of the
# keys read here, taken when config.json leaves a key out. swiglu_limit None: no clamp.
# num_nextn_predict_layers: DeepSeek-V3 and GLM-4.5 default to one MTP layer; transformers
# has no GLM-5.3-Flash MTP field, and other loaders default to one as well.
DEFAULTS: dict[str, dict[str, Any]] = {
    GLM5_NEXT: {
        "hidden_size": 4096,
        "num_hidden_layers": 45,
        "n_routed_experts": 288,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 2048,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "swiglu_limit": 10.0,
        "num_nextn_predict_layers": 1,
    },
    DEEPSEEK_V3: {
        "hidden_size": 7168,
        "num_hidden_layers": 61,
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 2048,
        "n_shared_experts": 1,
        "n_group": 8,
        "topk_group": 4,
        "routed_scaling_factor": 2.5,
        "swiglu_limit": None,
        "num_nextn_predict_layers": 1,
        "first_k_dense_replace": 3,
    },
    GLM4_MOE: {
        "hidden_size": 4096,
        "num_hidden_layers": 46,
        "n_routed_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 1408,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "swiglu_limit": None,
        "num_nextn_predict_layers": 1,
        "first_k_dense_replace": 1,
    },
}
MTP_COUNT_ALIAS = "num_mtp_layers"  # transformers' attribute name for the same count


def model_family(config: Mapping[str, Any]) -> str:
    """``deepseek_v3``, ``glm4_moe``, or ``glm5_next`` (composite, text-only or legacy)."""
    types = {config.get("model_type"), text_config(config).get("model_type")}
    archs = set(config.get("architectures") or ())
    for family, arch in ((DEEPSEEK_V3, "DeepseekV3ForCausalLM"), (GLM4_MOE, "Glm4MoeForCausalLM")):
        if family in types or arch in archs:
            return family
    return GLM5_NEXT


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
    if (int(block[0]), int(block[1])) != BLOCK_FP8_DEFAULT:
        raise ValueError(
            f"config.json: quantization_config.weight_block_size={list(block)} is not "
            f"supported: GLM-5.3-Flash's block-FP8 experts (and megamoe's) use "
            f"{list(BLOCK_FP8_DEFAULT)}; requantize the checkpoint to 128x128 blocks"
        )
    return int(block[0]), int(block[1])


def _mlp_layer_types(
    config: Mapping[str, Any], family: str, num_layers: int, defaulted: Mapping[str, Any]
) -> tuple[str, ...]:
    """``dense`` or ``sparse`` per decoder layer, by the family's own rule.

    GLM-5.3-Flash: ``mlp_layer_types`` (default three dense layers, then sparse; a stale
    ``first_k_dense_replace`` is ignored, as transformers ignores it). DeepSeek-V3 and
    GLM-4.5: layers from ``first_k_dense_replace`` on are sparse (``moe_layer_freq`` is
    ignored, as transformers ignores it).
    """
    if family != GLM5_NEXT:
        first = int_key(
            config,
            "first_k_dense_replace",
            model=MODEL_NAME,
            default=DEFAULTS[family]["first_k_dense_replace"],
            minimum=0,
        )
        return tuple(MLP_DENSE if i < first else MLP_SPARSE for i in range(num_layers))
    types = config.get("mlp_layer_types")
    if types is None:
        dense = min(GLM5_LEADING_DENSE, num_layers)
        return (MLP_DENSE,) * dense + (MLP_SPARSE,) * (num_layers - dense)
    if (
        not isinstance(types, list | tuple)
        or len(types) != num_layers
        or any(t not in (MLP_DENSE, MLP_SPARSE) for t in types)
    ):
        raise ValueError(
            f"config.json: mlp_layer_types={types!r} must list {MLP_DENSE!r} or {MLP_SPARSE!r} "
            f"for each decoder layer ({key_text('num_hidden_layers', num_layers, defaulted)}): "
            "set both to the checkpoint's layers"
        )
    return tuple(types)


@dataclass(frozen=True)
class Glm5NextConfig:
    """What megamoe needs from a GLM-5.3-Flash (or DeepSeek-V3, GLM-4.5) ``config.json``.

    Composite ``glm5_next`` configs (the text model's keys under ``text_config``), flat
    GLM-5.3-Flash configs and the flat ``deepseek_v3`` / ``glm4_moe`` configs are read
    alike; keys left out take transformers' defaults for the family (``DEFAULTS``).
    ``hidden_size``, ``num_experts_per_tok``, ``moe_intermediate_size``,
    ``num_hidden_layers``, ``num_nextn_predict_layers``, ``swiglu_limit`` and
    ``quantization_config`` (None when absent) mean what
    ``megamoe.core.checkpoint.hf_config.MoEConfig`` says.

    Attributes:
        model_type: the family: ``glm5_next``, ``deepseek_v3`` or ``glm4_moe``.
        n_routed_experts: routed experts per MoE layer E (``num_routed_experts``).
        n_shared_experts: shared experts per layer; their MLP is ``n_shared_experts * I``
            wide.
        n_group: expert groups the router first chooses among.
        topk_group: groups kept per token.
        routed_scaling_factor: multiplies the routing weights.
        norm_topk_prob: renormalize the chosen weights to sum to one before scaling.
        mlp_layer_types: ``dense`` or ``sparse`` per main-model decoder layer.
        weight_block_size: rows x columns of one block-FP8 scale.
        defaulted: keys ``config.json`` leaves out, with the transformers default taken.
        mtp_count_key: the key the MTP layer count is read from.
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
    mlp_layer_types: tuple[str, ...]
    num_nextn_predict_layers: int
    weight_block_size: tuple[int, int]
    swiglu_limit: float | None = None
    model_type: str = GLM5_NEXT
    quantization_config: Mapping[str, Any] | None = None
    defaulted: Mapping[str, Any] = field(default_factory=dict, compare=False)
    mtp_count_key: str = "num_nextn_predict_layers"

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
        return self.mlp_layer_types[layer] == MLP_SPARSE

    def dense_reason(self, index: int) -> tuple[str, str]:
        """The key (or default) that makes layer ``index`` dense, and the fix."""
        if self.model_type == GLM5_NEXT:
            if "mlp_layer_types" not in self.defaulted:
                return (
                    f"mlp_layer_types[{index}]={MLP_DENSE!r}",
                    f"set mlp_layer_types[{index}] to {MLP_SPARSE!r} in config.json",
                )
            return (
                f"mlp_layer_types, absent from config.json: transformers' {GLM5_NEXT} default "
                f"makes the first {GLM5_LEADING_DENSE} decoder layers dense",
                f"add mlp_layer_types to config.json, {MLP_SPARSE!r} for layer {index} (one "
                f"{MLP_DENSE!r} or {MLP_SPARSE!r} per decoder layer)",
            )
        first = self.mlp_layer_types.count(MLP_DENSE)
        if "first_k_dense_replace" not in self.defaulted:
            cause = f"first_k_dense_replace={first} (the layers below it are dense)"
        else:
            cause = (
                f"first_k_dense_replace, absent from config.json: transformers' "
                f"{self.model_type} default {first} makes the layers below it dense"
            )
        most = f"{index} or less" if index else "0"
        return cause, f"set first_k_dense_replace to {most} in config.json"

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> Glm5NextConfig:
        """The validated MoE keys of a parsed ``config.json`` (``MoEConfig.from_dict``).

        Raises:
            ValueError: a key has the wrong type or breaks a rule; the message names the
                key, its value and the rule.
            NotImplementedError: a router scoring function or activation other than the
                ones GLM-5.3-Flash uses.
        """
        family = model_family(config)
        text = text_config(config)
        defaults = DEFAULTS[family]
        scoring = text.get("scoring_func", SCORING_FUNC)
        if scoring != SCORING_FUNC:
            raise NotImplementedError(
                f"config.json: scoring_func={scoring!r}; the {MODEL_NAME} router scores "
                f"experts with {SCORING_FUNC!r} only"
            )
        swiglu_act(text)
        quant = quantization_config(config)

        defaulted = {
            key: value
            for key, value in defaults.items()
            if text.get(key) is None and value is not None
        }
        if family == GLM5_NEXT and text.get("mlp_layer_types") is None:
            defaulted["mlp_layer_types"] = WordedDefault(
                f"the first {GLM5_LEADING_DENSE} layers dense, then sparse"
            )

        def read(key: str, minimum: int = 1) -> int:
            return int_key(text, key, model=MODEL_NAME, default=defaults[key], minimum=minimum)

        num_layers = read("num_hidden_layers")
        mtp_key = MTP_COUNT_ALIAS if text.get("num_nextn_predict_layers") is None else None
        mtp_count_key = "num_nextn_predict_layers"
        if mtp_key is not None and text.get(mtp_key) is not None:
            defaulted.pop(mtp_count_key, None)
            mtp_count_key = mtp_key
        limit = defaults["swiglu_limit"]
        cfg = cls(
            hidden_size=read("hidden_size"),
            n_routed_experts=read("n_routed_experts"),
            num_experts_per_tok=read("num_experts_per_tok"),
            moe_intermediate_size=read("moe_intermediate_size"),
            n_shared_experts=read("n_shared_experts", minimum=0),
            n_group=read("n_group"),
            topk_group=read("topk_group"),
            routed_scaling_factor=float_key(
                text, "routed_scaling_factor", default=defaults["routed_scaling_factor"]
            ),
            norm_topk_prob=bool_key(text, "norm_topk_prob", default=True),
            num_hidden_layers=num_layers,
            mlp_layer_types=_mlp_layer_types(text, family, num_layers, defaulted),
            num_nextn_predict_layers=int_key(
                text,
                mtp_key or "num_nextn_predict_layers",
                model=MODEL_NAME,
                default=defaults["num_nextn_predict_layers"],
                minimum=0,
            ),
            weight_block_size=_block_size(quant),
            swiglu_limit=None if limit is None else float_key(text, "swiglu_limit", default=limit),
            model_type=family,
            quantization_config=quant,
            defaulted=defaulted,
            mtp_count_key=mtp_count_key,
        )
        cfg._check_router()
        return cfg

    def _check_router(self) -> None:
        """The group-limited top-k needs whole groups with room for the chosen experts."""
        if self.n_routed_experts % self.n_group:
            experts = key_text("n_routed_experts", self.n_routed_experts, self.defaulted)
            raise ValueError(
                f"config.json: {experts} is not divisible by "
                f"{key_text('n_group', self.n_group, self.defaulted)}; the router splits experts "
                "into equal groups"
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


def check_group_settings(
    num_experts: int, correction_bias: torch.Tensor, top_k: int, n_group: int, topk_group: int
) -> None:
    """Reject group settings under which the router's choice is not defined.

    Raises:
        ValueError: a bias that is not (E,), E not a multiple of ``n_group``, fewer than
            two experts per group, ``topk_group`` outside 1..n_group, or more experts
            asked for than the kept groups hold.
    """
    if n_group < 1 or num_experts % n_group or correction_bias.shape != (num_experts,):
        raise ValueError(
            f"router: scores have {num_experts} experts and the bias shape "
            f"{tuple(correction_bias.shape)}; expected ({num_experts},) and a multiple of "
            f"n_group={n_group}"
        )
    per_group = num_experts // n_group
    if per_group < ROUTER_TOP2 or not 1 <= topk_group <= n_group:
        raise ValueError(
            f"router: n_group={n_group}, topk_group={topk_group} for {num_experts} experts; "
            f"each group needs >= {ROUTER_TOP2} experts (its score sums its best two) and "
            "1 <= topk_group <= n_group"
        )
    if not 1 <= top_k <= topk_group * per_group:
        raise ValueError(
            f"router: top_k={top_k} outside 1..{topk_group * per_group}, the experts of the "
            f"topk_group={topk_group} kept groups of {per_group}; lower top_k or keep more "
            "groups"
        )
