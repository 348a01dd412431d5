"""What transformers loaded into one experts module, named as megamoe's experts load it.

transformers keeps a layer's routed experts fused in memory whatever the checkpoint's
layout: ``gate_up_proj`` (E, 2I, H), gate rows first, and ``down_proj`` (E, H, I).

- A BF16 model holds them as bfloat16 (the model's own experts class).
- A block-FP8 model on a GPU holds them as float8_e4m3fn beside float32
  ``gate_up_proj_scale_inv`` (E, 2I/128, H/128), gate blocks first, and
  ``down_proj_scale_inv`` (E, H/128, I/128) (transformers' ``FP8Experts``).
- Without a GPU, transformers dequantizes block-FP8 checkpoints to BF16 while loading, so
  the experts arrive as BF16.
- A model loaded in float32 or float16 (``dtype=torch.float32``, usual on a CPU) holds
  them in that dtype: megamoe takes them over rounded to BF16 (``ROUNDED_TO_BF16``), with
  one warning.

``read_experts`` checks that the module computes what megamoe's experts compute
(``silu(gate) * up``, optionally clamped as GLM-5.3-Flash does, no bias, gate and up rows
concatenated and not transposed, all experts on this rank) and hands its tensors over
under the names ``MegaMoEExperts.load_weights`` takes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from transformers.activations import SiLUActivation
from transformers.integrations import moe as hf_moe
from transformers.integrations.finegrained_fp8 import FP8Experts
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextExperts

from megamoe.core.checkpoint.expert_names import FUSED_DOWN, FUSED_GATE_UP
from megamoe.core.numerics.formats import BLOCK_FP8_DEFAULT, WeightFormat

FP8_SCALE = "weight_scale_inv"  # block-FP8 scale name in checkpoints and in megamoe
HF_SCALE_SUFFIX = "_scale_inv"  # FP8Experts: gate_up_proj_scale_inv, down_proj_scale_inv
FLAGS_REFUSED = {  # use_experts_implementation flag -> the value megamoe needs, and why
    "has_bias": (False, "megamoe's experts have no bias terms"),
    "has_gate": (True, "megamoe's experts are gated (SwiGLU)"),
    "is_transposed": (False, "megamoe reads (E, 2I, H) / (E, H, I) expert weights"),
    "is_concatenated": (True, "megamoe reads gate rows, then up rows"),
    "has_post_expert_norm": (False, "megamoe's experts have no norm after the down projection"),
    "_is_expert_parallel": (False, "megamoe in transformers runs every expert on one rank"),
}
GUIDE = "run this model with experts_implementation='grouped_mm' instead"
# Unquantized dtypes whose experts megamoe takes over rounded to bfloat16 (with a warning).
ROUNDED_TO_BF16 = (torch.float32, torch.float16)


@dataclass(frozen=True)
class LoadedExperts:
    """One transformers experts module as megamoe sees it.

    Attributes:
        name: the module's name in the model, for messages.
        device: where its tensors live.
        num_experts: routed experts E.
        top_k: experts per token (the config's ``num_experts_per_tok``).
        hidden_size: H.
        intermediate_size: I of one expert.
        checkpoint_format: ``bf16`` or ``fp8_block``, as transformers holds them (``bf16``
            for float32 and float16 experts, rounded to it by ``named_tensors``).
        source_dtype: the dtype transformers holds the expert weights in.
        swiglu_limit: the clamp the module applies before its activation, None for none.
        params: transformers' expert tensors by parameter name (freed once megamoe holds
            the experts).
    """

    name: str
    device: torch.device
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    checkpoint_format: WeightFormat
    swiglu_limit: float | None
    params: Mapping[str, torch.Tensor]
    source_dtype: torch.dtype = torch.bfloat16

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors under the names ``MegaMoEExperts.load_weights`` takes (views, no copies).

        BF16: the fused ``gate_up_proj`` and ``down_proj`` as they are (float32 or float16
        ones rounded to bfloat16 here: copies, one at a time). Block-FP8: per expert
        ``{e}.{gate,up,down}_proj.{weight,weight_scale_inv}``, the fused tensors split at
        row I and scale row I/128 (I is a multiple of 128, checked by ``MegaMoEExperts``).
        """
        gate_up, down = self.params[FUSED_GATE_UP], self.params[FUSED_DOWN]
        if self.checkpoint_format is WeightFormat.BF16:
            yield FUSED_GATE_UP, gate_up.to(torch.bfloat16)
            yield FUSED_DOWN, down.to(torch.bfloat16)
            return
        gate_up_scale = self.params[FUSED_GATE_UP + HF_SCALE_SUFFIX]
        down_scale = self.params[FUSED_DOWN + HF_SCALE_SUFFIX]
        rows, scale_rows = self.intermediate_size, self.intermediate_size // BLOCK_FP8_DEFAULT[0]
        for e in range(self.num_experts):
            yield f"{e}.gate_proj.weight", gate_up[e, :rows]
            yield f"{e}.gate_proj.{FP8_SCALE}", gate_up_scale[e, :scale_rows]
            yield f"{e}.up_proj.weight", gate_up[e, rows:]
            yield f"{e}.up_proj.{FP8_SCALE}", gate_up_scale[e, scale_rows:]
            yield f"{e}.down_proj.weight", down[e]
            yield f"{e}.down_proj.{FP8_SCALE}", down_scale[e]


def is_experts_module(module: torch.nn.Module) -> bool:
    """Whether transformers dispatches ``module``'s forward through ``experts_implementation``.

    ``use_experts_implementation`` gives every such module its flags (``has_gate``, ...).
    """
    return all(hasattr(module, flag) for flag in FLAGS_REFUSED)


def read_experts(module: torch.nn.Module, name: str) -> LoadedExperts:
    """Check one transformers experts module and describe its tensors for megamoe.

    Args:
        module: an experts module (``is_experts_module``) whose weights are loaded.
        name: its name in the model, for messages.

    Returns:
        Its sizes, format, clamp and tensors.

    Raises:
        NotImplementedError: the module computes something megamoe's experts do not (a
            bias, another activation or gate, transposed or interleaved weights, expert
            parallelism, static FP8 activation scales, FP8 blocks other than 128x128).
        TypeError: weights that are neither bfloat16 (or float32 / float16, taken over
            rounded to bfloat16) nor float8_e4m3fn with float32 scales.
        ValueError: no ``num_experts_per_tok`` in the module's config.
    """
    cls = type(module).__name__
    for flag, (want, why) in FLAGS_REFUSED.items():
        if getattr(module, flag) != want:
            raise NotImplementedError(
                f"{name} ({cls}): {flag}={getattr(module, flag)!r}, but {why} ({flag}={want!r} "
                f"needed); {GUIDE}"
            )
    gate_up, down = module.get_parameter(FUSED_GATE_UP), module.get_parameter(FUSED_DOWN)
    fmt = _stored_format(module, name, gate_up)
    params = {FUSED_GATE_UP: gate_up, FUSED_DOWN: down}
    if fmt is WeightFormat.FP8_BLOCK:
        for proj in (FUSED_GATE_UP, FUSED_DOWN):
            params[proj + HF_SCALE_SUFFIX] = module.get_parameter(proj + HF_SCALE_SUFFIX)
    top_k = getattr(module.config, "num_experts_per_tok", None)
    if not isinstance(top_k, int):
        raise ValueError(
            f"{name} ({cls}): its config has num_experts_per_tok={top_k!r}; megamoe needs the "
            "number of experts per token (an int) to size its buffers: set it in the config"
        )
    num_experts, double_inter, hidden = gate_up.shape
    return LoadedExperts(
        name=name,
        device=gate_up.device,
        num_experts=num_experts,
        top_k=top_k,
        hidden_size=hidden,
        intermediate_size=double_inter // 2,
        checkpoint_format=fmt,
        swiglu_limit=_swiglu_limit(module, name),
        params=params,
        source_dtype=gate_up.dtype,
    )


def _stored_format(module: torch.nn.Module, name: str, gate_up: torch.Tensor) -> WeightFormat:
    """``bf16`` or ``fp8_block`` from the weights' dtype and, for FP8, its scale settings."""
    cls = type(module).__name__
    if gate_up.dtype in (torch.bfloat16, *ROUNDED_TO_BF16):
        return WeightFormat.BF16
    if gate_up.dtype != torch.float8_e4m3fn:
        raise TypeError(
            f"{name} ({cls}): {FUSED_GATE_UP} has dtype {gate_up.dtype}; megamoe runs "
            "bfloat16 or block-FP8 (float8_e4m3fn) experts and takes float32 or float16 ones "
            "rounded to bfloat16: load the model with dtype=torch.bfloat16 (or float32)"
        )
    block = tuple(getattr(module, "block_size", None) or ())
    if block != BLOCK_FP8_DEFAULT:
        raise NotImplementedError(
            f"{name} ({cls}): FP8 block_size={list(block)}, but megamoe's block-FP8 experts use "
            f"{list(BLOCK_FP8_DEFAULT)} blocks (weight_block_size in quantization_config); {GUIDE}"
        )
    if module.activation_scheme != "dynamic":
        raise NotImplementedError(
            f"{name} ({cls}): activation_scheme={module.activation_scheme!r}, but megamoe "
            "quantizes activations per token ('dynamic') and would ignore static activation "
            f"scales; {GUIDE}"
        )
    scale = module.get_parameter(FUSED_GATE_UP + HF_SCALE_SUFFIX)
    if scale.dtype != torch.float32:
        raise TypeError(
            f"{name} ({cls}): {FUSED_GATE_UP}{HF_SCALE_SUFFIX} has dtype {scale.dtype}; "
            "megamoe's block-FP8 experts take float32 scales (scale_fmt='float'); " + GUIDE
        )
    return WeightFormat.FP8_BLOCK


def _swiglu_limit(module: torch.nn.Module, name: str) -> float | None:
    """The clamp ``module`` applies before ``silu(gate) * up``; refuses any other gate.

    Three gates are known: transformers' default (``act_fn(gate) * up``, with SiLU),
    GLM-5.3-Flash's (clamped by ``swiglu_limit``, then ``F.silu``), and ``FP8Experts``'
    (clamped by ``limit`` when the config has a ``swiglu_limit``; no softcap, no alpha).
    """
    cls = type(module)
    silu = isinstance(getattr(module, "act_fn", None), torch.nn.SiLU | SiLUActivation)
    # The decorator installs transformers' default gate where the class defines none.
    if getattr(cls, "_apply_gate", None) is hf_moe._default_apply_gate and silu:
        return None
    if isinstance(module, Glm5NextTextExperts):
        return float(module.swiglu_limit)
    if isinstance(module, FP8Experts) and silu:
        for option in ("swiglu_alpha", "gate_softcap", "up_softcap"):
            if getattr(module, option) is not None:
                raise NotImplementedError(
                    f"{name} ({cls.__name__}): {option}={getattr(module, option)!r}; megamoe runs "
                    f"silu(gate) * up with an optional clamp only; {GUIDE}"
                )
        return None if module.limit is None else float(module.limit)
    raise NotImplementedError(
        f"{name} ({cls.__name__}): its gate ({cls.__name__}._apply_gate with act_fn="
        f"{type(getattr(module, 'act_fn', None)).__name__}) is not one megamoe knows to equal "
        "its own (silu(gate) * up, optionally clamped: gate <= L, -L <= up <= L); " + GUIDE
    )
