"""The pytest marks of GPU tests that compile, capture and sync-check on CUDA.

``gpu`` (``nox -s gpu_tests`` selects it), a clean skip without CUDA, and the warnings
inductor and ``torch.cuda.set_sync_debug_mode`` print that say nothing about our code.
"""

from __future__ import annotations

import pytest
import torch

COMPILED_GPU_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.filterwarnings("ignore:.*torch.jit:DeprecationWarning"),  # inductor's imports
    pytest.mark.filterwarnings("ignore:.*TensorFloat32:UserWarning"),  # inductor's advice
    pytest.mark.filterwarnings("ignore:.*Synchronization debug mode:UserWarning"),
]
