"""The torch reference backend: float32 MoE math on dequantized weights, any device.

The numerical oracle for the kernels (SPEC §3.5). Each local expert's weights are
dequantized to float32 inside the loop (one expert at a time: no float copy of all weights
is kept). Per expert: ``h = x @ w13.T``, ``a = silu(gate) * up`` (gate and up clamped first
when the experts have a ``swiglu_limit``, as the kernel's ``activation_clamp``),
``y = a @ w2.T``, weighted by the token's top-k weight, summed per token; fused shared
experts add with weight 1.

With ``emulate_kernel=True`` activations are rounded as the kernel rounds them: on the
SM100 formats (MXFP8, MXFP4) the input and the SwiGLU output go through FP8 E4M3 with
UE8M0 1x32 scales, and the SwiGLU output is multiplied by the top-k weight before that
rounding and the second GEMM; on Hopper FP8_BLOCK the input goes through FP8 with float32
per-token 1x128 scales (amax / 448) and the weighted SwiGLU output through FP8 with
power-of-two scales per 64 columns (what ``fp8_mega_moe`` does, measured on the H200: with
float 1x128 scales there the emulation was 0.036 away from the kernel, with these 0.013-0.019);
on BF16 the SwiGLU output (times the weight) is rounded to bf16. Every format's output of
each (token, slot) is rounded to bf16 before a token's slots are summed in float32, lowest
slot first: the kernels' combine (``sm90_fp8_mega_moe.cuh``, ``sm100_fp8_fp4_mega_moe.cuh``
and ``sm100_bf16_mega_moe.cuh`` in sgl-deep-gemm 0.1.4.post1 write bf16 rows into their
combine buffer and sum them so). Fused shared experts are added after, unrounded.

Multi-rank (a process group of size > 1): every rank's tokens and top-k are gathered
(padded to the largest token count), each rank computes its experts' contribution to every
(token, top-k slot), and a reduce-scatter returns the contributions to the owner. Each
(token, slot) is owned by exactly one expert, so the sum over ranks adds zeros only and the
result is bit-identical to one rank holding every expert. Memory: the contributions take
``ranks * max_tokens * top_k * H`` float32.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist

from megamoe.core.loading.tagging import check_tags, tag
from megamoe.core.modules.experts_backend import ExpertsBackend
from megamoe.core.numerics import quant
from megamoe.core.numerics.dispatch import DISPATCH_AMAX_FLOOR, DISPATCH_GROUP
from megamoe.core.numerics.formats import WeightFormat
from megamoe.core.numerics.swiglu import swiglu

if TYPE_CHECKING:
    from megamoe.core.modules.experts import MegaMoEExperts

TOKEN_GROUP = (1, DISPATCH_GROUP)  # Hopper kernel input: a float32 scale per token per 128
HOPPER_INTERMEDIATE_GROUP = 64  # Hopper kernel SwiGLU output: a power-of-two scale per 64

Rounding = Callable[[torch.Tensor], torch.Tensor]


class KernelRounding(NamedTuple):
    """How a kernel rounds its GEMM inputs: the tokens, and the weighted SwiGLU output."""

    input: Rounding
    intermediate: Rounding


def _round_mx(x: torch.Tensor) -> torch.Tensor:
    """FP8 E4M3 with UE8M0 1x32 scales, back to float32."""
    values, scale = quant.quantize_mx(x, WeightFormat.MXFP8, name="activations")
    return quant.dequantize(values, scale, WeightFormat.MXFP8)


def _round_token_fp8(x: torch.Tensor) -> torch.Tensor:
    """FP8 E4M3 with float32 1x128 per-token scales, back to float32.

    As ``mega_moe_pre_dispatch_sm90`` computes them: scale = max(amax, 1e-10) / 448 by a
    true float32 division (not ``amax * float32(1/448)``: bf16 inputs often sit on an E4M3
    tie, where the two round to different neighbours), values = E4M3(x * (1 / scale)).
    """
    groups = x.float().reshape(*x.shape[:-1], -1, TOKEN_GROUP[1])
    amax = groups.abs().amax(-1, keepdim=True).clamp(min=DISPATCH_AMAX_FLOOR)
    scale = amax / torch.full_like(amax, quant.E4M3_MAX)  # a tensor: CUDA divides exactly
    values = (groups * (1.0 / scale)).to(torch.float8_e4m3fn)
    return (values.float() * scale).reshape(x.shape)


def _round_pow2_group_fp8(x: torch.Tensor) -> torch.Tensor:
    """FP8 E4M3 with a power-of-two scale per 64 columns (>= amax / 448), back to float32."""
    groups = x.float().reshape(*x.shape[:-1], -1, HOPPER_INTERMEDIATE_GROUP)
    amax = groups.abs().amax(-1, keepdim=True).clamp(min=quant.AMAX_FLOOR)
    scale = quant.ceil_to_ue8m0(amax * (1.0 / quant.E4M3_MAX))
    values = (groups * (1.0 / scale)).to(torch.float8_e4m3fn)
    return (values.float() * scale).reshape(x.shape)


def _round_bf16(x: torch.Tensor) -> torch.Tensor:
    """bfloat16, back to float32."""
    return x.to(torch.bfloat16).float()


ACTIVATION_ROUNDING: dict[WeightFormat, KernelRounding] = {
    WeightFormat.BF16: KernelRounding(_round_bf16, _round_bf16),
    WeightFormat.FP8_BLOCK: KernelRounding(_round_token_fp8, _round_pow2_group_fp8),
    WeightFormat.MXFP8: KernelRounding(_round_mx, _round_mx),
    WeightFormat.MXFP4: KernelRounding(_round_mx, _round_mx),
}


def _expert_mlp(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weight: torch.Tensor,
    rounding: KernelRounding | None,
    swiglu_limit: float | None,
) -> torch.Tensor:
    """``weight * swiglu(x W1^T, x W3^T) W2^T`` in float32, rounding as the kernel does."""
    gate, up = (x @ w13.T).chunk(2, dim=-1)
    act = swiglu(gate, up, swiglu_limit)
    if rounding is None:
        return (act @ w2.T) * weight[:, None]
    return rounding.intermediate(act * weight[:, None]) @ w2.T


class ReferenceBackend(ExpertsBackend):
    """Torch reference path on any device (CPU included); see the module docstring."""

    name = "reference"

    @classmethod
    def unsupported_reason(cls, run_format: WeightFormat, device: torch.device) -> str | None:
        """The reference runs every format on every device: always None."""
        return None

    @classmethod
    def fuses_shared_experts(cls, run_format: WeightFormat, device: torch.device) -> bool:
        """Fused shared experts run with every format on every device: always True."""
        return True

    def prepare(self, experts: MegaMoEExperts, local_ids: Sequence[int]) -> None:
        """Nothing to lay out (weights are dequantized per forward); records the format tag."""
        tag(self, experts.kernel_tag)

    def _dense(self, experts: MegaMoEExperts, l1: str, l2: str, index: int) -> list[torch.Tensor]:
        """float32 (2I, H) and (H, I) weights of one kernel slot."""
        params, fmt = experts.kernel_params, experts.weight_format
        dense = []
        for stem in (l1, l2):
            scale = params.get(f"{stem}_weight_scale")
            weight = params[f"{stem}_weight"].data[index]
            dense.append(
                quant.dequantize(weight, None if scale is None else scale.data[index], fmt)
            )
        return dense

    def rounds_activations(self, experts: MegaMoEExperts) -> bool:
        """With ``emulate_kernel``, in a quantized format: it rounds as the kernel does."""
        return experts.emulate_kernel and experts.weight_format is not WeightFormat.BF16

    def _rounding(self, experts: MegaMoEExperts) -> KernelRounding | None:
        return ACTIVATION_ROUNDING[experts.weight_format] if experts.emulate_kernel else None

    def expert_contributions(
        self,
        experts: MegaMoEExperts,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        """Contribution of this module's routed experts to every (token, top-k slot).

        Args:
            experts: the module.
            x: (N, H) float32 input (already rounded when emulating the kernel).
            topk_weights: (N, top_k) float32.
            topk_ids: (N, top_k) physical expert ids, -1 = unused.

        Returns:
            (N, top_k, H) float32; zero where another rank's expert (or none) serves a slot.
        """
        out = x.new_zeros((x.shape[0], topk_ids.shape[1], x.shape[1]))
        rounding = self._rounding(experts)
        for slot in range(experts.num_local_experts):
            hits = (topk_ids == experts.experts_start_idx + slot).nonzero()
            if hits.numel() == 0:
                continue
            token, k = hits.unbind(1)
            w13, w2 = self._dense(experts, "w13", "w2", slot)
            out[token, k] = _expert_mlp(
                x[token], w13, w2, topk_weights[token, k], rounding, experts.swiglu_limit
            )
        return out

    def _shared(self, experts: MegaMoEExperts, x: torch.Tensor) -> torch.Tensor | None:
        """Sum of the fused shared experts (weight 1 for every token), None without any."""
        total = None
        ones = x.new_ones(x.shape[0])
        for s in range(experts.num_shared_experts):
            w13, w2 = self._dense(experts, "shared_l1", "shared_l2", s)
            y = _expert_mlp(x, w13, w2, ones, self._rounding(experts), experts.swiglu_limit)
            total = y if total is None else total + y
        return total

    def forward(
        self,
        experts: MegaMoEExperts,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        """(T, H) bf16 output for this rank's tokens; see the module docstring.

        Raises:
            ValueError: a top-k id outside ``[-1, num_experts)``.
            FormatMismatchError: the backend was prepared for another format.
        """
        check_tags(experts.kernel_tag, {"reference backend": self}, experts.layout.label)
        bad = (topk_ids < -1) | (topk_ids >= experts.num_experts)
        if bool(bad.any()):
            value = int(topk_ids[bad][0])
            raise ValueError(
                f"{experts.layout.label}: topk_ids holds {value}; physical expert ids must be "
                f"in [0, num_experts={experts.num_experts}) or -1 for an unused slot"
            )
        x = hidden_states.float()
        rounding = self._rounding(experts)
        if rounding is not None and x.numel():
            x = rounding.input(x)
        group = experts.process_group
        if group is None or dist.get_world_size(group) == 1:
            per_slot = self.expert_contributions(experts, x, topk_weights, topk_ids.long())
        else:
            per_slot = self._exchange(experts, group, x, topk_weights, topk_ids.long())
        if rounding is not None:  # the kernels' combine buffer holds a bf16 row per slot
            per_slot = per_slot.to(torch.bfloat16).float()
        out = per_slot[:, 0]
        for k in range(1, per_slot.shape[1]):  # a fixed order, the same on every EP size
            out = out + per_slot[:, k]
        shared = self._shared(experts, x)
        if shared is not None:
            out = out + shared
        return out.to(torch.bfloat16)

    def _exchange(
        self,
        experts: MegaMoEExperts,
        group: dist.ProcessGroup,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        """Gather every rank's tokens, run local experts, reduce-scatter back to owners."""
        size, tokens = dist.get_world_size(group), x.shape[0]
        counts = [torch.zeros(1, dtype=torch.int64, device=x.device) for _ in range(size)]
        dist.all_gather(counts, torch.tensor([tokens], device=x.device), group=group)
        most = int(max(int(c) for c in counts))
        if most == 0:  # every rank is idle: nothing to exchange
            return x.new_zeros((0, topk_ids.shape[1], x.shape[1]))
        gathered = []
        for local, fill in ((x, 0.0), (topk_weights, 0.0), (topk_ids, -1)):
            padded = local.new_full((most, *local.shape[1:]), fill)
            padded[:tokens] = local
            parts = [torch.empty_like(padded) for _ in range(size)]
            dist.all_gather(parts, padded, group=group)
            gathered.append(torch.cat(parts))
        per_slot = self.expert_contributions(experts, *gathered)
        mine = torch.empty_like(per_slot[:most])
        dist.reduce_scatter(mine, list(per_slot.view(size, most, *per_slot.shape[1:])), group=group)
        return mine[:tokens]
