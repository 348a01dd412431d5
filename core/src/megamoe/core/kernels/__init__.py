"""Optional GPU kernels (Triton) that give the same bits as the torch paths in ``megamoe.core``.

Nothing here is imported by the rest of core at import time: ``quant.requantize`` imports
``megamoe.core.kernels.requant_triton`` on first use for CUDA tensors and falls back to
torch when Triton is missing, so core works without Triton (CPU CI has none).
"""
