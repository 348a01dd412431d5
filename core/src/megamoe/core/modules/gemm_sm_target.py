"""A cuBLASLt SM-count target for the shared expert's GEMMs beside the router.

In a block's CUDA graph the shared expert runs on an auxiliary stream beside the router
(``shared_expert.AuxStream``). At a few tokens its bf16 GEMMs (H=4096 by 2I and back) are
bound by reading their weights, and cuBLAS's heuristic spreads them over every SM (split
K, with a reduction launch): the router, queued beside them, cannot start until their
blocks leave the SMs, and ends after the shared expert. Asking cuBLASLt for GEMMs sized
to about half the SMs (``CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET``, which torch sets from its
SM carve-out) picks kernels that read the weights about as fast and leave the other SMs
to the router. ``AuxStream`` applies it to the shared expert it runs on its stream, up to
``SMALL_GEMM_ROWS`` tokens; from there the GEMMs are compute-heavier and the target made
them slower on the H200 (``benchmarks/bench_shared_expert.py``, ``docs/gpu.md``).

The target is torch's process-wide state (``torch._C._set_sm_carveout_experimental`` and
``torch.backends.cuda.preferred_blas_library``), set around the call and restored after
it, a carve-out the caller had set included. Another thread issuing GEMMs in the same
process at that moment would see it too. cuBLASLt picks its kernel when the GEMM is
issued, so a captured graph keeps the targeted kernels. torch prints a line to the
process's standard error, once per process, the first time each setting is made
("experimental ... may be removed"); megamoe makes both settings once, with that stream
closed, when the first target is built, so that building a model prints neither. Where
a torch build lacks the carve-out (or on ROCm, where torch carves out otherwise), the GEMMs
run as cuBLAS picks.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["SMALL_GEMM_ROWS", "SM_FRACTION", "GemmSmTarget"]

SMALL_GEMM_ROWS = 64  # tokens up to which the target pays (measured: it costs from 128)
SM_FRACTION = 0.5  # of the device's SMs that the small GEMMs are sized for
_SET_CARVEOUT = getattr(torch._C, "_set_sm_carveout_experimental", None)
_GET_CARVEOUT = getattr(torch._C, "_get_sm_carveout_experimental", None)
_CUBLASLT = "cublaslt"
_Result = TypeVar("_Result")
_NOTICES_SPENT = False  # torch's two notices were printed to nowhere (see the module text)


def _carveout_for(device: torch.device) -> int | None:
    """SMs to leave to other kernels on ``device``, or None where no target can be set."""
    if device.type != "cuda" or _SET_CARVEOUT is None or _GET_CARVEOUT is None:
        return None
    if torch.version.hip is not None:  # torch carves out by a stream of its own on ROCm
        return None
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return sms - math.ceil(sms * SM_FRACTION)


def _without_stderr(fn: Callable[[], object]) -> None:
    """Call ``fn`` with file descriptor 2 on the null device (C++ code writes there directly)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
            fn()
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _consume_torch_notices(carveout: int) -> None:
    """Make each setting once, unheard: torch's once-per-process notices are then spent."""

    def set_and_restore() -> None:
        previous = _GET_CARVEOUT()  # type: ignore[misc]
        _SET_CARVEOUT(carveout)  # type: ignore[misc]
        _SET_CARVEOUT(previous)  # type: ignore[misc]
        library = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library(_CUBLASLT)
        torch.backends.cuda.preferred_blas_library(library)

    global _NOTICES_SPENT
    if not _NOTICES_SPENT:
        _without_stderr(set_and_restore)
        _NOTICES_SPENT = True


class GemmSmTarget:
    """Runs small bf16 GEMMs on ``device`` with cuBLASLt sized for part of the SMs.

    Only cuBLAS GEMMs issued inside :meth:`run` are affected: the ``deep_gemm`` shared
    expert's FP8 GEMMs and Triton kernels size their own grids.

    Args:
        device: where the GEMMs run; on anything but a CUDA device (and on torch builds
            without the carve-out) :meth:`run` just calls its function.
    """

    def __init__(self, device: torch.device | str | None) -> None:
        self.carveout = _carveout_for(torch.device("cpu" if device is None else device))
        if self.carveout is not None:
            _consume_torch_notices(self.carveout)

    def run(self, rows: int, fn: Callable[[], _Result]) -> _Result:
        """``fn()``, with the SM target set around it when ``rows`` <= ``SMALL_GEMM_ROWS``.

        The previous carve-out and preferred BLAS library are restored afterwards, also
        when ``fn`` raises.
        """
        if self.carveout is None or rows > SMALL_GEMM_ROWS:
            return fn()
        carveout = _GET_CARVEOUT()  # type: ignore[misc]
        library = torch.backends.cuda.preferred_blas_library()
        _SET_CARVEOUT(self.carveout)  # type: ignore[misc]
        torch.backends.cuda.preferred_blas_library(_CUBLASLT)
        try:
            return fn()
        finally:
            torch.backends.cuda.preferred_blas_library(library)
            _SET_CARVEOUT(carveout)  # type: ignore[misc]
