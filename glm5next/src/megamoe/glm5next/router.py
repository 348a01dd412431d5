"""The GLM-5.3-Flash router: sigmoid scores and group-limited top-k (SPEC §4.2).

Ties are broken deterministically, toward the lower index: among groups whose scores
are equal the lower group id is kept first, and among experts whose biased scores are
equal the lower expert id is chosen first. The chosen experts come in order of
decreasing biased score (ties: lower id first).

Two paths give the same ids and weights from the same logits (weights within float32
rounding of the final renormalizing sum): the torch expression of :func:`grouped_topk`,
the reference that runs on the CPU and wherever Triton is missing, and the Triton
selection on CUDA (``router_triton``), which :func:`route_logits` takes when it can.
``Glm5NextRouter`` on CUDA computes the logits in the same launch
(``megamoe.core.kernels.router_triton``).
"""

from __future__ import annotations

from typing import TypedDict, Unpack

import torch

from megamoe.core.kernels import TRITON_AVAILABLE, one_launch_router, router_scratch
from megamoe.core.numerics.dispatch import DispatchBuffer
from megamoe.core.numerics.router_logits import PLANES, router_logits, weight_planes
from megamoe.glm5next.config import ROUTER_TOP2, Glm5NextConfig, check_group_settings

NORM_EPS = 1e-20  # added to the renormalization's denominator, as the model does
BF16 = torch.bfloat16  # the activations the one-launch kernel takes; others run the torch path
DEFAULT_MAX_TOKENS = 8192  # tokens per forward a router serves unless told (its kernel tickets)


class GroupedRouting(TypedDict):
    """The settings of :func:`grouped_topk` beyond its tensors (:func:`routing_of` a model's).

    Attributes:
        top_k: experts per token.
        n_group: router groups (E must be a multiple).
        topk_group: groups kept per token.
        norm_topk_prob: renormalize the chosen weights.
        routed_scaling_factor: weight multiplier.
    """

    top_k: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float


def routing_of(config: Glm5NextConfig) -> GroupedRouting:
    """The model's routing settings, as :func:`grouped_topk` and :func:`route_logits` take them."""
    return GroupedRouting(
        top_k=config.num_experts_per_tok,
        n_group=config.n_group,
        topk_group=config.topk_group,
        norm_topk_prob=config.norm_topk_prob,
        routed_scaling_factor=config.routed_scaling_factor,
    )


def _top_indices(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest entries of each row, ties toward the lower index."""
    # A stable descending sort keeps equal values in index order; torch.topk does not
    # promise any order among ties.
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]


def grouped_topk(
    scores: torch.Tensor,
    correction_bias: torch.Tensor,
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose each token's experts among its best groups, and their weights.

    Selection uses the biased scores ``scores + correction_bias``: each of ``n_group``
    equal groups scores the sum of its best two biased scores, the ``topk_group`` best
    groups are kept, and the ``top_k`` best biased scores among their experts are chosen.
    The weights are the unbiased ``scores`` of the chosen experts, divided by their sum
    (plus ``NORM_EPS``) when ``norm_topk_prob``, times ``routed_scaling_factor`` (with or
    without the renormalization).

    Args:
        scores: (tokens, E) sigmoid scores; the computation keeps their dtype (float32 in
            the block, float64 in references).
        correction_bias: (E,) selection bias (``e_score_correction_bias``).
        top_k: experts per token.
        n_group: router groups (E must be a multiple).
        topk_group: groups kept per token.
        norm_topk_prob: renormalize the chosen weights.
        routed_scaling_factor: weight multiplier.

    Returns:
        ``(topk_weights, topk_ids int64)``, each (tokens, top_k); the weights in the dtype
        of ``scores``.

    Raises:
        ValueError: shapes or group settings the router does not allow
            (:func:`check_group_settings`).
    """
    tokens, num_experts = scores.shape
    check_group_settings(num_experts, correction_bias, top_k, n_group, topk_group)
    biased = scores + correction_bias.to(scores.dtype)
    grouped = biased.view(tokens, n_group, num_experts // n_group)
    group_scores = grouped.topk(ROUTER_TOP2, dim=-1).values.sum(dim=-1)
    kept_groups = _top_indices(group_scores, topk_group)
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
    allowed = biased.masked_fill(~keep.repeat_interleave(num_experts // n_group, dim=1), -torch.inf)
    topk_ids = _top_indices(allowed, top_k)
    topk_weights = scores.gather(1, topk_ids)
    if norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + NORM_EPS)
    return topk_weights * routed_scaling_factor, topk_ids


def route_logits(
    logits: torch.Tensor,
    correction_bias: torch.Tensor,
    *,
    use_triton: bool | None = None,
    **routing: Unpack[GroupedRouting],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid scores of float32 ``logits``, then :func:`grouped_topk`, on either path.

    Args:
        logits: (tokens, E) float32 router logits.
        correction_bias: (E,) float32 selection bias, on the logits' device.
        use_triton: None takes the Triton kernel for CUDA logits when Triton imports and
            the kernel covers the shape (``router_triton.triton_covers``), the torch path
            otherwise; True demands the kernel; False runs the torch path.
        **routing: the :class:`GroupedRouting` settings (``routing_of(config)``).

    Returns:
        ``(topk_weights float32, topk_ids int32)``, each (tokens, top_k), in decreasing
        biased score (ties: lower id first).

    Raises:
        ValueError: group settings the router does not allow, or ``use_triton=True``
            where the kernel cannot run.
    """
    if use_triton is not False and logits.is_cuda and TRITON_AVAILABLE:
        from megamoe.glm5next.router_triton import grouped_topk_triton, triton_covers

        if use_triton or triton_covers(logits.shape[-1], routing["top_k"], routing["n_group"]):
            return grouped_topk_triton(logits, correction_bias, **routing)
    elif use_triton:
        raise ValueError(
            f"router: use_triton=True needs CUDA logits and Triton; got logits on "
            f"{logits.device} with Triton {'present' if TRITON_AVAILABLE else 'missing'} "
            "(pip install triton, or use_triton=None to fall back to torch)"
        )
    topk_weights, topk_ids = grouped_topk(torch.sigmoid(logits), correction_bias, **routing)
    return topk_weights, topk_ids.to(torch.int32)


class Glm5NextRouter(torch.nn.Module):
    """The router of one MoE layer; its parameters are named as in the checkpoint.

    On CUDA with Triton, for covered shapes (``router_triton.triton_covers``) and bf16
    activations (what the block passes), ``forward`` is one kernel launch under
    ``kernel.matmul_tokens`` (64 for 256 experts or more, else 256; eager calls up to 1024
    tokens under 256 experts, ``kernel.eager_matmul_tokens``): the logits GEMM and the
    selection together; from there cuBLAS's logits, then the
    kernel's selection (``megamoe.core.kernels.router_triton``). Elsewhere it is the torch
    path, ``megamoe.core.numerics.router_logits`` then :func:`route_logits`.

    Where a forward can carry that many tokens (``max_num_tokens``), the router also keeps
    ``weight_planes``: the float32 weight as three bf16 parts
    (``megamoe.core.numerics.router_logits.weight_planes``, (3E, H) bf16, 1.5x the weight's bytes),
    so those calls take one bf16 tensor-core GEMM instead of widening the activations for a
    float32 one; smaller calls' kernel tiles read them too (the same bits as splitting the
    weight in registers, a few us faster from 64 tokens). The parts follow the weight: the
    block's ``finalize()`` rebuilds them (:meth:`refresh_planes`), and an eager call does
    when the weight was written in place since (its version counter: ``weight.copy_()``).
    A write through ``weight.data``, which bumps no version, needs ``refresh_planes()``.

    Attributes:
        weight: (E, H) float32 router weight (``gate.weight``; bf16 in checkpoints is
            widened exactly).
        e_score_correction_bias: (E,) float32 selection bias.
        routing: the model's group-limited top-k settings (``routing_of(config)``).
        kernel: the one-launch router, None where it cannot run (no Triton, or a shape
            the kernel does not cover).
        weight_planes: the weight's bf16 parts (3E, H), None where no call takes them.

    Args:
        config: the model's MoE settings.
        device: where the parameters live.
        max_num_tokens: the most tokens one forward carries (sizes the kernel's tickets).
    """

    def __init__(
        self,
        config: Glm5NextConfig,
        device: torch.device | str | None = None,
        max_num_tokens: int = DEFAULT_MAX_TOKENS,
    ) -> None:
        super().__init__()
        self.config = config
        self.routing = routing_of(config)
        num_experts, hidden = config.n_routed_experts, config.hidden_size
        self.weight = torch.nn.Parameter(
            torch.zeros((num_experts, hidden), dtype=torch.float32, device=device),
            requires_grad=False,
        )
        self.e_score_correction_bias = torch.nn.Parameter(
            torch.zeros(num_experts, dtype=torch.float32, device=device), requires_grad=False
        )
        check_group_settings(
            num_experts, self.e_score_correction_bias, self.routing["top_k"],
            self.routing["n_group"], self.routing["topk_group"],
        )  # fmt: skip
        self.kernel, tickets = one_launch_router(
            "sigmoid", max_num_tokens, device, num_experts=num_experts, **self.routing
        )
        self.tickets: torch.Tensor
        self.register_buffer("tickets", tickets, persistent=False)
        self.scratch: torch.Tensor | None
        self.register_buffer(
            "scratch", router_scratch(self.kernel, max_num_tokens, hidden, device), persistent=False
        )
        planes = None
        on_cuda = device is not None and torch.device(device).type == "cuda"
        if self.kernel is not None and on_cuda and max_num_tokens >= self.kernel.matmul_tokens:
            planes = torch.zeros((PLANES * num_experts, hidden), dtype=BF16, device=device)
        self.weight_planes: torch.Tensor | None
        self.register_buffer("weight_planes", planes, persistent=False)
        self._planes_version = self.weight._version  # zeros split into zeros

    def fills_dispatch(self, hidden_states: torch.Tensor) -> bool:
        """Whether a call on ``hidden_states`` takes the kernel, which can fill a dispatch."""
        return self.kernel is not None and hidden_states.is_cuda and hidden_states.dtype == BF16

    def refresh_planes(self) -> None:
        """Rebuild ``weight_planes`` from the weight in place (no-op without them)."""
        if self.weight_planes is not None:
            self.weight_planes.copy_(weight_planes(self.weight))
            self._planes_version = self.weight._version

    def forward(
        self, hidden_states: torch.Tensor, dispatch: DispatchBuffer | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing weights (float32) and expert ids (int32) of each token, (tokens, top_k).

        ``dispatch``: the experts' ``dispatch_buffer()`` for this call, which the kernel
        fills too (the block passes it where :meth:`fills_dispatch` holds); the routing
        returned is then that buffer's first rows (ids int64), valid until its next use.

        Raises:
            ValueError: a ``dispatch`` the kernel does not run for (see ``fills_dispatch``).
        """
        on_kernel = self.fills_dispatch(hidden_states)
        if dispatch is not None and not on_kernel:
            raise ValueError(
                f"router: a dispatch buffer, but the one-launch kernel does not run for "
                f"{hidden_states.dtype} activations on {hidden_states.device} (kernel "
                f"{'present' if self.kernel is not None else 'absent'}); route without one"
            )
        if on_kernel:
            planes = self.weight_planes
            if (
                planes is not None
                and not torch.compiler.is_compiling()
                and self.weight._version != self._planes_version
            ):
                self.refresh_planes()  # the weight was written since (traced: finalize did)
            weights, ids, _ = self.kernel.route(  # type: ignore[union-attr]  # fills_dispatch
                hidden_states, self.weight, self.tickets, self.e_score_correction_bias, planes,
                dispatch, self.scratch,
            )  # fmt: skip
            return weights, ids
        return route_logits(
            router_logits(hidden_states, self.weight), self.e_score_correction_bias, **self.routing
        )
