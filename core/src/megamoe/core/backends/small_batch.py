"""Which path runs a Hopper layer's routed experts, call by call: small-batch or MegaMoE.

On one Hopper rank the DeepGEMM backend has two paths over the same resident kernel tensors:
the MegaMoE kernel, and the small-batch kernels (``megamoe.core.kernels.experts_small_batch``:
three to five Triton launches that read each active expert's weights once). MegaMoE pays a
fixed cost per call that grows with the layer's experts; the small-batch path pays little
per call, a little per program of its kernels, and past decode sizes computes less
efficiently. Both are modelled as ``max(fixed, per_slot * E * top_k) + per_program *
programs + per_pair * local pairs + active bytes / bandwidth + FLOPs / throughput``
(:class:`PathCost`, fitted per card to both real layers' graphed timings by
``benchmarks/fit_path_cost.py``: ``CARD_COSTS``, an H200's and an H100's, ``docs/gpu.md``),
with the active experts expected under uniform routing. A layer takes the small-batch path
for every call of up to :func:`crossover_tokens` tokens on its card, the last token count at
which it is predicted no slower; so a fixed token count always takes one path and a CUDA
graph captures one. (Past 512
tokens the small-batch kernels read an expert's weights again per tile of 32 or 64 of its
tokens, yet Qwen4-Exp at 8192 tokens, 160 per active expert, ran in 0.40 of MegaMoE's time on
an H200.)

``experts_path`` (an option of ``MegaMoEExperts`` and of both blocks) forces either path:
``"small_batch"`` for every call the layer's ``max_num_tokens`` allows, ``"megamoe"`` for
none; ``"auto"`` follows the rule. ``small_batch_max_tokens`` caps the calls the path takes
(and so its scratch, sized for that many tokens) below either. The small-batch path runs
one rank (on several, MegaMoE's dispatch is the communication), block-FP8 on Hopper,
without fused shared experts.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megamoe.core.backends.deepgemm_layout import KIND_SM90
from megamoe.core.backends.reference import HOPPER_INTERMEDIATE_GROUP
from megamoe.core.modules.experts_backend import PATH_MEGAMOE, PATH_SMALL_BATCH
from megamoe.core.numerics.dispatch import DISPATCH_GROUP

if TYPE_CHECKING:
    from megamoe.core.modules.experts import MegaMoEExperts

KERNEL_MODULE = "megamoe.core.kernels.experts_small_batch"  # imported on first use (Triton)


@dataclass(frozen=True)
class PathCost:
    """A path's predicted time per call, in microseconds, from the layer's work.

    Attributes:
        fixed_us: per call, the least whatever the layer.
        per_slot_us: per (local expert, top-k slot) pair of the layer, per call, where that
            is more (MegaMoE's fixed cost grows with both: 169 us for Qwen4-Exp's 512 x 10,
            112 for GLM-5.3-Flash's 288 x 8 at one token).
        per_program_us: per program of the small-batch kernels (l1 and l2 each run one per
            active expert and 64 of its columns, each paying its own start and pipeline
            fill: Qwen4-Exp's experts hold 3.3 times as many per byte as GLM-5.3-Flash's).
        bandwidth: bytes per second at which the active experts' weights stream.
        flops: FLOP/s of the GEMMs beyond what streaming the weights hides.
        per_pair_us: per (token, slot) pair routed to a local expert: what grows with the
            tokens beyond the GEMMs' FLOPs (moving rows in and out; the small-batch path's
            weights read again per tile of pairs).
    """

    fixed_us: float
    per_slot_us: float
    per_program_us: float
    bandwidth: float
    flops: float
    per_pair_us: float = 0.0


@dataclass(frozen=True)
class CardCosts:
    """One card's models of the two paths (fitted to ``bench_decode.py`` runs there)."""

    small: PathCost
    megamoe: PathCost


# Each card's models, fitted with ``benchmarks/fit_path_cost.py`` to bench_decode.py runs
# there (both real layers, 1-8192 tokens, graphed medians; docs/gpu.md has each run and
# the earlier fits). The H200's, to the fifteenth session's run (2026-12-05, the token-rows
# tiles, ``docs/img/decode_h200.json``): the small-batch model within 17% of every row,
# MegaMoE's within 15% but at Qwen4-Exp's 2048 tokens (34% over). The H100 SXM's, to that
# session's run there (``docs/img/decode_h100.json``) and the sixteenth session's run of a
# layer of DeepSeek-V3's shape, 256 experts of 7168 x 2048, top-8
# (``docs/img/decode_h100_deepseekv3.json``): the small-batch model within 13% of every row,
# MegaMoE's within 21% but at Qwen4-Exp's 2048 tokens (37% over). On both cards the
# small-batch path beat MegaMoE at every count of both real layers (GLM-5.3-Flash on the
# H200 3264.2 against 3585.8 us at 4096 tokens, 5937.2 against 6283.1 at 8192; the H100
# 3745.6 against 3830.3, 6442.7 against 6588.9), and both cards' models put both layers'
# crossovers past the 65536 tokens ``crossover_tokens`` is asked for. On the H100 the
# DeepSeek-V3-shaped layer took the small-batch path faster at 1-256 tokens and from 4096
# (0.89 of MegaMoE's time there), 2.4% and 0.9% slower at 1024 and 2048 (at 1024 on the
# 32-token tiles; on the 64-token ones ``tiles_for`` now takes there, 7% faster): these
# models keep it on the small-batch path at every count, where the previous ones (fitted to
# the real layers alone) handed it to MegaMoE from 55 tokens, 4-12% slower at 64, 256,
# 4096 and 8192. The earlier H200 models (the tenth session's, fitted before the
# token-rows tiles) handed GLM-5.3-Flash to MegaMoE from 2343 tokens. Where the two paths
# are within the models' error of each other the rule may pick the slower one; for layer
# shapes unlike those measured the models extrapolate (both paths stream the weights at
# about the same rate, so small fitted differences decide for very large layers).
H200_COSTS = CardCosts(
    small=PathCost(
        fixed_us=13.7, per_slot_us=0.0, per_program_us=0.00154, bandwidth=4.97e12,
        flops=9.22e14, per_pair_us=0.00264,
    ),
    megamoe=PathCost(
        fixed_us=60.0, per_slot_us=0.0314, per_program_us=0.0, bandwidth=4.34e12,
        flops=1.15e15, per_pair_us=0.0211,
    ),
)  # fmt: skip
H100_COSTS = CardCosts(
    small=PathCost(
        fixed_us=13.3, per_slot_us=0.0, per_program_us=0.000675, bandwidth=3.18e12,
        flops=9.03e14, per_pair_us=0.00186,
    ),
    megamoe=PathCost(
        fixed_us=50.8, per_slot_us=0.0289, per_program_us=0.0, bandwidth=3.20e12,
        flops=1.06e15, per_pair_us=0.0222,
    ),
)  # fmt: skip
# Each card's models, by a piece of its name (``torch.cuda.get_device_name``: "NVIDIA H200",
# "NVIDIA H100 80GB HBM3"); the first that matches is the card's. A card none matches (an
# H800, an H20) takes ``DEFAULT_CARD``'s.
CARD_COSTS = {"H200": H200_COSTS, "H100": H100_COSTS}
DEFAULT_CARD = "H200"
# Columns of an expert's intermediate (l1) and hidden (l2) per small-batch program.
COLUMNS_PER_PROGRAM = 64


@dataclass(frozen=True)
class LayerWork:
    """What one call of a layer reads and computes, by token count.

    Attributes:
        num_experts: physical experts over all ranks (routing spreads over these).
        num_local_experts: experts on this rank.
        top_k: slots per token.
        hidden: H.
        intermediate: I.
    """

    num_experts: int
    num_local_experts: int
    top_k: int
    hidden: int
    intermediate: int

    @property
    def expert_bytes(self) -> int:
        """One block-FP8 expert's weight bytes (``w13`` and ``w2``; scales are 1/16384 more)."""
        return 3 * self.hidden * self.intermediate

    @property
    def scratch_bytes_per_token(self) -> int:
        """The small-batch path's scratch per token of its cap, activations alone.

        A token in FP8 with its float32 scales (the dispatch rule's groups), and per slot its
        intermediate in FP8 with a float32 scale per group of the Hopper kernel's rounding
        and its bf16 output row (``SmallBatchExperts``); the index tables add under 1% from
        256 tokens on.
        """
        token = self.hidden + 4 * self.hidden // DISPATCH_GROUP
        slot = self.intermediate + 4 * self.intermediate // HOPPER_INTERMEDIATE_GROUP
        slot += 2 * self.hidden
        return token + self.top_k * slot

    def active_experts(self, tokens: int) -> float:
        """Local experts that ``tokens`` tokens reach, expected under uniform routing."""
        miss = (1.0 - min(self.top_k, self.num_experts) / self.num_experts) ** tokens
        return self.num_local_experts * (1.0 - miss)

    def predicted_us(self, cost: PathCost, tokens: int) -> float:
        """``cost``'s microseconds for a call of ``tokens`` tokens."""
        active = self.active_experts(tokens)
        weights = active * self.expert_bytes / cost.bandwidth
        local_pairs = tokens * self.top_k * self.num_local_experts / self.num_experts
        flops = 2.0 * local_pairs * self.expert_bytes / cost.flops
        programs = active * (self.hidden + self.intermediate) / COLUMNS_PER_PROGRAM
        overhead = max(cost.fixed_us, cost.per_slot_us * self.num_local_experts * self.top_k)
        return (
            overhead
            + cost.per_program_us * programs
            + cost.per_pair_us * local_pairs
            + 1e6 * (weights + flops)
        )


def crossover_between(work: LayerWork, small: PathCost, megamoe: PathCost, max_tokens: int) -> int:
    """The most tokens per call for which ``small`` predicts no more time than ``megamoe``.

    The first token count at which ``megamoe`` is predicted faster ends the range (0:
    never), capped at ``max_tokens``.
    """
    for tokens in range(1, max_tokens + 1):
        if work.predicted_us(small, tokens) > work.predicted_us(megamoe, tokens):
            return tokens - 1
    return max_tokens


def card_costs(card: str) -> tuple[str, CardCosts]:
    """The models the card named ``card`` takes (``CARD_COSTS``), and their card's key."""
    key = next((key for key in CARD_COSTS if key in card), DEFAULT_CARD)
    return key, CARD_COSTS[key]


@functools.lru_cache(maxsize=256)
def crossover_tokens(work: LayerWork, max_tokens: int, card: str) -> int:
    """The most tokens per call for which the small-batch path is predicted no slower.

    Every call of up to that many tokens takes it (:func:`crossover_between` of the models
    measured on ``card``, a CUDA device's name: :func:`card_costs`). Remembered per layer
    shape and card: the layers of a model share a few.
    """
    costs = card_costs(card)[1]
    return crossover_between(work, costs.small, costs.megamoe, max_tokens)


def device_card(device: torch.device) -> str:
    """The name of the CUDA card ``device`` is (what :func:`crossover_tokens` takes)."""
    return torch.cuda.get_device_name(device)


def takes_small_batch(tokens: int, limit: int) -> bool:
    """Whether a call of ``tokens`` takes the small-batch path under ``limit``.

    ``limit``: the layer's ``small_batch_tokens``; 0 means it has no small-batch path, not
    even for an empty call (MegaMoE runs that one).
    """
    return limit > 0 and tokens <= limit


def layer_work(experts: MegaMoEExperts) -> LayerWork:
    """The experts module's :class:`LayerWork`."""
    return LayerWork(
        experts.num_experts, experts.num_local_experts, experts.top_k, experts.hidden_size,
        experts.intermediate_size,
    )  # fmt: skip


def layout_reason(kind: str, where: str, ranks: int, num_shared_experts: int) -> str | None:
    """Why a layer of this kernel kind, place and expert parallelism has no small-batch path.

    What ``megamoe inspect`` can tell from a checkpoint and a target; None where it has one.
    Every reason that holds, joined, so that one change is never followed by another refusal.

    Args:
        kind: the DeepGEMM kernel kind the layer runs (``deepgemm.KERNEL_KINDS``).
        where: the device or target the layer runs on (``cuda:0``, ``--arch sm100``...),
            for the message.
        ranks: expert-parallel ranks.
        num_shared_experts: shared experts fused into the routed experts' kernel.
    """
    reasons = []
    if kind != KIND_SM90:
        runs = "on the torch reference backend" if kind == "reference" else f"on kernel kind {kind}"
        reasons.append(
            f"it runs block-FP8 layers on Hopper (kernel kind {KIND_SM90}), where {where} runs "
            f"this layer {runs}"
        )
    if ranks > 1:
        reasons.append(
            f"it runs one rank, where this layer's expert-parallel group has {ranks} (there "
            "MegaMoE's dispatch is the communication)"
        )
    if num_shared_experts:
        reasons.append(
            f"it runs routed experts only, where this layer fuses {num_shared_experts} shared"
        )
    return "; ".join(reasons) or None


def unavailable_reason(experts: MegaMoEExperts, kind: str) -> str | None:
    """Why the small-batch path cannot run this layer, None where it can."""
    if experts.device.type != "cuda":
        return f"it runs on a CUDA device; this layer's experts are on {experts.device}"
    group = experts.process_group
    ranks = 1 if group is None else dist.get_world_size(group)
    reason = layout_reason(kind, str(experts.device), ranks, experts.num_shared_experts)
    if reason is None and importlib.util.find_spec("triton") is None:
        return "Triton is not installed (pip install triton, as CUDA builds of torch have it)"
    return reason


def small_batch_tokens(experts: MegaMoEExperts, kind: str) -> int:
    """The most tokens per call the layer runs on the small-batch path (0: none).

    ``experts.experts_path``: ``"auto"`` gives :func:`crossover_tokens` where the path can
    run, else 0; ``"small_batch"`` every call up to ``max_num_tokens``; ``"megamoe"`` 0.
    ``experts.small_batch_max_tokens``, where set, caps either.

    Raises:
        CapabilityError: ``"small_batch"`` where the path cannot run (from the experts
            module, which asks :func:`unavailable_reason` first).
    """
    path = experts.experts_path
    if path == PATH_MEGAMOE or unavailable_reason(experts, kind) is not None:
        return 0
    cap = experts.small_batch_max_tokens
    most = experts.max_num_tokens if cap is None else min(cap, experts.max_num_tokens)
    if path == PATH_SMALL_BATCH:
        return most
    return crossover_tokens(layer_work(experts), most, device_card(experts.device))


_SHARED: dict[tuple[Any, ...], Any] = {}


def shared_kernels(experts: MegaMoEExperts, max_tokens: int) -> Any:
    """The ``SmallBatchExperts`` of this layer's shape on its device, shared by such layers.

    Its scratch holds activations only; layers of one shape run one at a time, as they do
    on the MegaMoE kernel's symmetric buffer.
    """
    key = (
        experts.device, experts.num_local_experts, experts.experts_start_idx, experts.top_k,
        experts.hidden_size, experts.intermediate_size, experts.swiglu_limit, max_tokens,
    )  # fmt: skip
    found = _SHARED.get(key)
    if found is None:
        module = importlib.import_module(KERNEL_MODULE)
        with torch.cuda.device(experts.device):
            found = module.SmallBatchExperts(
                num_experts=experts.num_local_experts, first_expert=experts.experts_start_idx,
                top_k=experts.top_k, hidden=experts.hidden_size,
                intermediate=experts.intermediate_size, swiglu_limit=experts.swiglu_limit,
                max_tokens=max_tokens, device=experts.device,
            )  # fmt: skip
        _SHARED[key] = found
    return found
