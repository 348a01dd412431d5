"""Triton's CPU interpreter, made to round as the GPU does, for the small-batch kernels.

``nox -s "tests(kernels)"`` runs this folder with ``TRITON_INTERPRET=1`` and the H200's
Triton (3.6.0): every program of every launch runs in numpy, one after another, on the
CPU (``test_kernel_resources.py`` compiles the kernels for sm90 in a process of its own).
Out of the box that interpreter is not the GPU (``../shared/gpu/README.md``); five
differences matter to these kernels, and the session fixture below removes each:

- float32 to ``float8e4nv`` rounds half up with no carry into the exponent (124.0 gives
  64.0, 100.0 gives 104.0) and float32 to bfloat16 truncates; the GPU rounds both to
  nearest even. Those two conversions take torch's (round to nearest even), the rest stay;
- an FP8 ``tl.dot`` sums in float32 with numpy's BLAS, whose order changes with the
  operands' shapes, so two tile shapes could round one element apart; the GPU's order is
  fixed per element. FP8 dots sum in float64 here (128 products of two FP8 values sum
  exactly) and round once to float32: one sum per element, whatever the tile shape;
- ``gdc_wait`` and ``gdc_launch_dependents`` (programmatic dependent launches) have no
  interpreter version: they become no-ops, right where launches run one after another;
- ``libdevice.exp`` has none either: it becomes ``tl.exp`` (numpy's exp, correctly
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
# Conversions the interpreter rounds otherwise than the GPU, done by torch instead.
_ROUNDED_BY_TORCH = {"fp8e4nv": torch.float8_e4m3fn, "bf16": torch.bfloat16}


def _gpu_rounded_conversion(
    values: np.ndarray, source: Any, target: Any, rounding_mode: Any
) -> np.ndarray:
    """float32 to float8e4nv or bfloat16 rounded to nearest even, as bits; else the own."""
    dtype = _ROUNDED_BY_TORCH.get(str(target))
    if str(source) != "fp32" or dtype is None:
        return _CONVERT(values, source, target, rounding_mode)
    floats = torch.from_numpy(np.ascontiguousarray(values).view(np.float32))
    bits = floats.to(dtype).view(torch.uint8 if dtype.itemsize == 1 else torch.int16)
    return bits.numpy().view(np.uint8 if dtype.itemsize == 1 else np.uint16)


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
        patch.setattr(interpreter, "_convert_float", _gpu_rounded_conversion)
        patch.setattr(interpreter.InterpreterBuilder, "create_dot", _exact_fp8_dot)
        patch.setattr(kernels, "gdc_wait", _no_dependent_launch)
        patch.setattr(kernels, "gdc_launch_dependents", _no_dependent_launch)
        patch.setattr(kernels, "libdevice", types.SimpleNamespace(exp=_exp))
        properties = types.SimpleNamespace(multi_processor_count=H200_SMS)
        patch.setattr(torch.cuda, "get_device_properties", lambda device: properties)
        yield kernels
