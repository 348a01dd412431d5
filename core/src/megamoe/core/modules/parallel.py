"""Parallel settings an engine fills in for an MoE block (SPEC §3.4)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

PLACEMENT_LINEAR = "linear"  # rank r holds physical experts [r*E_local, (r+1)*E_local)


@dataclass(frozen=True)
class ParallelSettings:
    """How an MoE block is spread over ranks.

    Attributes:
        ep_group: the expert-parallel process group. The MoE blocks require one (a group of
            size 1 for one device: ``single_rank_group``); ``None`` is refused there.
        tp_size: tensor-parallel size of the block (MegaMoE supports 1).
        placement: expert placement strategy; MegaMoE needs ``"linear"``.
        num_redundant_experts: extra physical experts (EPLB replicas) beyond the logical
            ones; physical expert p holds logical expert ``p % num_logical``.
    """

    ep_group: dist.ProcessGroup | None = None
    tp_size: int = 1
    placement: str = PLACEMENT_LINEAR
    num_redundant_experts: int = 0

    @property
    def ep_size(self) -> int:
        """Number of expert-parallel ranks."""
        return 1 if self.ep_group is None else dist.get_world_size(self.ep_group)

    @property
    def ep_rank(self) -> int:
        """This process's rank in the expert-parallel group."""
        return 0 if self.ep_group is None else dist.get_rank(self.ep_group)

    def check_megamoe(self, model: str) -> None:
        """Refuse settings MegaMoE cannot run, naming the setting to change.

        Args:
            model: model name for the message.

        Raises:
            NotImplementedError: no expert-parallel group, tensor parallel > 1 or non-linear
                placement.
            ValueError: a negative number of redundant experts.
        """
        if self.ep_group is None:
            raise NotImplementedError(
                f"{model} MegaMoE runs expert parallel: pass ParallelSettings(ep_group=...) "
                "with the expert-parallel process group (a group of size 1 for one GPU)"
            )
        if self.tp_size != 1:
            raise NotImplementedError(
                f"{model} MegaMoE supports tp_size=1 only, got tp_size={self.tp_size}; "
                "scale out with expert/data parallel instead"
            )
        if self.placement != PLACEMENT_LINEAR:
            raise NotImplementedError(
                f"{model} MegaMoE places experts linearly, got placement={self.placement!r}; "
                f"set placement={PLACEMENT_LINEAR!r}"
            )
        if self.num_redundant_experts < 0:
            raise ValueError(
                f"num_redundant_experts must be >= 0, got {self.num_redundant_experts}"
            )


def single_rank_group(device: torch.device | str | None = None) -> dist.ProcessGroup:
    """A process group of this process alone, for one-GPU (or CPU) runs of an MoE block.

    Where torch.distributed is not initialized yet it is initialized with world size 1
    through an in-memory store (no network): NCCL for a CUDA device, gloo otherwise.

    Args:
        device: where the block runs (None = CPU).

    Returns:
        The default group, of size 1.

    Raises:
        ValueError: torch.distributed is already initialized with more than one rank (pass
            that job's expert-parallel group instead).
    """
    if not dist.is_initialized():
        cuda = device is not None and torch.device(device).type == "cuda"
        dist.init_process_group(
            backend="nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1
        )
    if dist.get_world_size() != 1:
        raise ValueError(
            f"single_rank_group: torch.distributed already runs {dist.get_world_size()} "
            "ranks; pass ParallelSettings(ep_group=...) with the job's expert-parallel group"
        )
    group = dist.group.WORLD
    if group is None:
        raise ValueError("single_rank_group: torch.distributed has no default group")
    return group
