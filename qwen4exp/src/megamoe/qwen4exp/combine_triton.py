"""Qwen4Exp's combine in one Triton launch: ``bf16(routed + sigmoid(x . g) * shared)``.

The block's output is the routed experts' output plus the shared expert's, gated per token
by ``sigmoid(shared_expert_gate(x))``. As torch operations that is four kernels (the gate's
GEMV, the sigmoid, a mixed-dtype ``addcmul``, the bf16 cast), each a launch of host time in
eager mode; the mixed-dtype ``addcmul`` alone took 6.4 us of GPU time at one token on the
H200 (torch's unvectorized casting loop). :func:`gated_add` is one launch, one program per
token (``benchmarks/bench_combine.py``: 1.2-4.2x faster graphed, 3.0-3.6x less host time):

1. the gate's logit ``x . g`` over the hidden size: bf16 times bf16 is exact in float32,
   summed in float32 (the torch path's ``router_logits`` rule; only the order of the
   additions differs);
2. the gate, torch's CUDA float32 sigmoid ``1 / (1 + expf(-z))`` (correctly rounded
   division, the router kernel's);
3. ``routed + shared * gate`` in float32, rounded to bf16 once.

The launch skips Triton's JIT after a variant's first call (``kernels.launch.KernelLaunch``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from megamoe.core.kernels.launch import KernelLaunch, eager_key

__all__ = ["MAX_BLOCK_H", "gated_add"]

MAX_BLOCK_H = 4096  # hidden indices per step: H=4096 in one step, 16 warps of 8 each


@triton.jit
def _gated_add_kernel(
    routed_ptr: tl.tensor,
    shared_ptr: tl.tensor,
    x_ptr: tl.tensor,
    gate_weight_ptr: tl.tensor,
    out_ptr: tl.tensor,
    HIDDEN: tl.constexpr,
    BLOCK_H: tl.constexpr,
) -> None:
    """Token ``program_id(0)``'s output row (every tensor a contiguous row of HIDDEN)."""
    row = tl.program_id(0).to(tl.int64) * HIDDEN
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for h0 in tl.static_range(0, HIDDEN, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        ok = hs < HIDDEN
        x = tl.load(x_ptr + row + hs, mask=ok, other=0.0)
        g = tl.load(gate_weight_ptr + hs, mask=ok, other=0.0)
        acc += x.to(tl.float32) * g.to(tl.float32)  # exact products
    logit = tl.sum(acc, axis=0)
    gate = tl.math.div_rn(1.0, 1.0 + libdevice.exp(-logit))
    for h0 in tl.static_range(0, HIDDEN, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        ok = hs < HIDDEN
        routed = tl.load(routed_ptr + row + hs, mask=ok, other=0.0).to(tl.float32)
        shared = tl.load(shared_ptr + row + hs, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row + hs, (routed + shared * gate).to(tl.bfloat16), mask=ok)


_launch = KernelLaunch(_gated_add_kernel, runtime_args=5)


def gated_add(
    routed: torch.Tensor,
    shared: torch.Tensor,
    hidden_states: torch.Tensor,
    gate_weight: torch.Tensor,
) -> torch.Tensor:
    """``bf16(routed + sigmoid(hidden_states @ gate_weight^T) * shared)``, (T, H).

    Args:
        routed: the routed experts' output, (T, H) bf16 on CUDA.
        shared: the shared expert's output, (T, H) bf16.
        hidden_states: the block's input, (T, H) bf16.
        gate_weight: ``shared_expert_gate.weight``, (1, H) bf16.

    Raises:
        ValueError: a tensor that is not bf16 or not of its (T, H) / (1, H) shape.
    """
    tokens, hidden = hidden_states.shape
    if not (
        routed.dtype == shared.dtype == hidden_states.dtype == gate_weight.dtype == torch.bfloat16
        and routed.shape == shared.shape == hidden_states.shape
        and gate_weight.shape == (1, hidden)
    ):
        _refuse(routed, shared, hidden_states, gate_weight)
    inputs = (routed.contiguous(), shared.contiguous(), hidden_states.contiguous(),
              gate_weight.contiguous())  # fmt: skip
    out = torch.empty_like(inputs[0])
    if tokens == 0:
        return out
    block_h = min(MAX_BLOCK_H, triton.next_power_of_2(hidden))
    warps = max(4, min(16, block_h // 256))
    key = eager_key((hidden, block_h, warps), *inputs)  # every dtype is bf16
    _launch(key, (tokens, 1, 1), out.device.index, (*inputs, out), (hidden, block_h),
            warps)  # fmt: skip
    return out


def _refuse(
    routed: torch.Tensor,
    shared: torch.Tensor,
    hidden_states: torch.Tensor,
    gate_weight: torch.Tensor,
) -> None:
    """Raise for the first input of :func:`gated_add` of the wrong dtype or shape."""
    tokens, hidden = hidden_states.shape
    for name, tensor, shape in (
        ("routed", routed, (tokens, hidden)),
        ("shared", shared, (tokens, hidden)),
        ("hidden_states", hidden_states, (tokens, hidden)),
        ("shared_expert_gate.weight", gate_weight, (1, hidden)),
    ):
        if tensor.dtype != torch.bfloat16 or tensor.shape != shape:
            raise ValueError(
                f"gated_add: {name} is {tensor.dtype} {tuple(tensor.shape)}; expected "
                f"bfloat16 {shape} (the torch path combines other dtypes)"
            )
