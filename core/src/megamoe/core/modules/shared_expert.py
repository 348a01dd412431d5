"""The unfused shared expert: a SwiGLU MLP, and when it runs beside the MegaMoE launch.

Both adapters run a shared expert next to the routed experts' single MegaMoE launch, which
needs every SM: by default on the same stream right after the launch (its host work
overlaps the kernel), or on an auxiliary CUDA stream beside the router, joined before the
launch (``AuxStream``).

A block-FP8 shared expert is dequantized to bf16 at load by default (``gemm="bf16"``:
measured faster on the H200); ``gemm="deep_gemm"`` keeps its checkpoint's E4M3 weights and
128x128 block scales on Hopper and runs DeepGEMM's FP8 GEMM (``megamoe.core.numerics.fp8_gemm``):
half the memory.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

from megamoe.core.errors import NonFiniteError
from megamoe.core.loading.dense_update import DenseUpdate
from megamoe.core.loading.finiteness import check_block_scales, count_nonfinite
from megamoe.core.loading.pairing import PROJ_TO_SHARD, ShardPairing
from megamoe.core.modules.gemm_sm_target import GemmSmTarget
from megamoe.core.numerics import quant
from megamoe.core.numerics.formats import WeightFormat
from megamoe.core.numerics.fp8_gemm import (
    ACT_GROUP,
    SharedGemm,
    float_to_fp8_1x128,
    fp8_gemm_nt,
    resolve_shared_gemm,
)
from megamoe.core.numerics.swiglu import check_swiglu_limit, gate_up_bounds, swiglu_gate_up

# The kernels sit above the modules (megamoe.core.kernels); like quant.requantize, this
# module names its optional Triton kernel and imports it on first CUDA use. CUDA installs
# of torch ship Triton, CPU-only ones do not (then the torch SwiGLU runs).
_SWIGLU_KERNEL = "megamoe.core.kernels.swiglu_triton"
_TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None
_PROJS = ("gate_proj", "up_proj", "down_proj")
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # block scales, read as float32


class SwiGLUMLP(torch.nn.Module):
    """``down(swiglu(gate(x), up(x)))`` with bias-free projections.

    ``swiglu`` is ``megamoe.core.numerics.swiglu.swiglu``: ``silu(gate) * up``, with gate and up
    clamped first when the model has a ``swiglu_limit``.

    Two ways to multiply (``gemm``, ``megamoe.core.numerics.fp8_gemm.SharedGemm``):

    - ``bf16``: bf16 parameters ``gate_up_proj`` (2I, H: gate rows, then up rows; one GEMM)
      and ``down_proj`` (H, I); a quantized checkpoint is dequantized to bf16 when loaded.
      On CUDA with Triton the SwiGLU between them is one launch
      (``megamoe.core.kernels.swiglu_triton``, the torch expression's bits).
    - ``deep_gemm`` (block-FP8 checkpoints on SM90): the checkpoint's E4M3 values and float32
      128x128 block scales as they are, gate and up stacked into one GEMM (``gate_up_fp8``
      (2I, H), ``gate_up_scale`` (2I/128, H/128); ``down_fp8`` (H, I), ``down_scale``); the
      input and the SwiGLU output (computed in float32 from the bf16 GEMM output) are cast
      to E4M3 with float32 1x128 scales for the GEMMs.

    The first load writes the tensors straight in; once ``commit()`` has run, a reload is
    staged (``DenseUpdate``) and written in place by the next ``commit()`` (storage and
    addresses unchanged), or dropped by ``discard_pending()``.

    Args:
        hidden_size: model width H.
        intermediate_size: MLP width I.
        checkpoint_format: how the checkpoint stores the projections.
        device: where the weights live.
        prefix: name prefix for error messages.
        swiglu_limit: the SwiGLU clamp L (gate <= L, -L <= up <= L), None for none.
        gemm: a ``SharedGemm`` (or its value); None picks ``deep_gemm`` where it can run
            (``fp8_gemm.resolve_shared_gemm``), else ``bf16``.

    Raises:
        ValueError: an invalid ``swiglu_limit`` or ``gemm``, or ``deep_gemm`` requested
            for a checkpoint or sizes it cannot run.
        CapabilityError: ``deep_gemm`` requested where it cannot run.
    """

    gate_up_proj: torch.nn.Parameter
    down_proj: torch.nn.Parameter
    gate_up_fp8: torch.nn.Parameter
    gate_up_scale: torch.nn.Parameter
    down_fp8: torch.nn.Parameter
    down_scale: torch.nn.Parameter
    swiglu_bounds: torch.Tensor | None

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        checkpoint_format: WeightFormat = WeightFormat.BF16,
        device: torch.device | str | None = None,
        prefix: str = "shared_expert",
        swiglu_limit: float | None = None,
        *,
        gemm: SharedGemm | str | None = None,
    ) -> None:
        super().__init__()
        self.prefix = prefix
        self.swiglu_limit = check_swiglu_limit(swiglu_limit, prefix)
        self.checkpoint_format = checkpoint_format
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.gemm = resolve_shared_gemm(
            gemm, checkpoint_format, device, hidden_size, intermediate_size, prefix
        )
        scale_name = checkpoint_format.scale_name
        self._halves = ("weight",) if scale_name is None else ("weight", scale_name)
        # A chunked update may bring a weight and its scale in different calls.
        self._pairing = ShardPairing(self._halves, prefix=prefix)
        h, i = hidden_size, intermediate_size
        if self.gemm is SharedGemm.BF16:
            self._names: tuple[str, ...] = _PROJS
            shapes = {"gate_up_proj": (2 * i, h), "down_proj": (h, i)}
            dtypes = dict.fromkeys(shapes, torch.bfloat16)
        else:
            self._names = tuple(f"{proj}.{half}" for proj in _PROJS for half in self._halves)
            b = ACT_GROUP
            shapes = {
                "gate_up_fp8": (2 * i, h),
                "gate_up_scale": (2 * i // b, h // b),
                "down_fp8": (h, i),
                "down_scale": (h // b, i // b),
            }
            dtypes = {
                name: torch.float8_e4m3fn if name.endswith("_fp8") else torch.float32
                for name in shapes
            }
        for name, shape in shapes.items():
            self.register_parameter(
                name,
                torch.nn.Parameter(
                    torch.empty(shape, dtype=dtypes[name], device=device), requires_grad=False
                ),
            )
        self._update = DenseUpdate(prefix)
        activation_dtype = torch.bfloat16 if self.gemm is SharedGemm.BF16 else torch.float32
        self.register_buffer(
            "swiglu_bounds",
            gate_up_bounds(self.swiglu_limit, i, activation_dtype, device),
            persistent=False,
        )
        # On CUDA with Triton the bf16 path's SwiGLU is one launch (same bits as torch's).
        self._swiglu_rows: Callable[[torch.Tensor, float | None], torch.Tensor] | None = None
        if _TRITON_AVAILABLE and device is not None and torch.device(device).type == "cuda":
            kernel = importlib.import_module(_SWIGLU_KERNEL)
            bf16_limit = kernel.bf16_limit
            self._swiglu_rows = kernel.swiglu_rows
        self._bf16_limit = (
            None if self._swiglu_rows is None or self.swiglu_limit is None
            else bf16_limit(self.swiglu_limit)
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to ``x`` (..., H) in bf16 (no host sync)."""
        x = x.to(torch.bfloat16)
        if self.gemm is SharedGemm.BF16:
            gate_up = F.linear(x, self.gate_up_proj)
            if self._swiglu_rows is not None and gate_up.is_cuda:
                hidden = self._swiglu_rows(gate_up, self._bf16_limit)
            else:
                hidden = swiglu_gate_up(gate_up, self.swiglu_bounds)
            return F.linear(hidden, self.down_proj)
        rows = x.reshape(-1, self.hidden_size)
        gate_up = fp8_gemm_nt(*float_to_fp8_1x128(rows), self.gate_up_fp8, self.gate_up_scale)
        # SwiGLU in float32, cast straight to E4M3: one rounding, as inductor's fused kernel does.
        hidden = swiglu_gate_up(gate_up.float(), self.swiglu_bounds)
        out = fp8_gemm_nt(*float_to_fp8_1x128(hidden), self.down_fp8, self.down_scale)
        return out.reshape(x.shape)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load ``{gate,up,down}_proj.{weight,<scale>}`` tensors.

        A weight and its scale may come in different calls; ``check_loaded`` then tells
        whether any projection is still waiting for its other half.

        Args:
            weights: ``(name relative to the shared expert, tensor)`` pairs.

        Returns:
            The projections written by this call.

        Raises:
            ValueError: an unexpected name, a shape that does not match, or NaN or infinity
                (after dequantization for ``bf16``; in the weight or scale for
                ``deep_gemm``, as ``NonFiniteError``).
            TypeError: a weight or scale of a dtype its checkpoint format does not store
                (``bf16``: a bf16 checkpoint's weight that is not bf16; ``deep_gemm``: a
                weight that is not float8_e4m3fn, or a scale that is not floating point).
            InvalidScaleError: a block-FP8 scale that is zero or negative.
        """
        halves = self._halves
        written: set[str] = set()
        for name, tensor in weights:
            proj, _, kind = name.partition(".")
            if proj not in _PROJS or kind not in halves:
                raise ValueError(
                    f"{self.prefix}: unexpected shared-expert tensor {name!r}; expected "
                    f"{{gate,up,down}}_proj.{{{','.join(halves)}}}"
                )
            parts = self._pairing.add((None, PROJ_TO_SHARD[proj]), kind, tensor)
            if parts is None:
                continue
            if self.gemm is SharedGemm.BF16:
                self._write_bf16(proj, parts)
            else:
                self._write_fp8(proj, parts)
            written.add(proj)
        return written

    def _write_bf16(self, proj: str, parts: dict[str, torch.Tensor]) -> None:
        """Dequantize a projection's halves into its bf16 parameter (or stage them)."""
        fmt, scale_name = self.checkpoint_format, self.checkpoint_format.scale_name
        param, weight = self._bf16_slot(proj), parts["weight"]
        if fmt is WeightFormat.BF16 and weight.dtype != torch.bfloat16:
            raise TypeError(
                f"{self.prefix}.{proj}.weight has dtype {weight.dtype}, expected torch.bfloat16 "
                "for a bf16 checkpoint, as the routed experts are; cast it with "
                ".to(torch.bfloat16), or pass the checkpoint_format it is stored in"
            )
        stored = (*param.shape[:-1], param.shape[-1] // fmt.values_per_byte)
        if tuple(weight.shape) != stored:
            raise ValueError(
                f"{self.prefix}.{proj}.weight has shape {tuple(weight.shape)}, expected "
                f"{stored} ({fmt.value} storage of the ({', '.join(map(str, param.shape))}) "
                "projection: hidden_size and the shared intermediate size per config.json)"
            )
        if fmt is WeightFormat.FP8_BLOCK and scale_name is not None:
            check_block_scales(parts[scale_name], f"{self.prefix}.{proj}.{scale_name}")
        dense = quant.dequantize(
            weight.to(param.device),
            None if scale_name is None else parts[scale_name].to(param.device),
            fmt,
            name=f"{self.prefix}.{proj}",
        )
        self._update.write(proj, param, dense, shape_note="after dequantization")

    def _bf16_slot(self, proj: str) -> torch.Tensor:
        """The view of the bf16 storage that ``proj`` occupies."""
        i = self.intermediate_size
        if proj == "down_proj":
            return self.down_proj
        return self.gate_up_proj[:i] if proj == "gate_proj" else self.gate_up_proj[i:]

    def _fp8_slots(self, proj: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The (weight, scale) views of the FP8 storage that ``proj`` occupies."""
        i, b = self.intermediate_size, ACT_GROUP
        if proj == "down_proj":
            return self.down_fp8, self.down_scale
        rows = slice(0, i) if proj == "gate_proj" else slice(i, 2 * i)
        return self.gate_up_fp8[rows], self.gate_up_scale[rows.start // b : rows.stop // b]

    def _write_fp8(self, proj: str, parts: dict[str, torch.Tensor]) -> None:
        """Check a projection's E4M3 weight and block scale, then write or stage both."""
        scale_name = str(self.checkpoint_format.scale_name)
        label = f"{self.prefix}.{proj}"
        weight, scale = parts["weight"], parts[scale_name]
        if weight.dtype != torch.float8_e4m3fn:
            raise TypeError(
                f"{label}.weight has dtype {weight.dtype}, expected torch.float8_e4m3fn for a "
                "fp8_block checkpoint; pass the checkpoint_format the tensor is stored in"
            )
        if scale.dtype not in _SCALE_DTYPES:
            raise TypeError(
                f"{label}.{scale_name} has dtype {scale.dtype}, expected float32 (or bf16/fp16) "
                "128x128 block scales"
            )
        dims = "intermediate_size, hidden_size"
        if proj == "down_proj":
            dims = "hidden_size, intermediate_size"
        slots = dict(zip(("weight", scale_name), self._fp8_slots(proj), strict=True))
        notes = {"weight": f"({dims})", scale_name: f"({dims}) / 128: one per 128x128 block"}
        checked: dict[str, torch.Tensor] = {}
        for half, tensor in (("weight", weight), (scale_name, scale)):
            slot = slots[half]
            if tuple(tensor.shape) != tuple(slot.shape):
                raise ValueError(
                    f"{label}.{half} has shape {tuple(tensor.shape)}, expected "
                    f"{tuple(slot.shape)} {notes[half]}"
                )
            checked[half] = tensor.to(slot.device, slot.dtype)
            if count_nonfinite(checked[half]):
                raise NonFiniteError(f"{label}.{half} holds NaN or infinity; fix the checkpoint")
        check_block_scales(checked[scale_name], f"{label}.{scale_name}")
        # torch has no isfinite for E4M3: its bytes go through DenseUpdate, checked above.
        self._update.write(
            f"{proj}.weight",
            slots["weight"].view(torch.uint8),
            checked["weight"].view(torch.uint8),
            shape_note=notes["weight"],
        )
        self._update.write(
            f"{proj}.{scale_name}", slots[scale_name], checked[scale_name],
            shape_note=notes[scale_name],
        )  # fmt: skip

    def check_loaded(self) -> None:
        """Raise unless every projection was loaded with both its halves.

        Raises:
            IncompleteShardsError: a projection still lacks its weight or scale.
            ValueError: names the tensors never loaded.
        """
        self._pairing.check_complete()
        self._update.check_loaded(self._names)

    def commit(self) -> None:
        """Write a staged reload in place (storage unchanged); later loads are staged."""
        self._update.commit()

    def discard_pending(self) -> None:
        """Forget every tensor loaded since the last ``commit()``, unpaired halves included."""
        self._pairing.clear()
        self._update.discard_pending()

    @property
    def pending_bytes(self) -> int:
        """Bytes held by a staged reload (at most the three projections' stored size)."""
        return self._update.pending_bytes


Parts = tuple[torch.Tensor, ...]
AUX_IN_GRAPHS = "graphs"  # use_aux_stream: the auxiliary stream only in captured CUDA graphs


class AuxStream:
    """Orders a block's shared expert around its router and MegaMoE launch.

    Two schedules (:meth:`schedule`), both safe for the persistent MegaMoE kernel, which
    needs every SM to itself:

    - serial (``enabled=False``, CPU, and always under ``torch.compile``): router, MegaMoE
      launch, then the shared expert on the same stream. Its kernels queue behind the
      MegaMoE kernel, so their host-side launch work overlaps the kernel's GPU time
      instead of delaying its start.
    - auxiliary stream (``enabled=True`` on CUDA): the shared expert is issued first on a
      second stream, beside the router, and joined before the MegaMoE launch. Its GPU
      work then overlaps the router's, at the host cost of the stream switches. Up to
      ``gemm_sm_target.SMALL_GEMM_ROWS`` tokens its cuBLAS GEMMs are sized for half the
      SMs (``sm_target``, ``megamoe.core.modules.gemm_sm_target``), so that the router starts
      beside them instead of waiting for SMs.
    - ``enabled=AUX_IN_GRAPHS`` (``"graphs"``, the blocks' default): the auxiliary stream
      while a CUDA graph is being captured (the replay pays no host cost for it), serial
      otherwise. On the H200 (``benchmarks/bench_block.py``, ``docs/gpu.md``) the auxiliary
      stream made the eager blocks 1.26-1.53x slower in 9 of 10 measured rows and the
      graphed ones up to 9% faster in 8 of 10.

    Args:
        device: the device the work runs on.
        enabled: True, False or ``AUX_IN_GRAPHS``.

    Raises:
        ValueError: any other ``enabled``.
    """

    def __init__(self, device: torch.device | str, enabled: bool | str = True) -> None:
        if enabled not in (True, False, AUX_IN_GRAPHS):
            raise ValueError(
                f"use_aux_stream={enabled!r}: expected True, False or {AUX_IN_GRAPHS!r} "
                "(the auxiliary stream only while a CUDA graph is captured)"
            )
        device = torch.device(device)
        self.stream = (
            torch.cuda.Stream(device=device) if enabled and device.type == "cuda" else None
        )
        self.only_in_graphs = enabled == AUX_IN_GRAPHS
        self.sm_target = GemmSmTarget(device if self.stream is not None else None)

    def schedule(
        self,
        shared: Callable[[], Parts],
        route: Callable[[], tuple[torch.Tensor, torch.Tensor]],
        experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        tokens: int,
    ) -> tuple[torch.Tensor, Parts]:
        """Run ``experts(*route())`` and ``shared()`` in this stream's order.

        ``tokens`` (the rows of the block's input) decides whether ``shared``'s GEMMs on the
        auxiliary stream get ``sm_target``.

        Returns:
            The experts' output and the shared expert's tensors.
        """
        if (
            torch.compiler.is_compiling()
            or self.stream is None
            or (self.only_in_graphs and not torch.cuda.is_current_stream_capturing())
        ):
            routed = experts(*route())
            return routed, shared()
        join = self.launch(lambda: self.sm_target.run(tokens, shared))
        routing = route()
        side = join()  # before the MegaMoE launch: it needs every SM
        return experts(*routing), side

    def launch(self, fn: Callable[[], Parts]) -> Callable[[], Parts]:
        """Start ``fn`` on the auxiliary stream; the returned callable joins, giving the result."""
        if self.stream is None:
            result = fn()
            return lambda: result
        main = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            result = fn()
        stream = self.stream

        def join() -> Parts:
            main.wait_stream(stream)
            for tensor in result:
                tensor.record_stream(main)
            return result

        return join
