"""Triton's CPU interpreter, made to compute as the GPU does, for megamoe's Triton kernels.

``nox -s "tests(kernels)"`` runs this folder with ``TRITON_INTERPRET=1`` and the H200's
Triton (3.6.0): every program of every launch runs in numpy, one after another, on the
CPU (``test_kernel_resources.py`` compiles the kernels for sm90 in a process of its own).
Out of the box that interpreter is not the GPU (``../shared/gpu/README.md``); five
differences matter to these kernels, and the session fixture below removes each:

- float32 to ``float8e4nv`` rounds half up with no carry into the exponent (124.0 gives
  64.0, 100.0 gives 104.0) and float32 to bfloat16 truncates; the GPU rounds both to
  nearest even. ``float8e4nv`` to float32 or float16 reads E4M3FN's NaN (0x7F) as 480.
  Those conversions take torch's, the rest stay;
- an FP8 ``tl.dot`` sums in float32 with numpy's BLAS, whose order changes with the
  operands' shapes, so two tile shapes could round one element apart; the GPU's order is
  fixed per element. FP8 dots sum in float64 here (128 products of two FP8 values sum
  exactly) and round once to float32: one sum per element, whatever the tile shape;
- ``gdc_wait`` and ``gdc_launch_dependents`` (programmatic dependent launches) have no
  interpreter version: in the small-batch kernels they become no-ops, right where launches
  run one after another;
- ``libdevice.exp`` has none either: there it becomes ``tl.exp`` (numpy's exp, correctly
  rounded where libdevice's is within 1 ulp);
- with no CUDA device there are no SMs to size the persistent grids by: the H200's 132.

What the interpreter cannot show: the programs of a launch never run side by side, so the
per-expert waits and the dependent launches' overlap are not exercised (the GPU tests,
``core/tests/backends/test_gpu_small_batch.py``, are). It also runs Triton 3.6.0's
interpreter with numpy < 2.4: it reads one-element arrays with ``int()``, which newer
numpy refuses.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported: JIT or not

import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

H200_SMS = 132  # the persistent grids are sized by the H200's SMs
_CONVERT = interpreter._convert_float  # the interpreter's own conversion (what it replaces)
# Conversions the interpreter gets otherwise than the GPU, done by torch instead: rounding to
# FP8 and bf16, and FP8's NaN (E4M3FN's 0x7F, which the interpreter reads as 480).
_TORCH = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
          "fp8e4nv": torch.float8_e4m3fn}  # fmt: skip
_BY_TORCH = {("fp32", "fp8e4nv"), ("fp32", "bf16"), ("fp8e4nv", "fp32"), ("fp8e4nv", "fp16")}
# bytes per element: (numpy and torch integers that hold the bits, the interpreter's own)
_BITS = {
    1: (np.uint8, torch.uint8, np.uint8),
    2: (np.int16, torch.int16, np.uint16),
    4: (np.int32, torch.int32, np.uint32),
}


def _gpu_like_conversion(values: np.ndarray, source: Any, target: Any, rounding_mode: Any) -> Any:
    """``_BY_TORCH``'s conversions as torch (and the GPU) do them, as bits; else the own."""
    if (str(source), str(target)) not in _BY_TORCH:
        return _CONVERT(values, source, target, rounding_mode)
    dtype_in, dtype_out = _TORCH[str(source)], _TORCH[str(target)]
    np_in, torch_in, _ = _BITS[dtype_in.itemsize]
    bits_in = torch.from_numpy(np.ascontiguousarray(values).view(np_in)).view(torch_in)
    _, torch_out, np_out = _BITS[dtype_out.itemsize]
    return bits_in.view(dtype_in).to(dtype_out).view(torch_out).numpy().view(np_out)


_DOT = interpreter.InterpreterBuilder.create_dot


def _exact_fp8_dot(
    builder: Any, a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any
) -> Any:
    """An FP8 dot summed exactly (float64), rounded once to the accumulator's float32."""
    if str(a.dtype.scalar) != "fp8e4nv" or str(b.dtype.scalar) != "fp8e4nv":
        return _DOT(builder, a, b, d, input_precision, max_num_imprecise_acc)
    a64, b64 = (
        _CONVERT(t.data, t.dtype.scalar, tl.float16, None).view(np.float16).astype(np.float64)
        for t in (a, b)
    )
    product = np.matmul(a64, b64).astype(np.float32)
    return interpreter.TensorHandle(product + d.data, d.dtype.scalar)


@triton.jit
def _no_dependent_launch() -> None:
    """Launches run one after another here: nothing to wait for, nothing to let start."""
    pass


@triton.jit
def _exp(x: tl.tensor) -> tl.tensor:
    return tl.exp(x)


@pytest.fixture(scope="session", autouse=True)
def gpu_like_interpreter() -> Iterator[types.ModuleType]:
    """The small-batch kernels' module, interpreted, with the five differences removed."""
    from megamoe.core.kernels import experts_small_batch as kernels

    if not isinstance(kernels._l1_kernel, interpreter.InterpretedFunction):
        pytest.fail(
            "the small-batch kernels were compiled for a GPU, not interpreted: run this "
            "folder alone with TRITON_INTERPRET=1 (nox -s 'tests(kernels)')"
        )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(interpreter, "_convert_float", _gpu_like_conversion)
        patch.setattr(interpreter.InterpreterBuilder, "create_dot", _exact_fp8_dot)
        patch.setattr(kernels, "gdc_wait", _no_dependent_launch)
        patch.setattr(kernels, "gdc_launch_dependents", _no_dependent_launch)
        patch.setattr(kernels, "libdevice", types.SimpleNamespace(exp=_exp))
        properties = types.SimpleNamespace(multi_processor_count=H200_SMS)
        patch.setattr(torch.cuda, "get_device_properties", lambda device: properties)
        yield kernels
