"""The Qwen4Exp model configuration, read from a Hugging Face ``config.json``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megamoe.core.hf_config import SWIGLU_ACT, bool_key, int_key, is_int, object_key, swiglu_act

MODEL_NAME = "Qwen4Exp"
MODEL_TYPE = "qwen4_exp"
ARCHITECTURE = "Qwen4ExpForCausalLM"


@dataclass(frozen=True)
class Qwen4ExpConfig:
    """The keys of a Qwen4Exp (Qwen3-Next style) ``config.json`` that its MoE blocks use.

    Attributes:
        num_experts: routed experts per MoE layer E (``num_routed_experts``).
        shared_expert_intermediate_size: shared expert width.
        norm_topk_prob: renormalize the top-k routing weights to sum to one.
        hidden_act: the experts' activation (``silu``: SwiGLU).
        decoder_sparse_step: every ``decoder_sparse_step``-th layer is an MoE layer.
        mlp_only_layers: layers that are dense MLPs regardless of the step.

    Note:
        The other fields are the ``megamoe.core.hf_config.MoEConfig`` ones
        (``quantization_config`` is None when unquantized).
    """

    hidden_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    num_hidden_layers: int
    norm_topk_prob: bool = True
    hidden_act: str = SWIGLU_ACT
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    num_nextn_predict_layers: int = 0
    quantization_config: Mapping[str, Any] | None = field(default=None, compare=False)

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> Qwen4ExpConfig:
        """Read and validate the keys from a ``config.json`` mapping (``MoEConfig.from_dict``).

        Raises:
            ValueError: a missing or invalid key; the message names the key, the value and
                the rule.
            NotImplementedError: ``hidden_act`` other than ``silu``.
        """
        sizes = {
            key: int_key(config, key, model=MODEL_NAME)
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
                f"config.json: num_experts_per_tok={sizes['num_experts_per_tok']} exceeds "
                f"num_experts={sizes['num_experts']}; a token cannot pick more experts than exist"
            )
        mlp_only = config.get("mlp_only_layers") or []
        num_layers = sizes["num_hidden_layers"]
        if not isinstance(mlp_only, list | tuple) or not all(
            is_int(i) and 0 <= i < num_layers for i in mlp_only
        ):
            raise ValueError(
                f"config.json: mlp_only_layers={mlp_only!r} must list layer indices in "
                f"[0, num_hidden_layers={num_layers})"
            )
        return cls(
            **sizes,
            norm_topk_prob=bool_key(config, "norm_topk_prob", default=True),
            hidden_act=swiglu_act(config),
            decoder_sparse_step=int_key(config, "decoder_sparse_step", model=MODEL_NAME, default=1),
            mlp_only_layers=tuple(sorted(set(mlp_only))),
            num_nextn_predict_layers=int_key(
                config, "num_nextn_predict_layers", model=MODEL_NAME, default=0, minimum=0
            ),
            quantization_config=object_key(config, "quantization_config") or None,
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

    @property
    def num_routed_experts(self) -> int:
        """Routed experts per MoE layer (``num_experts``)."""
        return self.num_experts

    def is_moe_layer(self, index: int) -> bool:
        """Whether main-model layer ``index`` is a sparse MoE layer (Qwen3-Next rule)."""
        return index not in self.mlp_only_layers and (index + 1) % self.decoder_sparse_step == 0
