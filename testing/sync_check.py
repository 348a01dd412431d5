"""GPU tests' check that a call makes no host sync (engines capture and queue forwards)."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch


def _sync_debug_mode(mode: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # setting the mode may warn (an experimental feature)
        torch.cuda.set_sync_debug_mode(mode)


def assert_no_host_sync(call: Callable[[], object]) -> None:
    """Run ``call`` to warm it, then again where any synchronizing CUDA call raises.

    The first call may sync (kernel compilation, caches); the second runs under
    ``torch.cuda.set_sync_debug_mode("error")``.
    """
    call()
    torch.cuda.synchronize()
    _sync_debug_mode("error")
    try:
        call()
    finally:
        _sync_debug_mode("default")
    torch.cuda.synchronize()
