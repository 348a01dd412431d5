"""Optional GPU kernels (Triton) that give the same bits as the torch paths in ``megamoe.core``.

They stand above ``megamoe.core.modules`` (and beside ``megamoe.core.backends``): nothing
below imports them at import time. Lower layers name the kernel they may use and import it
on first CUDA use, falling back to torch when Triton is missing, so core works without
Triton (CPU CI has none): ``numerics.quant.requantize`` takes ``requant_triton``,
``modules.shared_expert`` takes ``swiglu_triton``. ``router_triton`` is the adapters'
routers in one launch (writing ``numerics.dispatch.DispatchBuffer`` where the Hopper kernel
reads it), taken where ``TRITON_AVAILABLE`` and the tensors are on CUDA; ``launch``
relaunches a compiled Triton kernel without the JIT's per-call work.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from megamoe.core.kernels.router_triton import TritonRouter

# CUDA installs of torch ship Triton; CPU-only ones do not (then the torch paths run).
TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None


def one_launch_router(
    score: str, max_num_tokens: int, device: torch.device | str | None, **settings: Any
) -> tuple[TritonRouter | None, torch.Tensor | None]:
    """A router's one-launch kernel and its tickets, or ``(None, None)`` where it cannot run.

    Args:
        score: ``"softmax"`` or ``"sigmoid"`` (``router_triton.TritonRouter``'s scorings).
        max_num_tokens: the most tokens one forward carries.
        device: where the tickets live (the router's device).
        **settings: ``TritonRouter``'s fields after ``score`` (``num_experts``, ``top_k``,
            ``norm_topk_prob``; for sigmoid ``n_group``, ``topk_group``,
            ``routed_scaling_factor``).

    Returns:
        None twice without Triton or for a router the kernel does not cover.
    """
    if not TRITON_AVAILABLE:
        return None, None
    from megamoe.core.kernels import router_triton

    if not router_triton.covers(
        settings["num_experts"], settings["top_k"], settings.get("n_group", 1)
    ):
        return None, None
    scoring = {"softmax": router_triton.SCORE_SOFTMAX, "sigmoid": router_triton.SCORE_SIGMOID}
    return (
        router_triton.TritonRouter(scoring[score], **settings),
        router_triton.ticket_buffer(max_num_tokens, device),
    )


def router_scratch(
    kernel: TritonRouter | None,
    max_num_tokens: int,
    hidden_size: int,
    device: torch.device | str | None,
) -> torch.Tensor | None:
    """The float32 scratch a router's one launch writes its logits and partial sums to.

    ``TritonRouter.route``'s ``scratch``, sized by ``TritonRouter.scratch_floats`` for
    calls of up to ``max_num_tokens`` tokens of ``hidden_size`` (0.6 MB for the routers of
    GLM-5.3-Flash and Qwen4-Exp, 2.4 MB for E=64 at H=4096 from 1024 tokens, whose eager
    calls take one launch up to there); None without a kernel. One call at a time uses
    it, like the tickets.
    """
    if kernel is None:
        return None
    floats = kernel.scratch_floats(max_num_tokens, hidden_size)
    return torch.empty(floats, dtype=torch.float32, device=device)
