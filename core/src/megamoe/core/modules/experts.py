"""This rank's routed experts in the run format, in canonical kernel form (SPEC §3.4, §5).

Loading is a two-step update. ``load_*`` calls (``expert_loading``) check, pair and convert
each shard, then write it into place (before the module first serves) or stage it (a
reload); ``finalize()`` checks that the update is complete and that every kernel slot was
written, copies staged shards into the kernel tensors in place and has the backend redo
only the experts that changed. Kernel slots are described in ``expert_layout``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megamoe.core.checkpoint.expert_names import projection_specs
from megamoe.core.errors import CapabilityError, MissingExpertsError, format_keys
from megamoe.core.loading.expert_layout import ExpertLayout
from megamoe.core.loading.expert_loading import ExpertLoading
from megamoe.core.loading.pairing import SHARD_IDS, SHARD_TO_PROJ
from megamoe.core.loading.tagging import KernelTag, check_tags, tag
from megamoe.core.modules import experts_op
from megamoe.core.modules.backend_select import layer_backend
from megamoe.core.modules.experts_backend import (
    PATH_SMALL_BATCH,
    check_experts_path,
    check_small_batch_max_tokens,
)
from megamoe.core.modules.fixed_module import FixedModule
from megamoe.core.numerics.dispatch import DispatchBuffer
from megamoe.core.numerics.formats import BLOCK_FP8_DEFAULT, WeightFormat, check_run_format
from megamoe.core.numerics.swiglu import check_swiglu_limit


class MegaMoEExperts(ExpertLoading, FixedModule):
    """Routed experts (plus optional fused shared experts) of one MoE layer on one rank.

    Parameters (``requires_grad=False``, on ``device``), ``E = num_local_experts``,
    ``S = num_shared_experts``, ``H' = H / 2`` and ``I' = I / 2`` for MXFP4 (packed), else
    ``H``, ``I``:

    - ``w13_weight`` (E, 2I, H'): gate and up rows, in the order the backend's kernel reads
      (``l1_order``: ``[gate | up]``, or interleaved in groups of 8 for DeepGEMM), so the
      kernel reads these tensors themselves. ``w2_weight`` (E, H, I').
    - ``w13_weight_scale`` / ``w2_weight_scale``: FP8_BLOCK float32 (E, 2I/128, H/128) and
      (E, H/128, I/128), gate blocks then up blocks; MXFP8/MXFP4 uint8 UE8M0 (E, 2I, H/32)
      and (E, H, I/32); none for BF16.
    - ``shared_l1_weight`` / ``shared_l2_weight`` (and ``_scale``): the same for the fused
      shared experts, leading dimension S (same intermediate size as a routed expert).

    Args:
        num_experts: physical experts over all ranks, redundant (EPLB) replicas included.
        num_local_experts: physical experts on this rank.
        experts_start_idx: first physical expert of this rank (linear placement).
        num_logical_experts: experts of the model; physical p holds logical
            ``p % num_logical_experts``.
        top_k: experts per token.
        hidden_size: H, a multiple of 128.
        intermediate_size: I, a multiple of 128.
        weight_format: run format.
        checkpoint_format: how the checkpoint stores the experts.
        num_shared_experts: shared experts fused into the kernel as extra experts.
        max_num_tokens: most tokens one forward on this rank may carry.
        process_group: expert-parallel group; None = this module alone (its forward then
            returns the sum over the experts it holds).
        backend: ``"auto"``, ``"reference"`` or ``"deepgemm"``
            (``backends.select.layer_backend``: ``"auto"`` leaves a layer DeepGEMM cannot
            run, such as sizes its kernel refuses, to the reference backend, with a warning).
        device: where the kernel tensors live (None = CPU).
        prefix: layer prefix for messages.
        emulate_kernel: reference backend only: round activations as the kernel does.
        swiglu_limit: clamp the SwiGLU inputs (gate <= L, -L <= up <= L; see
            ``megamoe.core.numerics.swiglu``) in routed and fused shared experts; None for none.
        reload_staging_bytes: the most a reload stages before it writes in place (see
            ``megamoe.core.loading.expert_loading``); None: 1/16 of the kernel tensors' bytes.
        experts_path: ``"auto"`` (the default): on one Hopper rank, calls of few tokens run
            the small-batch kernels and the rest MegaMoE, by a rule of the token count and
            the layer's shape (``megamoe.core.backends.small_batch``); ``"small_batch"``
            forces those kernels for every call (an error where they cannot run);
            ``"megamoe"`` forces the MegaMoE kernel.
        small_batch_max_tokens: the most tokens per call the small-batch path takes, and so
            what its scratch holds (about 49 KB a token for Qwen4-Exp's layer shape): None
            (the default) lets ``experts_path`` decide (the rule's crossover or, forced,
            ``max_num_tokens``), an int caps that, so larger calls run MegaMoE. Capped by
            ``max_num_tokens``; an error beside ``experts_path="megamoe"``.

    Its kernel tensors keep their format and device through ``.to()`` and the like, and it
    refuses ``load_state_dict()``, copies and pickling (``megamoe.core.modules.fixed_module``).

    Raises:
        ValueError: a size or placement that cannot run (before anything is allocated), or a
            ``small_batch_max_tokens`` below 1 or beside ``experts_path="megamoe"``.
        TypeError: a ``small_batch_max_tokens`` that is not an int.
        CapabilityError: an explicit backend that cannot run the run format here, or
            ``experts_path="small_batch"`` where the small-batch path cannot run.
    """

    def __init__(
        self,
        *,
        num_experts: int,
        num_local_experts: int,
        experts_start_idx: int,
        num_logical_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        weight_format: WeightFormat | str,
        checkpoint_format: WeightFormat | str,
        num_shared_experts: int = 0,
        max_num_tokens: int = 256,
        process_group: dist.ProcessGroup | None = None,
        backend: str = "auto",
        device: torch.device | str | None = None,
        prefix: str = "",
        emulate_kernel: bool = False,
        swiglu_limit: float | None = None,
        reload_staging_bytes: int | None = None,
        experts_path: str = "auto",
        small_batch_max_tokens: int | None = None,
    ) -> None:
        super().__init__()
        self.prefix, self.emulate_kernel, self.process_group = prefix, emulate_kernel, process_group
        self.swiglu_limit = check_swiglu_limit(swiglu_limit, prefix or type(self).__name__)
        self.weight_format = check_run_format(
            WeightFormat.parse(weight_format), prefix or type(self).__name__
        )
        self.checkpoint_format = WeightFormat.parse(checkpoint_format)
        self.layout = ExpertLayout(
            num_experts, num_local_experts, experts_start_idx, num_logical_experts, top_k,
            hidden_size, intermediate_size, num_shared_experts, max_num_tokens,
            prefix or type(self).__name__,
        )  # fmt: skip
        self.layout.check_group(process_group)
        self.num_experts, self.num_local_experts = num_experts, num_local_experts
        self.experts_start_idx, self.num_logical_experts = experts_start_idx, num_logical_experts
        self.top_k, self.hidden_size, self.intermediate_size = top_k, hidden_size, intermediate_size
        self.num_shared_experts, self.max_num_tokens = num_shared_experts, max_num_tokens
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.experts_path = check_experts_path(experts_path, prefix or type(self).__name__)
        self.small_batch_max_tokens = check_small_batch_max_tokens(
            small_batch_max_tokens, experts_path, prefix or type(self).__name__
        )
        self.backend = layer_backend(backend, self)
        forced = experts_path == PATH_SMALL_BATCH
        unavailable = self.backend.small_batch_unavailable(self) if forced else None
        if unavailable is not None:
            raise CapabilityError(
                f"{self.layout.label}: experts_path='small_batch' cannot run here: "
                f"{unavailable}; use experts_path='auto' (the small-batch path where it runs) "
                "or 'megamoe'"
            )
        self.l1_order = self.backend.l1_row_order(self)
        self.kernel_tag = KernelTag.for_format(
            self.weight_format, num_shared_experts, self.swiglu_limit, self.l1_order.group
        )
        self._allocate()
        self._init_loading(reload_staging_bytes)
        self._written: set[tuple[int, str]] = set()
        self._finalized = False
        experts_op.register(self, self.kernel_params["w13_weight"])

    def _allocate(self) -> None:
        """Zeroed kernel tensors, each tagged with the kernel tag."""
        fmt, h, i = self.weight_format, self.hidden_size, self.intermediate_size
        l1 = projection_specs(fmt, 2 * i, h, BLOCK_FP8_DEFAULT)  # gate rows, then up rows
        l2 = projection_specs(fmt, h, i, BLOCK_FP8_DEFAULT)
        groups = [("w13", "w2", self.num_local_experts)]
        if self.num_shared_experts:
            groups.append(("shared_l1", "shared_l2", self.num_shared_experts))
        for name1, name2, count in groups:
            for stem, (weight, scale) in ((name1, l1), (name2, l2)):
                for name, spec in ((f"{stem}_weight", weight), (f"{stem}_weight_scale", scale)):
                    if spec is None:
                        continue
                    data = torch.zeros((count, *spec.shape), dtype=spec.dtype, device=self.device)
                    param = torch.nn.Parameter(data, requires_grad=False)
                    tag(param, self.kernel_tag)
                    self.register_parameter(name, param)

    @property
    def fixed_label(self) -> str:
        """The layer, for ``FixedModule``'s refusals."""
        return self.layout.label

    @property
    def kernel_params(self) -> dict[str, torch.nn.Parameter]:
        """The tagged kernel tensors by name (the module's own parameters, none of a child)."""
        return self._parameters  # type: ignore[return-value]  # every entry is set, none None

    def extra_repr(self) -> str:
        """Sizes, formats and backend for ``print(module)``."""
        return (
            f"experts {self.experts_start_idx}..{self.experts_start_idx + self.num_local_experts}"
            f" of {self.num_experts}, {self.checkpoint_format.value}->{self.weight_format.value}, "
            f"H={self.hidden_size}, I={self.intermediate_size}, shared={self.num_shared_experts}, "
            f"swiglu_limit={self.swiglu_limit}, backend={self.backend.name}, "
            f"experts_path={self.experts_path}"
            + (
                ""
                if self.small_batch_max_tokens is None
                else f", small_batch_max_tokens={self.small_batch_max_tokens}"
            )
        )

    def map_global_expert_id(self, expert_id: int) -> list[int]:
        """Local slots holding logical expert ``expert_id`` (empty when other ranks hold it).

        Raises:
            ValueError: ``expert_id`` is not a logical expert of the model.
        """
        return self.layout.map_global_expert_id(expert_id)

    # -- finalize / forward ----------------------------------------------------------------

    def _prepare_update(self) -> None:
        """Called first by ``finalize()``: subclasses that defer conversion stage it here.

        A subclass that keeps shards aside in ``_on_shard_complete`` converts them here and
        hands each to ``_write_shard``; errors raised here discard the pending update.
        """

    def _mark_written(self, slot: int, shard_id: str) -> None:
        """Record that a subclass wrote shard ``shard_id`` of kernel slot ``slot`` in place.

        ``finalize()`` then counts the shard as present.
        """
        self._written.add((slot, shard_id))

    def _invalidate(self) -> None:
        """Refuse ``forward`` until the next ``finalize()``.

        For subclasses that change kernel tensors in place, leaving them inconsistent until
        they are done.
        """
        self._finalized = False

    def finalize(self) -> None:
        """Commit the pending update in place and let the backend redo the changed experts.

        Idempotent: with nothing pending it does nothing. Kernel tensors keep their storage
        (``data_ptr``), so addresses captured by CUDA graphs stay valid.

        Raises:
            IncompleteShardsError: a shard received only its weight or only its scale (the
                update stays pending: load the missing halves and finalize again).
            MissingExpertsError: names the kernel slots never written (update stays pending),
                or the shards a failed reload wrote in place that no update rewrote yet.
        """
        with self.loading():
            self._prepare_update()
        self._pairing.check_complete()
        self._run_pairing.check_complete()
        changed_shards = self._pending.keys() | self._direct | self._in_place
        # Only a committed update repairs: an attempt that fails here and is then
        # discarded leaves its shards as the failed reload wrote them.
        unrepaired = self._unrepaired - changed_shards
        if unrepaired:
            listed = format_keys(
                f"{self.layout.slot_label(s)}: {SHARD_TO_PROJ[sh]}" for s, sh in sorted(unrepaired)
            )
            raise MissingExpertsError(
                f"{self.layout.label}: a reload that failed had written "
                f"{len(unrepaired)} shard(s) in place, beyond reload_staging_bytes="
                f"{self.reload_staging_bytes}: {listed}; the layer serves nothing until they "
                "are loaded again (load the whole update again, then finalize())"
            )
        present = self._written | changed_shards
        missing: dict[int, list[str]] = {}
        for slot in range(self.layout.num_slots):
            for shard_id in SHARD_IDS:
                if (slot, shard_id) not in present:
                    missing.setdefault(slot, []).append(shard_id)
        if missing:
            listed = format_keys(
                f"{self.layout.slot_label(s)}: {'+'.join(SHARD_TO_PROJ[sh] for sh in v)}"
                for s, v in missing.items()
            )
            raise MissingExpertsError(
                f"{self.layout.label}: {len(missing)} kernel slot(s) never received their "
                f"tensors: {listed}; load them before finalize()"
            )
        for (slot, shard_id), (weight, scale) in self._pending.take():
            self._commit(slot, shard_id, weight, scale)
        self._unrepaired = unrepaired
        self._written |= changed_shards
        self._direct.clear()
        self._in_place.clear()
        changed = sorted({slot for slot, _ in changed_shards} | self._rewritten_slots())
        if changed:
            self.backend.prepare(self, changed)
        self._finalized = self._serving = True

    def _rewritten_slots(self) -> set[int]:
        """Slots a subclass rewrote in place since the last ``finalize()`` (none here).

        ``finalize()`` has the backend prepare them with the changed ones, once every check
        passed.
        """
        return set()

    def dispatch_buffer(self, hidden_states: torch.Tensor) -> DispatchBuffer | None:
        """Where a router kernel may write this forward's kernel inputs, else None.

        A buffer (``backends.base.DispatchBuffer``) where the backend keeps one (DeepGEMM's
        Hopper kernel), once finalized, for a call of 1 to ``max_num_tokens`` tokens that
        ``torch.compile`` is not tracing (the custom op takes the routing as its
        arguments). A router that writes it is followed by ``forward(..., dispatched=True)``
        on the same stream, before anything else uses the buffer (it is shared by the
        layers of one shape).
        """
        tokens = hidden_states.shape[0]
        if (
            not self._finalized
            or not 0 < tokens <= self.max_num_tokens
            or torch.compiler.is_compiling()
        ):
            return None
        return self.backend.dispatch_buffer(self)

    def forward(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        *,
        dispatched: bool = False,
    ) -> torch.Tensor:
        """Routed (plus fused shared) expert output for this rank's tokens.

        Args:
            hidden_states: (T, H) bfloat16, ``T <= max_num_tokens``.
            topk_weights: (T, top_k) float32.
            topk_ids: (T, top_k) int32/int64 physical expert ids, -1 = unused slot.
            dispatched: the router kernel wrote these tokens and this routing into
                :meth:`dispatch_buffer` (given for this call): the backend launches the
                kernel on them without its own pre-dispatch.

        Returns:
            (T, H) bfloat16.

        Under ``torch.compile`` the backend runs inside one opaque custom op
        (``megamoe.core.modules.experts_op``), so the call traces with ``fullgraph=True``; eager
        calls it directly. This method itself only checks metadata (no host sync).

        Raises:
            RuntimeError: ``finalize()`` has not completed yet, or ``dispatched`` where
                :meth:`dispatch_buffer` gives none.
            ValueError: a shape that does not match, or too many tokens.
            TypeError: a dtype that does not match.
            FormatMismatchError: kernel tensors or backend buffers of another format.
        """
        if not self._finalized:
            raise RuntimeError(
                f"{self.layout.label}: forward() before finalize(); load the weights, then "
                "call finalize()"
            )
        self.layout.check_forward(hidden_states, topk_weights, topk_ids)
        if dispatched:
            if self.dispatch_buffer(hidden_states) is None:
                raise RuntimeError(
                    f"{self.layout.label}: forward(dispatched=True), but this call has no "
                    "dispatch buffer (dispatch_buffer() gave None); call forward() without it"
                )
            check_tags(self.kernel_tag, self.kernel_params, self.layout.label)
            return self.backend.forward_dispatched(self, hidden_states.shape[0])
        if not torch.compiler.is_compiling():  # eager: no dispatcher round trip
            return self.run_backend(hidden_states, topk_weights, topk_ids)
        return experts_op.experts(hidden_states, topk_weights, topk_ids, self.w13_weight)

    def run_backend(
        self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """The backend's forward after the format-tag check (the custom op's body).

        Raises:
            FormatMismatchError: kernel tensors or backend buffers of another format.
        """
        check_tags(self.kernel_tag, self.kernel_params, self.layout.label)
        return self.backend.forward(self, hidden_states, topk_weights, topk_ids)
