"""Qwen4Exp routed experts: per-expert or fused checkpoint tensors into MegaMoE's layout."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from megamoe.core.expert_names import (
    FUSED_DOWN,
    FUSED_GATE_UP,
    parse_expert_name,
    weight_kinds,
)
from megamoe.core.experts import MegaMoEExperts
from megamoe.core.formats import WeightFormat
from megamoe.core.pairing import PROJ_TO_SHARD, SHARD_DOWN, SHARD_GATE, SHARD_UP


class Qwen4ExpMegaMoEExperts(MegaMoEExperts):
    """The routed experts of one Qwen4Exp MoE layer on this rank, in the run format.

    Accepts the per-expert tensors ``{e}.{gate,up,down}_proj.{weight,<scale>}`` (scale name
    by checkpoint format; ``weight_packed`` for MXFP4) and, for BF16 checkpoints, the fused
    ``gate_up_proj`` (E, 2I, H; gate rows first) and ``down_proj`` (E, H, I). Only this
    rank's experts (redundant replicas included) are kept. A projection stored in the run
    format is staged as is; otherwise it is requantized as soon as its weight and scale
    are both in. ``finalize()`` names any projection still missing a half.

    Constructor arguments are those of ``MegaMoEExperts``.
    """

    def expected_names(self) -> str:
        """The tensor-name pattern this module loads, for messages."""
        pattern = "{expert}.{gate,up,down}_proj.{" + ",".join(sorted(self._kinds())) + "}"
        if self.checkpoint_format is WeightFormat.BF16:
            pattern += f" or fused {FUSED_GATE_UP} / {FUSED_DOWN}"
        return pattern

    def _kinds(self) -> set[str]:
        """Tensor kinds of one projection: weight names plus the checkpoint's scale name."""
        scale = self.checkpoint_format.scale_name
        return {*weight_kinds(self.checkpoint_format), *([scale] if scale else [])}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load routed-expert tensors named relative to the layer's ``experts`` prefix.

        May be called any number of times with any subset, chunked and in any order;
        ``finalize()`` applies the update. Any error discards the pending update, so the
        previous weights keep serving.

        Args:
            weights: ``(name, tensor)`` pairs, e.g. ``("3.up_proj.weight_scale_inv", t)``
                or ``("gate_up_proj", t)``.

        Returns:
            The names accepted (tensors of other ranks' experts included: they are skipped).

        Raises:
            ValueError: an unexpected name (naming it and the expected pattern), a fused
                tensor in a quantized checkpoint, or a shape or dtype that does not match.
            NonFiniteError: a tensor holds NaN or infinity.
        """
        kinds = self._kinds()
        accepted: set[str] = set()
        label, fmt = self.layout.label, self.checkpoint_format.value
        with self._update_guard():
            for name, tensor in weights:
                parsed = parse_expert_name(name)
                if parsed is None or not (parsed.is_fused or parsed.kind in kinds):
                    raise ValueError(
                        f"{label}: unexpected {fmt} expert tensor {name!r}; expected "
                        f"{self.expected_names()}"
                    )
                if parsed.is_fused:
                    self._load_fused(parsed.proj, tensor)
                else:
                    kind = "weight" if parsed.is_weight else parsed.kind
                    expert = int(parsed.expert or 0)
                    self.load_expert_tensor(expert, PROJ_TO_SHARD[parsed.proj], kind, tensor)
                accepted.add(name)
        return accepted

    def _load_fused(self, proj: str, tensor: torch.Tensor) -> None:
        """Split a fused BF16 tensor into the projections of this rank's experts."""
        if self.checkpoint_format is not WeightFormat.BF16:
            raise ValueError(
                f"{self.layout.label}: fused expert tensor {proj!r} in a "
                f"{self.checkpoint_format.value} checkpoint; fused {FUSED_GATE_UP} / "
                f"{FUSED_DOWN} are BF16 only: store quantized experts per expert "
                "({expert}.{gate,up,down}_proj.*)"
            )
        num, inter, hidden = self.num_logical_experts, self.intermediate_size, self.hidden_size
        want = (num, 2 * inter, hidden) if proj == FUSED_GATE_UP else (num, hidden, inter)
        if tuple(tensor.shape) != want:
            layout = "(E, 2I, H)" if proj == FUSED_GATE_UP else "(E, H, I)"
            raise ValueError(
                f"{self.layout.label}: fused {proj} has shape {tuple(tensor.shape)}, expected "
                f"{want} = {layout} for E={num} logical experts, H={hidden}, I={inter}"
            )
        for expert in range(num):
            if not self.map_global_expert_id(expert):
                continue
            if proj == FUSED_DOWN:
                self.load_expert_tensor(expert, SHARD_DOWN, "weight", tensor[expert])
                continue
            gate, up = tensor[expert].split(inter)
            self.load_expert_tensor(expert, SHARD_GATE, "weight", gate)
            self.load_expert_tensor(expert, SHARD_UP, "weight", up)
