"""The Qwen4Exp model configuration, read from a Hugging Face ``config.json``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megamoe.core.checkpoint.hf_config import (
    SWIGLU_ACT,
    bool_key,
    int_key,
    is_int,
    key_text,
    quantization_config,
    swiglu_act,
    text_config,
)
from megamoe.core.checkpoint.reader import CONFIG_FILE, read_config
from megamoe.core.errors import CheckpointError

MODEL_NAME = "Qwen4Exp"
MODEL_TYPE = "qwen4_exp"  # composite (vision-language) config, the hub release
TEXT_MODEL_TYPE = "qwen4_exp_text"  # text-only save (Qwen4ExpForCausalLM)
QWEN3_NEXT_MODEL_TYPE = "qwen3_next"  # the sibling family with the same MoE block
MODEL_TYPES = (MODEL_TYPE, TEXT_MODEL_TYPE, QWEN3_NEXT_MODEL_TYPE)
ARCHITECTURE = "Qwen4ExpForConditionalGeneration"
ARCHITECTURES = (ARCHITECTURE, "Qwen4ExpForCausalLM", "Qwen3NextForCausalLM")
# MTP drafter layer count: Qwen3.5/Qwen4Exp releases name it mtp_num_hidden_layers, other
# loaders read num_nextn_predict_layers; transformers keeps either as a plain attribute.
MTP_COUNT_KEYS = ("mtp_num_hidden_layers", "num_nextn_predict_layers")
MTP_BLOCK_PREFIX = "mtp.layers.{}.mlp"  # the drafter sits beside the model, at mtp.*
# transformers' class defaults of the keys read here (Qwen4ExpTextConfig,
# Qwen3NextConfig), taken when config.json leaves a key out.
DEFAULTS: dict[str, dict[str, int]] = {
    MODEL_TYPE: {
        "hidden_size": 2048,
        "num_hidden_layers": 40,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
    },
    QWEN3_NEXT_MODEL_TYPE: {
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
    },
}


def model_family(config: Mapping[str, Any]) -> str:
    """``qwen3_next`` for Qwen3-Next configs, else ``qwen4_exp`` (composite or text-only)."""
    types = {config.get("model_type"), text_config(config).get("model_type")}
    archs = config.get("architectures") or ()
    if QWEN3_NEXT_MODEL_TYPE in types or "Qwen3NextForCausalLM" in archs:
        return QWEN3_NEXT_MODEL_TYPE
    return MODEL_TYPE


@dataclass(frozen=True)
class Qwen4ExpConfig:
    """The keys of a Qwen4Exp or Qwen3-Next ``config.json`` that their MoE blocks use.

    Composite configs (``qwen4_exp``: the text model's keys under ``text_config``) and
    text-only ones (``qwen4_exp_text``, ``qwen3_next``) are read alike; keys left out take
    transformers' defaults.

    Attributes:
        model_type: ``qwen4_exp`` (Qwen4Exp, composite or text-only) or ``qwen3_next``.
        num_experts: routed experts per MoE layer E (``num_routed_experts``).
        shared_expert_intermediate_size: shared expert width.
        norm_topk_prob: renormalize the top-k routing weights to sum to one.
        hidden_act: the experts' activation (``silu``: SwiGLU).
        decoder_sparse_step: Qwen3-Next: every ``decoder_sparse_step``-th layer is an MoE
            layer (Qwen4Exp has an MoE block in every layer and ignores the key).
        mlp_only_layers: Qwen3-Next: layers that are dense MLPs regardless of the step.
        num_nextn_predict_layers: MTP drafter layers (``mtp_num_hidden_layers`` or
            ``num_nextn_predict_layers``; 0 when neither is set).
        defaulted: keys ``config.json`` leaves out, with the transformers default taken.
        mtp_count_key: the key the MTP layer count is read from.

    Note:
        The other fields are the ``megamoe.core.checkpoint.hf_config.MoEConfig`` ones
        (``quantization_config`` is None when unquantized; ``swiglu_limit`` is always None:
        Qwen experts do not clamp).
    """

    hidden_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    num_hidden_layers: int
    model_type: str = MODEL_TYPE
    norm_topk_prob: bool = True
    hidden_act: str = SWIGLU_ACT
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    num_nextn_predict_layers: int = 0
    quantization_config: Mapping[str, Any] | None = field(default=None, compare=False)
    defaulted: Mapping[str, Any] = field(default_factory=dict, compare=False)
    mtp_count_key: str = MTP_COUNT_KEYS[0]

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> Qwen4ExpConfig:
        """Read and validate the keys from a ``config.json`` mapping (``MoEConfig.from_dict``).

        Raises:
            ValueError: an invalid key; the message names the key, the value and the rule.
            NotImplementedError: ``hidden_act`` other than ``silu``.
        """
        family = model_family(config)
        text = text_config(config)
        defaults = DEFAULTS[family]
        sizes = {
            key: int_key(text, key, model=MODEL_NAME, default=default)
            for key, default in defaults.items()
        }
        defaulted: dict[str, Any] = {k: v for k, v in defaults.items() if text.get(k) is None}
        if sizes["num_experts_per_tok"] > sizes["num_experts"]:
            top_k = key_text("num_experts_per_tok", sizes["num_experts_per_tok"], defaulted)
            experts = key_text("num_experts", sizes["num_experts"], defaulted)
            raise ValueError(
                f"config.json: {top_k} exceeds {experts}; a token cannot pick more experts than "
                "exist"
            )
        # Qwen3-Next's layer rule; Qwen4Exp ignores these keys, as transformers does.
        qwen3_next = family == QWEN3_NEXT_MODEL_TYPE
        step = (
            int_key(text, "decoder_sparse_step", model=MODEL_NAME, default=1) if qwen3_next else 1
        )
        mlp_only = _layer_list(text, sizes["num_hidden_layers"], defaulted) if qwen3_next else ()
        mtp_key = next((k for k in MTP_COUNT_KEYS if text.get(k) is not None), MTP_COUNT_KEYS[0])
        if text.get(mtp_key) is None:
            defaulted[mtp_key] = 0
        return cls(
            hidden_size=sizes["hidden_size"],
            num_experts=sizes["num_experts"],
            num_experts_per_tok=sizes["num_experts_per_tok"],
            moe_intermediate_size=sizes["moe_intermediate_size"],
            shared_expert_intermediate_size=sizes["shared_expert_intermediate_size"],
            num_hidden_layers=sizes["num_hidden_layers"],
            decoder_sparse_step=step,
            mlp_only_layers=mlp_only,
            model_type=family,
            norm_topk_prob=bool_key(text, "norm_topk_prob", default=True),
            hidden_act=swiglu_act(text),
            num_nextn_predict_layers=int_key(text, mtp_key, model=MODEL_NAME, default=0, minimum=0),
            quantization_config=quantization_config(config),
            defaulted=defaulted,
            mtp_count_key=mtp_key,
        )

    @classmethod
    def from_json(cls, path: str | Path) -> Qwen4ExpConfig:
        """Read a checkpoint directory's ``config.json`` (the directory, or that file).

        Read as every megamoe command reads it (``checkpoint.reader.read_config``: bounded
        size, no duplicate keys, a symlink only into the checkpoint).

        Raises:
            CheckpointError: no such directory or file, a file not named ``config.json``,
                invalid JSON (a ``ValueError``).
            ValueError: invalid keys (see ``from_dict``).
        """
        path = Path(path)
        if not path.is_dir() and path.name != CONFIG_FILE:
            raise CheckpointError(
                f"{path}: Qwen4ExpConfig.from_json reads a checkpoint directory or its "
                f"{CONFIG_FILE}; pass the directory"
            )
        return cls.from_dict(read_config(path if path.is_dir() else path.parent))

    @property
    def swiglu_limit(self) -> float | None:
        """Qwen experts do not clamp SwiGLU: always None."""
        return None

    @property
    def num_routed_experts(self) -> int:
        """Routed experts per MoE layer (``num_experts``)."""
        return self.num_experts

    def is_moe_layer(self, index: int) -> bool:
        """Whether main-model layer ``index`` is an MoE layer.

        Qwen4Exp: every decoder layer. Qwen3-Next: every ``decoder_sparse_step``-th layer
        not in ``mlp_only_layers``.
        """
        return index not in self.mlp_only_layers and (index + 1) % self.decoder_sparse_step == 0

    def dense_reason(self, index: int) -> tuple[str, str]:
        """The key that makes Qwen3-Next layer ``index`` dense, and the fix.

        Qwen4Exp has no dense layer, nor do Qwen3-Next's defaults (step 1, no
        ``mlp_only_layers``): only a key set in ``config.json`` makes one.
        """
        if index in self.mlp_only_layers:
            return (
                f"mlp_only_layers={list(self.mlp_only_layers)!r}, which lists it",
                f"remove {index} from mlp_only_layers in config.json",
            )
        return (
            f"decoder_sparse_step={self.decoder_sparse_step} (only every layer whose number "
            f"from 1 is a multiple of {self.decoder_sparse_step} is sparse)",
            f"set decoder_sparse_step to 1 in config.json (or one that makes layer {index} sparse)",
        )


def _layer_list(
    config: Mapping[str, Any], num_layers: int, defaulted: Mapping[str, Any]
) -> tuple[int, ...]:
    """``mlp_only_layers`` as sorted layer indices in ``[0, num_layers)``."""
    mlp_only = config.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list | tuple) or not all(
        is_int(i) and 0 <= i < num_layers for i in mlp_only
    ):
        raise ValueError(
            f"config.json: mlp_only_layers={mlp_only!r} must list layer indices in [0, "
            f"num_hidden_layers) ({key_text('num_hidden_layers', num_layers, defaulted)})"
        )
    return tuple(sorted(set(mlp_only)))
