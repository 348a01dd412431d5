"""Launching a compiled Triton kernel again without the JIT's per-call work.

``kernel[grid](...)`` binds every argument, recomputes the specialization key (dtype,
alignment and value class of each argument), looks the compiled kernel up and asks each
tensor for its pointer and the driver whether the pointer is a device one. For a kernel of
about thirty arguments that is tens of microseconds of host time on the H200 test machine,
more than the router's GPU work. :class:`KernelLaunch` does the JIT's launch once per
variant (compiling it if needed) and keeps the compiled kernel; later calls of the same
variant hand its launcher the grid, the stream and the arguments directly.

The variant key is the caller's: it must fix everything the JIT specializes on for the
arguments it passes (pointer dtypes, constexpr values, pointer alignment to 16 bytes).
Integer arguments whose value class could change between calls (1, multiples of 16) must
be ``do_not_specialize`` in the kernel. The direct path is taken only in eager mode, with no
Triton launch hook installed; under ``torch.compile`` (dynamo traces the JIT call as a
user-defined Triton kernel) and with hooks (profilers) every call goes through the JIT.

The grids' host-side arithmetic is :func:`cdiv` and :func:`next_power_of_2` here, on plain
ints: Triton 3.6's ``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions
that unwrap their arguments on every call, 10-12 us each on the CI machine's cores.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch
import triton
from triton import knobs
from triton.runtime.jit import JITFunction

__all__ = ["DIRECT_LAUNCH", "KernelLaunch", "cdiv", "eager_key", "jit_options", "next_power_of_2"]

ALIGNMENT = 16  # bytes: Triton specializes pointers divisible by 16
# The direct launch makes the JIT's own call of a compiled kernel's launcher: (grid x3,
# stream, function, packed metadata, launch metadata, enter hook, exit hook, every argument
# in signature order), read in the runtime/jit.py of Triton 3.4 to 3.9 (run on the H200 with
# 3.6). Other versions launch through the JIT on every call.
_VERIFIED = ((3, 4), (3, 9))
DIRECT_LAUNCH = (
    _VERIFIED[0] <= tuple(int(p) for p in triton.__version__.split(".")[:2]) <= _VERIFIED[1]
)


def cdiv(numerator: int, denominator: int) -> int:
    """``numerator / denominator`` rounded up (``triton.cdiv`` without its call overhead)."""
    return -(-numerator // denominator)


def next_power_of_2(n: int) -> int:
    """The least power of two at least ``n`` (1 for ``n`` <= 1), as ``triton.next_power_of_2``."""
    return 1 << max(n - 1, 0).bit_length()


def jit_options(
    num_warps: int, num_stages: int | None = None, pdl: bool = False, max_registers: int = 0
) -> dict[str, Any]:
    """Triton's launch and compile options for these settings (``KernelLaunch.__call__``'s)."""
    options: dict[str, Any] = {"num_warps": num_warps}
    if pdl:
        options["launch_pdl"] = True
    if num_stages is not None:
        options["num_stages"] = num_stages
    if max_registers:
        options["maxnreg"] = max_registers
    return options


def _hooked() -> bool:
    """Whether a Triton launch hook is installed (a ``HookChain`` with calls, or a callable)."""
    hook = knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))


def eager_key(variant: Hashable, *inputs: torch.Tensor) -> Hashable | None:
    """A direct launch's key: ``variant`` and the inputs' device, or None for the JIT.

    None under ``torch.compile`` (which launches through the JIT and cannot trace
    ``data_ptr``) and where an input's data is not 16-byte aligned (the JIT specializes on
    it; rare enough to pay the JIT's host time). Outputs need no test: the caching
    allocator aligns fresh allocations.

    Args:
        variant: what else fixes the compiled kernel (constexprs, warps, input dtypes the
            constexprs do not fix).
        inputs: the launch's input tensors, on one device.
    """
    if torch.compiler.is_compiling():
        return None
    pointers = 0
    for tensor in inputs:
        pointers |= tensor.data_ptr()
    if pointers % ALIGNMENT:
        return None
    return (variant, inputs[0].device.index)


class KernelLaunch:
    """A Triton kernel's launches, the JIT's the first time per variant, direct after that.

    Args:
        kernel: the ``@triton.jit`` function; its runtime arguments come first in its
            signature, its ``tl.constexpr`` ones after them.
        runtime_args: how many leading arguments are runtime ones.
    """

    def __init__(self, kernel: JITFunction, runtime_args: int) -> None:
        self._kernel = kernel
        self._constexpr_names = tuple(kernel.arg_names[runtime_args:])
        self._compiled: dict[Hashable, Any] = {}

    def constexprs(self, values: dict[str, Any]) -> tuple[Any, ...]:
        """The constexpr values in signature order (a missing one: ``KeyError``, named)."""
        return tuple(values[name] for name in self._constexpr_names)

    def __call__(
        self,
        key: Hashable,
        grid: tuple[int, int, int],
        device_index: int,
        runtime: Sequence[Any],
        constexprs: tuple[Any, ...],
        num_warps: int,
        num_stages: int | None = None,
        pdl: bool = False,
        max_registers: int = 0,
    ) -> None:
        """Launch ``grid`` programs on the current stream of CUDA device ``device_index``.

        Args:
            key: the variant (see the module docstring); None always takes the JIT.
            grid: programs along the kernel's three axes.
            device_index: the current CUDA device, the tensors' (as for any Triton launch).
            runtime: the runtime arguments in signature order (tensors or data pointers).
            constexprs: :meth:`constexprs` of this variant.
            num_warps: the launch's warps (part of the variant).
            num_stages: the software pipeline's depth (part of the variant); None for
                Triton's default.
            pdl: launch it as a programmatic dependent launch (Hopper): its programs may
                start while the stream's previous kernel runs, so the kernel must wait
                (``gdc_wait``) before it reads what that kernel writes (part of the variant).
            max_registers: the most registers a thread may take (``maxnreg``); 0 leaves it
                to the compiler (part of the variant).
        """
        compiled = None
        direct = DIRECT_LAUNCH and not torch.compiler.is_compiling() and not _hooked()
        if direct and key is not None:
            compiled = self._compiled.get(key)
        if compiled is None:
            options = jit_options(num_warps, num_stages, pdl, max_registers)
            launched = self._kernel[grid](*runtime, *constexprs, **options)
            if direct and key is not None:
                self._compiled[key] = launched
            return
        stream = torch._C._cuda_getCurrentRawStream(device_index)
        compiled.run(
            grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata,
            None, None, None, *runtime, *constexprs,
        )  # fmt: skip
