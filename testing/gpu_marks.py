"""The pytest marks of GPU tests that compile, capture and sync-check on CUDA.

``gpu`` (``nox -s gpu_tests`` selects it), a clean skip without CUDA, and the warnings
inductor and ``torch.cuda.set_sync_debug_mode`` print that say nothing about our code.
"""

from __future__ import annotations

import pytest
import torch

from megamoe.core.numerics.formats import WeightFormat, detect_arch, resolve_formats

COMPILED_GPU_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.filterwarnings("ignore:.*torch.jit:DeprecationWarning"),  # inductor's imports
    pytest.mark.filterwarnings("ignore:.*TensorFloat32:UserWarning"),  # inductor's advice
    pytest.mark.filterwarnings("ignore:.*Synchronization debug mode:UserWarning"),
]


def skip_unless_block_fp8_kernel() -> None:
    """Skip where block-FP8 experts do not run as stored on DeepGEMM's Hopper kernel."""
    from megamoe.core.backends.deepgemm import DeepGemmBackend

    run_format = resolve_formats(WeightFormat.FP8_BLOCK, None, detect_arch("cuda"))[1]
    if run_format is not WeightFormat.FP8_BLOCK:
        pytest.skip(
            f"this GPU runs block-FP8 experts as {run_format.value}, not on the Hopper kernel"
        )
    reason = DeepGemmBackend.unsupported_reason(WeightFormat.FP8_BLOCK, torch.device("cuda"))
    if reason is not None:
        pytest.skip(f"DeepGEMM cannot run fp8_block here: {reason}")
