"""The unfused shared expert: a SwiGLU MLP, and the auxiliary stream it runs on.

Both adapters run a shared expert beside the router while the MegaMoE launch waits: the
launch needs every SM, so the shared expert is issued first on an auxiliary CUDA stream and
joined before the kernel starts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

from megamoe.core import quant
from megamoe.core.dense_update import DenseUpdate
from megamoe.core.finiteness import check_block_scales
from megamoe.core.formats import WeightFormat
from megamoe.core.pairing import PROJ_TO_SHARD, ShardPairing
from megamoe.core.swiglu import check_swiglu_limit, swiglu

_PROJS = ("gate_proj", "up_proj", "down_proj")


class SwiGLUMLP(torch.nn.Module):
    """``down(swiglu(gate(x), up(x)))`` with bias-free bf16 projections.

    ``swiglu`` is ``megamoe.core.swiglu.swiglu``: ``silu(gate) * up``, with gate and up
    clamped first when the model has a ``swiglu_limit``.

    Quantized checkpoint tensors are dequantized to bf16 when loaded. The first load writes
    them straight in; once ``commit()`` has run, a reload is staged (``DenseUpdate``) and
    written in place by the next ``commit()``, or dropped by ``discard_pending()``.

    Args:
        hidden_size: model width H.
        intermediate_size: MLP width I.
        checkpoint_format: how the checkpoint stores the projections (scales are
            dequantized when loaded).
        device: where the weights live.
        prefix: name prefix for error messages.
        swiglu_limit: the SwiGLU clamp L (gate <= L, -L <= up <= L), None for none.
    """

    gate_proj: torch.nn.Parameter
    up_proj: torch.nn.Parameter
    down_proj: torch.nn.Parameter

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        checkpoint_format: WeightFormat = WeightFormat.BF16,
        device: torch.device | str | None = None,
        prefix: str = "shared_expert",
        swiglu_limit: float | None = None,
    ) -> None:
        super().__init__()
        self.prefix = prefix
        self.swiglu_limit = check_swiglu_limit(swiglu_limit, prefix)
        self.checkpoint_format = checkpoint_format
        scale_name = checkpoint_format.scale_name
        self._halves = ("weight",) if scale_name is None else ("weight", scale_name)
        # A chunked update may bring a weight and its scale in different calls.
        self._pairing = ShardPairing(self._halves, prefix=prefix)
        shapes = {
            "gate_proj": (intermediate_size, hidden_size),
            "up_proj": (intermediate_size, hidden_size),
            "down_proj": (hidden_size, intermediate_size),
        }
        for proj, shape in shapes.items():
            self.register_parameter(
                proj,
                torch.nn.Parameter(
                    torch.empty(shape, dtype=torch.bfloat16, device=device), requires_grad=False
                ),
            )
        self._update = DenseUpdate(prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to ``x`` (tokens, H) in bf16."""
        x = x.to(torch.bfloat16)
        hidden = swiglu(F.linear(x, self.gate_proj), F.linear(x, self.up_proj), self.swiglu_limit)
        return F.linear(hidden, self.down_proj)

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
                (after dequantization).
            InvalidScaleError: a block-FP8 scale that is zero or negative.
        """
        halves, scale_name = self._halves, self.checkpoint_format.scale_name
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
            param: torch.nn.Parameter = getattr(self, proj)
            if self.checkpoint_format is WeightFormat.FP8_BLOCK and scale_name is not None:
                check_block_scales(parts[scale_name], f"{self.prefix}.{proj}.{scale_name}")
            dense = quant.dequantize(
                parts["weight"].to(param.device),
                None if scale_name is None else parts[scale_name].to(param.device),
                self.checkpoint_format,
            )
            self._update.write(proj, param, dense, shape_note="after dequantization")
            written.add(proj)
        return written

    def check_loaded(self) -> None:
        """Raise unless every projection was loaded with both its halves.

        Raises:
            IncompleteShardsError: a projection still lacks its weight or scale.
            ValueError: names the projections never loaded.
        """
        self._pairing.check_complete()
        self._update.check_loaded(_PROJS)

    def commit(self) -> None:
        """Write a staged reload in place (storage unchanged); later loads are staged."""
        self._update.commit()

    def discard_pending(self) -> None:
        """Forget every tensor loaded since the last ``commit()``, unpaired halves included."""
        self._pairing.clear()
        self._update.discard_pending()

    @property
    def pending_bytes(self) -> int:
        """Bytes held by a staged reload (at most the three projections' bf16 size)."""
        return self._update.pending_bytes


class AuxStream:
    """Runs work beside the current CUDA stream and joins it later; inline without CUDA.

    Args:
        device: the device the work runs on.
        enabled: False runs everything inline on the current stream (serial path).
    """

    def __init__(self, device: torch.device | str, enabled: bool = True) -> None:
        device = torch.device(device)
        self.stream = (
            torch.cuda.Stream(device=device) if enabled and device.type == "cuda" else None
        )

    def launch(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Start ``fn`` on the auxiliary stream; the returned callable joins, giving the result."""
        if self.stream is None:
            result = fn()
            return lambda: result
        main = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            result = fn()
        stream = self.stream

        def join() -> torch.Tensor:
            main.wait_stream(stream)
            result.record_stream(main)
            return result

        return join
