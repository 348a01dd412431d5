"""DeepGEMM MegaMoE symmetric buffers, one per (group, device, shape, kind), shared by layers.

The MegaMoE kernels read their inputs from, and exchange tokens through, a buffer every rank
of the expert-parallel group allocates at the same size (symmetric memory). It is sized
from the most tokens one rank sends per forward and costs hundreds of MiB for a realistic
layer, so every layer with the same shape and kernel kind shares one. It is allocated when a
layer is finalized, never inside ``forward`` and never while a CUDA graph is being
captured; it carries the ``KernelTag`` of the weights it was built for.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megamoe.core.errors import FormatMismatchError
from megamoe.core.loading.tagging import KernelTag, tag

logger = logging.getLogger("megamoe")


@dataclass(frozen=True)
class BufferKey:
    """What a symmetric buffer is built for; layers with equal keys share one buffer.

    Attributes:
        group: the expert-parallel process group (compared by identity).
        device: the CUDA device the buffer lives on.
        num_experts: physical experts over all ranks.
        max_num_tokens: most tokens one rank sends per forward (its capacity).
        top_k: experts per token.
        hidden_size: H.
        intermediate_size: I.
        kind: the DeepGEMM kernel kind (``sm90_fp8``, ``fp8xfp4``, ``fp8xfp8``,
            ``bf16xbf16``).
        num_shared_experts: shared experts fused into the kernel (the buffer holds their
            activations).
    """

    group: object
    device: torch.device
    num_experts: int
    max_num_tokens: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    kind: str
    num_shared_experts: int = 0


@dataclass
class SymmBufferEntry:
    """A cached DeepGEMM buffer and what it holds.

    Attributes:
        key: what it was built for.
        buffer: DeepGEMM's buffer object (``x``, ``x_sf``, ``topk_idx``, ``topk_weights``
            views, ...); tagged with ``kernel_tag``.
        kernel_tag: format, scale granularity and shared-expert count of its weights.
    """

    key: BufferKey
    buffer: Any
    kernel_tag: KernelTag

    @property
    def capacity(self) -> int:
        """Tokens one rank may send per forward."""
        return self.key.max_num_tokens


_BUFFERS: dict[BufferKey, SymmBufferEntry] = {}


def get_symm_buffer(
    key: BufferKey, kernel_tag: KernelTag, allocate: Callable[[], Any]
) -> SymmBufferEntry:
    """The cached buffer for ``key``, allocating it with ``allocate()`` the first time.

    Args:
        key: what the buffer is for.
        kernel_tag: the tag of the weights it will serve.
        allocate: builds DeepGEMM's buffer (collective over ``key.group``: every rank of
            the group must reach this call for the same key).

    Returns:
        The cache entry.

    Raises:
        FormatMismatchError: a buffer cached for ``key`` carries another tag.
        RuntimeError: the buffer would be allocated while a CUDA graph is being captured.
    """
    entry = _BUFFERS.get(key)
    if entry is not None:
        if entry.kernel_tag != kernel_tag:
            raise FormatMismatchError(
                f"the cached DeepGEMM {key.kind} buffer serves {entry.kernel_tag.describe()}, "
                f"not {kernel_tag.describe()}; build layers of one kernel kind with one format"
            )
        return entry
    if key.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"a DeepGEMM {key.kind} symmetric buffer would be allocated during CUDA-graph "
            "capture; call finalize() on every MoE layer before capturing graphs"
        )
    buffer = allocate()
    tag(buffer, kernel_tag)
    entry = SymmBufferEntry(key, buffer, kernel_tag)
    _BUFFERS[key] = entry
    nbytes = getattr(getattr(buffer, "buffer", None), "nbytes", None)
    logger.info(
        "megamoe: allocated a DeepGEMM %s symmetric buffer on %s for %d tokens per rank "
        "(E=%d, top-%d, H=%d, I=%d, %s bytes), shared by layers of this shape",
        key.kind,
        key.device,
        key.max_num_tokens,
        key.num_experts,
        key.top_k,
        key.hidden_size,
        key.intermediate_size,
        nbytes,
    )
    return entry


def cached_buffers() -> list[SymmBufferEntry]:
    """The buffers allocated so far (for inspection and tests)."""
    return list(_BUFFERS.values())


def clear_symm_buffers() -> int:
    """Forget every cached buffer (memory is freed once no layer uses it).

    Call after tearing down the layers, e.g. before destroying their process group.

    Returns:
        How many buffers were dropped.
    """
    count = len(_BUFFERS)
    _BUFFERS.clear()
    return count


def check_group(process_group: dist.ProcessGroup | None) -> None:
    """Refuse ``process_group=None`` while ``torch.distributed`` runs several ranks.

    Raises:
        ValueError: names the world size and the group to pass instead.
    """
    if process_group is None and dist.is_initialized() and dist.get_world_size() != 1:
        raise ValueError(
            f"process_group=None means one rank, but torch.distributed runs "
            f"{dist.get_world_size()} ranks; pass the expert-parallel group as process_group "
            "(a one-rank group from torch.distributed.new_group([rank]), created on every "
            "rank, for a rank-local layer)"
        )


def resolve_group(process_group: dist.ProcessGroup | None, device: torch.device) -> object:
    """The process group a DeepGEMM buffer is built over.

    ``process_group=None`` means one rank holding every expert. DeepGEMM's MegaMoE always
    runs over a ``torch.distributed`` group, so megamoe then uses a one-rank group:

    - ``torch.distributed`` not initialized: megamoe initializes it once for this process
      as a one-rank group (NCCL for a CUDA device, gloo otherwise) on an in-process
      ``HashStore`` (no port, no environment variables) and logs it. An engine that later
      wants its own world must not call ``init_process_group`` again: it should pass its
      expert-parallel group instead.
    - initialized with one rank: that default group.
    - initialized with several ranks: an error; pass the expert-parallel group (or a
      one-rank group from ``torch.distributed.new_group``, created on every rank).

    Args:
        process_group: the experts module's group, or None.
        device: the experts' device.

    Returns:
        The group (``process_group`` itself when given).

    Raises:
        ValueError: ``process_group`` is None while several ranks are running.
    """
    if process_group is not None:
        return process_group
    check_group(None)
    if dist.is_initialized():
        return dist.group.WORLD
    backend = "nccl" if device.type == "cuda" else "gloo"
    device_id = None
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        device_id = torch.device("cuda", index)
    dist.init_process_group(
        backend, store=dist.HashStore(), rank=0, world_size=1, device_id=device_id
    )
    logger.info(
        "megamoe: torch.distributed was not initialized; initialized a one-rank %s group "
        "for DeepGEMM MegaMoE (pass process_group=... to use your own)",
        backend,
    )
    return dist.group.WORLD
