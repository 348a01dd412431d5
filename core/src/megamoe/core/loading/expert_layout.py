"""Sizes and linear placement of one MoE layer's experts on one rank (SPEC §3.4, §5).

Kernel slots: ``0 .. num_local_experts - 1`` are routed experts (physical expert
``experts_start_idx + slot``, holding logical expert ``physical % num_logical_experts``),
then ``num_local_experts + s`` is fused shared expert ``s``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megamoe.core.checkpoint.expert_names import TensorSpec, projection_specs
from megamoe.core.loading.pairing import SHARD_DOWN
from megamoe.core.numerics.formats import BLOCK_FP8_DEFAULT, WeightFormat, kernel_aligned

_ID_DTYPES = (torch.int32, torch.int64)  # the routing ids a forward takes
Specs = tuple[TensorSpec, TensorSpec | None]  # a projection's weight and scale specs


@dataclass(frozen=True)
class ExpertLayout:
    """Validated sizes and placement; see ``MegaMoEExperts`` for the meaning of each."""

    num_experts: int
    num_local_experts: int
    experts_start_idx: int
    num_logical_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    num_shared_experts: int
    max_num_tokens: int
    label: str

    def __post_init__(self) -> None:
        """Check every size and placement rule (before anything is allocated).

        Raises:
            ValueError: names the option, its value and the rule.
        """
        e, e_local, start = self.num_experts, self.num_local_experts, self.experts_start_idx
        aligned = "a positive multiple of 128"
        rules = [
            ("hidden_size", self.hidden_size, kernel_aligned(self.hidden_size), aligned),
            (
                "intermediate_size",
                self.intermediate_size,
                kernel_aligned(self.intermediate_size),
                aligned,
            ),
            (
                "num_logical_experts",
                self.num_logical_experts,
                self.num_logical_experts >= 1,
                ">= 1",
            ),
            (
                "num_experts",
                e,
                e >= self.num_logical_experts,
                f">= num_logical_experts={self.num_logical_experts} (every logical expert "
                "needs a physical one)",
            ),
            (
                "num_local_experts",
                e_local,
                e_local >= 1 and e % e_local == 0,
                f"a divisor of num_experts={e} (num_experts % ep_size == 0: equal split)",
            ),
            (
                "experts_start_idx",
                start,
                start >= 0 and start % e_local == 0 and start + e_local <= e,
                f"rank * num_local_experts={e_local}, below num_experts={e} (linear placement)",
            ),
            ("top_k", self.top_k, 1 <= self.top_k <= e, f"in [1, num_experts={e}]"),
            ("num_shared_experts", self.num_shared_experts, self.num_shared_experts >= 0, ">= 0"),
            ("max_num_tokens", self.max_num_tokens, self.max_num_tokens >= 1, ">= 1"),
        ]
        for option, value, ok, rule in rules:
            if not ok:
                raise ValueError(f"{self.label}: {option}={value} must be {rule}")

    def check_group(self, group: dist.ProcessGroup | None) -> None:
        """Check that this rank's slice of experts matches its rank in ``group``.

        Raises:
            ValueError: the split or the start index disagrees with the group.
        """
        if group is None:
            return
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if self.num_local_experts * size != self.num_experts or (
            self.experts_start_idx != rank * self.num_local_experts
        ):
            raise ValueError(
                f"{self.label}: rank {rank} of an expert-parallel group of {size} must hold "
                f"num_experts/{size} experts starting at rank*num_local_experts; got "
                f"num_experts={self.num_experts}, num_local_experts={self.num_local_experts}, "
                f"experts_start_idx={self.experts_start_idx}"
            )

    @property
    def num_slots(self) -> int:
        """Kernel slots: local routed experts plus fused shared experts."""
        return self.num_local_experts + self.num_shared_experts

    def map_global_expert_id(self, expert_id: int) -> list[int]:
        """Local slots holding logical expert ``expert_id`` (empty when other ranks hold it).

        Raises:
            ValueError: ``expert_id`` is not a logical expert of the model.
        """
        if not 0 <= expert_id < self.num_logical_experts:
            raise ValueError(
                f"{self.label}: expert id {expert_id} is out of range "
                f"[0, num_logical_experts={self.num_logical_experts}); tensors name experts "
                "by their global id in the checkpoint: check the name, or the expert count "
                "the layer was built with (the config's)"
            )
        start, logical = self.experts_start_idx, self.num_logical_experts
        first = start + (expert_id - start) % logical  # first replica at or after start
        return [p - start for p in range(first, start + self.num_local_experts, logical)]

    def logical_of(self, slot: int) -> int:
        """Logical expert held by routed slot ``slot``."""
        return (self.experts_start_idx + slot) % self.num_logical_experts

    def slot_label(self, slot: int) -> str:
        """A kernel slot described for messages."""
        if slot >= self.num_local_experts:
            return f"shared expert {slot - self.num_local_experts}"
        physical = self.experts_start_idx + slot
        return f"expert slot {slot} (physical {physical}, logical {self.logical_of(slot)})"

    def slot_param(self, slot: int, shard_id: str) -> tuple[str, int]:
        """Parameter-name stem (``w13``, ``w2``, ``shared_l1``, ``shared_l2``) and index."""
        down = shard_id == SHARD_DOWN
        if slot < self.num_local_experts:
            return ("w2" if down else "w13"), slot
        return ("shared_l2" if down else "shared_l1"), slot - self.num_local_experts

    def specs(self, fmt: WeightFormat, shard_id: str, *, whole_shared: bool = False) -> Specs:
        """Stored weight and scale specs of one shard (gate/up I x H, down H x I) in ``fmt``.

        Args:
            fmt: the storage format.
            shard_id: ``w1``, ``w3`` or ``w2``.
            whole_shared: the checkpoint's whole shared MLP (intermediate ``S * I``).
        """
        inter = self.intermediate_size * (self.num_shared_experts if whole_shared else 1)
        rows, cols = (
            (self.hidden_size, inter) if shard_id == SHARD_DOWN else (inter, self.hidden_size)
        )
        return projection_specs(fmt, rows, cols, BLOCK_FP8_DEFAULT)

    def check_forward(
        self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> None:
        """Shapes and dtypes of a forward's inputs (metadata only, no device sync).

        Raises:
            ValueError: a shape that does not match, or more than ``max_num_tokens`` tokens.
            TypeError: a dtype that does not match.
        """
        if hidden_states.dim() != 2 or hidden_states.shape[1] != self.hidden_size:
            raise ValueError(
                f"{self.label}: hidden_states has shape {tuple(hidden_states.shape)}, "
                f"expected (tokens, hidden_size={self.hidden_size})"
            )
        tokens = hidden_states.shape[0]
        routing = (tokens, self.top_k)
        if (
            hidden_states.dtype != torch.bfloat16
            or topk_weights.dtype != torch.float32
            or topk_ids.dtype not in _ID_DTYPES
            or topk_weights.shape != routing
            or topk_ids.shape != routing
        ):
            self._refuse_routing(hidden_states, topk_weights, topk_ids)
        if tokens > self.max_num_tokens:
            raise ValueError(
                f"{self.label}: {tokens} tokens exceed max_num_tokens={self.max_num_tokens}; "
                "build the layer with a larger max_num_tokens or split the batch"
            )

    def _refuse_routing(
        self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> None:
        """Raise for the first input of :meth:`check_forward` whose dtype or shape is wrong."""
        tokens = hidden_states.shape[0]
        inputs = (
            ("hidden_states", hidden_states, (torch.bfloat16,)),
            ("topk_weights", topk_weights, (torch.float32,)),
            ("topk_ids", topk_ids, _ID_DTYPES),
        )
        for what, tensor, dtypes in inputs:
            if tensor.dtype not in dtypes:
                raise TypeError(
                    f"{self.label}: {what} has dtype {tensor.dtype}, expected "
                    f"{' or '.join(map(str, dtypes))}"
                )
            if what != "hidden_states" and tuple(tensor.shape) != (tokens, self.top_k):
                raise ValueError(
                    f"{self.label}: {what} has shape {tuple(tensor.shape)}, expected "
                    f"({tokens}, top_k={self.top_k})"
                )
