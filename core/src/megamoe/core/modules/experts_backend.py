"""The interface every experts backend implements (SPEC §3.5)."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import torch

from megamoe.core.loading.l1_order import L1RowOrder
from megamoe.core.numerics.dispatch import DispatchBuffer
from megamoe.core.numerics.formats import WeightFormat

if TYPE_CHECKING:
    from megamoe.core.modules.experts import MegaMoEExperts

# ``experts_path``: which of a backend's paths runs a call (``backends.small_batch``).
PATH_AUTO = "auto"  # the backend's rule, by the call's token count
PATH_SMALL_BATCH = "small_batch"  # the small-batch kernels for every call they can take
PATH_MEGAMOE = "megamoe"  # the MegaMoE kernel for every call
EXPERTS_PATHS = (PATH_AUTO, PATH_SMALL_BATCH, PATH_MEGAMOE)


def check_experts_path(path: str, owner: str) -> str:
    """``path`` if it is one of :data:`EXPERTS_PATHS`.

    Raises:
        ValueError: names ``owner``, the value and the choices.
    """
    if path not in EXPERTS_PATHS:
        raise ValueError(
            f"{owner}: experts_path={path!r}; expected one of {', '.join(EXPERTS_PATHS)} "
            "('auto': the small-batch kernels for the call sizes where they are faster)"
        )
    return path


def check_small_batch_max_tokens(tokens: int | None, path: str, owner: str) -> int | None:
    """``tokens`` if it is a valid ``small_batch_max_tokens`` beside ``experts_path=path``.

    None leaves the cap to the path rule; a positive int caps the calls (and so the
    scratch) of the small-batch path. It means nothing where MegaMoE takes every call.

    Raises:
        TypeError: not an int (bool included) or None.
        ValueError: below 1, or set beside ``experts_path="megamoe"``; names ``owner``.
    """
    if tokens is None:
        return None
    if isinstance(tokens, bool) or not isinstance(tokens, int):
        raise TypeError(
            f"{owner}: small_batch_max_tokens={tokens!r} ({type(tokens).__name__}); expected "
            "an int (the most tokens per call the small-batch path takes) or None"
        )
    if tokens < 1:
        raise ValueError(
            f"{owner}: small_batch_max_tokens={tokens}; expected at least 1 (for no "
            "small-batch path, pass experts_path='megamoe')"
        )
    if path == PATH_MEGAMOE:
        raise ValueError(
            f"{owner}: small_batch_max_tokens={tokens} beside experts_path='megamoe', which "
            "runs no call on the small-batch path; drop one of the two"
        )
    return tokens


class ExpertsBackend(abc.ABC):
    """Runs a ``MegaMoEExperts`` module's forward from its canonical kernel-form tensors.

    ``MegaMoEExperts`` owns the weights (``w13_weight``: gate and up rows in the order
    ``l1_row_order`` gives, ``w2_weight`` and their scales). A backend may keep its own
    physical layout of what its kernel cannot read from them, built by ``prepare`` for the
    local experts that changed, and must then update it in place so addresses captured by
    CUDA graphs stay valid.

    Backends are constructed without arguments (``backends.select.resolve_backend``); what
    they need comes from the experts module handed to each call. Local expert ids handed to
    ``prepare`` are kernel slots: ``0 .. num_local_experts - 1`` for routed experts, then
    ``num_local_experts + s`` for fused shared expert ``s``.
    """

    name: ClassVar[str]

    @classmethod
    @abc.abstractmethod
    def unsupported_reason(cls, run_format: WeightFormat, device: torch.device) -> str | None:
        """Why this backend cannot run ``run_format`` on ``device``; None when it can."""

    @classmethod
    def fuses_shared_experts(cls, run_format: WeightFormat, device: torch.device) -> bool:
        """Whether this backend runs experts built with ``num_shared_experts > 0`` here.

        Asked before a block builds its experts, to fuse a shared expert only where it
        runs. The default is no.
        """
        del run_format, device
        return False

    def check_layer(self, experts: MegaMoEExperts) -> None:
        """Refuse layer sizes or settings this backend cannot run.

        Called by the ``MegaMoEExperts`` constructor before any weight is allocated: only
        the sizes and settings (``hidden_size``, ``intermediate_size``, ``top_k``,
        ``num_experts``, ``num_local_experts``, ``num_shared_experts``, ``max_num_tokens``,
        ``process_group``, ``device``, ``weight_format``, ``swiglu_limit``) are set then. The
        default accepts everything.

        Raises:
            ValueError: a size the backend cannot run, naming it, the value and the rule.
            CapabilityError: a setting the installed kernel lacks.
        """
        del experts

    def rounds_activations(self, experts: MegaMoEExperts) -> bool:
        """Whether this backend rounds the layer's activations to FP8, as the kernel does.

        Judges how far the output may stray from a float64 reference
        (``verify.tolerance_for``). The default is no.
        """
        del experts
        return False

    @property
    def kernel_weights(self) -> dict[str, torch.Tensor]:
        """Tensors the backend's kernel reads, by name, views of the experts' own included.

        The default keeps none.
        """
        return {}

    def l1_row_order(self, experts: MegaMoEExperts) -> L1RowOrder:
        """The order the experts store gate and up rows in: the one this kernel reads.

        Called once, after ``check_layer``, before the weights are allocated. The default
        is the canonical ``[gate | up]``.
        """
        del experts
        return L1RowOrder()

    @abc.abstractmethod
    def prepare(self, experts: MegaMoEExperts, local_ids: Sequence[int]) -> None:
        """Bring the backend's view of the given local experts up to date (``finalize()``)."""

    def small_batch_unavailable(self, experts: MegaMoEExperts) -> str | None:
        """Why this backend has no small-batch path for the layer; None where it has one.

        Asked by the experts module when ``experts_path="small_batch"`` forces that path.
        The default: it has none.
        """
        del experts
        return f"the {self.name} experts backend has no small-batch path"

    def path_for(self, experts: MegaMoEExperts, tokens: int) -> str:
        """Which path a forward of ``tokens`` tokens takes, by name (for ``inspect``/``verify``).

        The default: the backend's name, its only path.
        """
        del experts, tokens
        return self.name

    def dispatch_buffer(self, experts: MegaMoEExperts) -> DispatchBuffer | None:
        """The input buffer a router kernel may fill for :meth:`forward_dispatched`.

        None (the default) where the backend takes the routing only as ``forward``'s
        arguments.
        """
        del experts
        return None

    @abc.abstractmethod
    def forward(
        self,
        experts: MegaMoEExperts,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        """Routed (plus fused shared) expert output for this rank's tokens, (tokens, H) bf16."""

    def forward_dispatched(self, experts: MegaMoEExperts, tokens: int) -> torch.Tensor:
        """:meth:`forward` of the ``tokens`` tokens a router kernel wrote into the buffer.

        The router kernel wrote them and their routing into :meth:`dispatch_buffer`;
        backends that return one implement this.

        Raises:
            NotImplementedError: the backend has no dispatch buffer.
        """
        del experts, tokens
        raise NotImplementedError(
            f"the {self.name} experts backend has no dispatch buffer; call forward() with "
            "the routing"
        )
