"""GLM-5.3-Flash routed (and fused shared) experts from a block-FP8 checkpoint (SPEC §4.2).

Where the run format is MXFP8 (SM100, or forced), the first load (before the module
serves) needs no conversion buffer: a block-FP8 shard's E4M3 weight has the same dtype in
both formats, so it is written straight into the kernel tensor and its float32 block scale
is staged beside it in ``*_weight_scale_inv`` (freed by the first successful
``finalize()``: 0.024% of the experts' bytes). Once the load is complete,
``requantize_block_fp8`` rounds every shard written since the last call to UE8M0 1x32
scales in place, a few experts at a time, with ``megamoe.core.numerics.quant.requantize`` (so the
bits equal an offline conversion). A first load that fails forgets those shards:
``finalize()`` then names the slots never written (``MissingExpertsError``).

A reload (after a successful ``finalize()``) takes the ``MegaMoEExperts`` path: each shard is
requantized as it completes (``requantize_shard``, the same bits) and staged in MXFP8 until
``finalize()``, up to ``reload_staging_bytes`` (``megamoe.core.loading.expert_loading``); beyond
that budget shards are written in place. A reload that fails midway leaves the previous weights
serving when it stayed within the budget; otherwise the layer refuses to serve until the shards
it wrote are loaded again. Every other checkpoint/run pair (FP8_BLOCK run on Hopper: stored as
is; BF16 or MX checkpoints) takes the ``MegaMoEExperts`` path always.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from megamoe.core.loading.expert_loading import WEIGHT, split_shared_shard
from megamoe.core.loading.pairing import PROJ_TO_SHARD, SHARD_DOWN, SHARD_GATE, SHARD_UP, ShardKey
from megamoe.core.modules.experts import MegaMoEExperts
from megamoe.core.numerics import quant
from megamoe.core.numerics.formats import BLOCK_FP8_DEFAULT, WeightFormat

# Experts requantized per step: bounds the temporaries (source copy, result, float32
# workspace) to a few experts' worth, whatever the number of experts.
DEFAULT_REQUANT_CHUNK = 8
BLOCK_SCALE = "weight_scale_inv"  # checkpoint (and staging) name of a block-FP8 scale
KEEP_BLOCK_FP8_HINT = 'moe_format="fp8_block"'  # the option that avoids requantization

_RowPlan = dict[tuple[str, int, int], list[tuple[int, int, tuple[str, ...]]]]


class Glm5NextMegaMoEExperts(MegaMoEExperts):
    """This rank's GLM-5.3-Flash experts, loaded from block-FP8 into the run format.

    With a block-FP8 checkpoint and the MXFP8 run format, the first load writes each
    weight shard into ``w13_weight`` / ``w2_weight`` (``shared_l1_weight`` /
    ``shared_l2_weight``) as soon as its weight and block scale are both in, and the block
    scale into ``w13_weight_scale_inv`` (E, 2I/128, H/128), ``w2_weight_scale_inv`` (E,
    H/128, I/128) (and ``shared_l1_weight_scale_inv`` / ``shared_l2_weight_scale_inv``),
    float32 buffers. ``requantize_block_fp8()`` then rounds the new shards in place;
    ``finalize()`` calls it first. Once the module serves, a reload is requantized shard by
    shard and staged (``MegaMoEExperts``), so the served weights change only at
    ``finalize()``.

    Args:
        hidden_size: H; a multiple of 128 and of the block size.
        intermediate_size: I; a multiple of 128 and of the block size.
        weight_block_size: rows x columns of one block-FP8 scale in the checkpoint.
        **kwargs: the other ``MegaMoEExperts`` arguments (``num_experts``,
            ``weight_format``, ``checkpoint_format``, ``num_shared_experts``, ...).

    Raises:
        ValueError: a hidden or intermediate size that breaks the block rule (checked
            before anything is allocated), or as ``MegaMoEExperts``.
        NotImplementedError: a block size other than 128x128 (what MegaMoE and the
            checkpoint reader use).
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        intermediate_size: int,
        weight_block_size: Sequence[int] = BLOCK_FP8_DEFAULT,
        **kwargs: Any,
    ) -> None:
        prefix = kwargs.get("prefix") or type(self).__name__
        block = (int(weight_block_size[0]), int(weight_block_size[-1]))
        if block != BLOCK_FP8_DEFAULT:
            raise NotImplementedError(
                f"{prefix}: weight_block_size={list(block)} is not supported; GLM-5.3-Flash "
                f"block-FP8 experts use {list(BLOCK_FP8_DEFAULT)}"
            )
        for option, size in (
            ("hidden_size", hidden_size),
            ("intermediate_size", intermediate_size),
        ):
            if size <= 0 or size % 128 or size % block[0] or size % block[1]:
                raise ValueError(
                    f"{prefix}: {option}={size} must be a positive multiple of 128 and of "
                    f"weight_block_size={list(block)} (kernel tiles and block-FP8 scales)"
                )
        super().__init__(hidden_size=hidden_size, intermediate_size=intermediate_size, **kwargs)
        self.weight_block_size = block
        self.requantizes_in_place = (
            self.checkpoint_format is WeightFormat.FP8_BLOCK
            and self.weight_format is WeightFormat.MXFP8
        )
        # Kernel (slot, shard id) written in place since the last requantize_block_fp8().
        self._new_shards: set[tuple[int, str]] = set()
        # Kernel slots requantized in place that the backend has not prepared yet.
        self._requantized_slots: set[int] = set()
        if self.requantizes_in_place:
            self._register_block_scales()

    def _register_block_scales(self) -> None:
        """Zeroed float32 staging buffers for the checkpoint's block scales."""
        h, i = self.hidden_size, self.intermediate_size
        bm, bk = self.weight_block_size
        groups = [("w13", "w2", self.num_local_experts)]
        if self.num_shared_experts:
            groups.append(("shared_l1", "shared_l2", self.num_shared_experts))
        for l1, l2, count in groups:
            for stem, rows, cols in ((l1, 2 * i, h), (l2, h, i)):
                scale = torch.zeros(
                    (count, rows // bm, cols // bk), dtype=torch.float32, device=self.device
                )
                self.register_buffer(f"{stem}_{BLOCK_SCALE}", scale, persistent=False)

    # -- loading ---------------------------------------------------------------------------

    def load_shared_expert_weight(self, name: str, tensor: torch.Tensor) -> set[str]:
        """Load one tensor of the fused shared expert(s).

        Args:
            name: relative to the layer's ``shared_experts`` module:
                ``{gate,up,down}_proj.{weight,<scale name>}``.
            tensor: (S*I, H) for gate/up, (H, S*I) for down, or its scale.

        Returns:
            Kernel parameter names the completed shard went to (empty while it waits for
            its other half).

        Raises:
            ValueError: an unexpected name (naming the expected pattern), no fused shared
                expert, or a shape or dtype that does not match.
            NonFiniteError: the tensor holds NaN or infinity.
        """
        proj, _, kind = name.partition(".")
        if proj not in PROJ_TO_SHARD or kind not in self.checkpoint_halves:
            raise ValueError(
                f"{self.layout.label}: unexpected shared-expert tensor {name!r}; expected "
                f"{{gate,up,down}}_proj.{{{','.join(self.checkpoint_halves)}}} "
                f"({self.checkpoint_format.value} checkpoint)"
            )
        return self.load_shared_expert_tensor(PROJ_TO_SHARD[proj], kind, tensor)

    def _on_shard_complete(self, key: ShardKey, parts: dict[str, torch.Tensor]) -> None:
        """Write a complete block-FP8 shard into place and stage its block scale.

        Only before the module serves: a reload is converted and staged by
        ``MegaMoEExperts`` (written in place, a failed reload would leave the served
        tensors half updated).
        """
        if not self.requantizes_in_place:
            super()._on_shard_complete(key, parts)
            return
        if self._serving:
            if not quant.is_power_of_two(parts[BLOCK_SCALE]):
                quant.warn_not_power_of_two(
                    self.layout.label, KEEP_BLOCK_FP8_HINT, self.weight_format
                )
            super()._on_shard_complete(key, parts)
            return
        slot, shard_id = key
        weight, scale = parts[WEIGHT], parts[BLOCK_SCALE]
        if slot is None:
            n = self.num_shared_experts
            targets = [
                (
                    self.num_local_experts + s,
                    split_shared_shard(weight, n, s, shard_id),
                    split_shared_shard(scale, n, s, shard_id),
                )
                for s in range(n)
            ]
        else:
            replicas = self.layout.map_global_expert_id(self.layout.logical_of(slot))
            targets = [(r, weight, scale) for r in replicas]
        # From here until requantize_block_fp8() the kernel tensors are inconsistent.
        self._invalidate()
        for target, part_weight, part_scale in targets:
            self._write_block_shard(target, shard_id, part_weight, part_scale)
            self._new_shards.add((target, shard_id))

    def _write_block_shard(
        self, slot: int, shard_id: str, weight: torch.Tensor, scale: torch.Tensor
    ) -> None:
        """Write one slot's E4M3 shard into the kernel weight, its block scale aside."""
        stem, index = self.layout.slot_param(slot, shard_id)
        stored = getattr(self, f"{stem}_weight").data[index]
        staged = getattr(self, f"{stem}_{BLOCK_SCALE}")[index]
        if shard_id == SHARD_DOWN:
            stored.copy_(weight)
            staged.copy_(scale)
            return
        self.l1_order.write(stored, shard_id, weight)
        scale_rows = self.intermediate_size // self.weight_block_size[0]
        (staged[:scale_rows] if shard_id == SHARD_GATE else staged[scale_rows:]).copy_(scale)

    def _rows(self, stem: str, r0: int, r1: int) -> tuple[str, ...]:
        """The shards rows ``r0:r1`` of a ``stem`` weight cover (empty for l2 weights)."""
        if stem not in ("w13", "shared_l1"):
            return ()
        i = self.intermediate_size
        return tuple(sh for sh, lo in ((SHARD_GATE, 0), (SHARD_UP, i)) if r0 <= lo < r1)

    def _read_rows(self, stem: str, weight: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
        """Canonical rows ``r0:r1`` of one slot's stored ``stem`` weight (a copy if reordered)."""
        shards = self._rows(stem, r0, r1)
        if not shards:
            return weight[r0:r1]
        return torch.cat([self.l1_order.read(weight, sh) for sh in shards])

    def _write_rows(
        self, stem: str, weight: torch.Tensor, r0: int, r1: int, value: torch.Tensor
    ) -> None:
        """Write canonical rows ``r0:r1`` of one slot's stored ``stem`` weight."""
        shards = self._rows(stem, r0, r1)
        if not shards:
            weight[r0:r1].copy_(value)
            return
        for sh, part in zip(shards, value.chunk(len(shards)), strict=True):
            self.l1_order.write(weight, sh, part)

    # -- requantization --------------------------------------------------------------------

    def discard_pending(self) -> None:
        """Forget every tensor loaded since the last ``finalize()``, in-place shards included.

        Shards written in place belong to a first load that never finalized: forgetting
        them makes ``finalize()`` name their slots as missing instead of serving them.
        """
        super().discard_pending()
        self._new_shards.clear()
        if not self._serving:  # what _mark_written recorded came from this load alone
            self._written.clear()
            self._requantized_slots.clear()

    @property
    def pending_requantization(self) -> set[tuple[int, str]]:
        """Kernel ``(slot, shard id)`` written in place and not yet requantized."""
        return set(self._new_shards)

    @torch.no_grad()
    def requantize_block_fp8(self, chunk: int = DEFAULT_REQUANT_CHUNK) -> None:
        """Round every shard written since the last call to MXFP8 (UE8M0 1x32), in place.

        Call it once the first load is complete: a weight and its block scale may come in
        different ``load_weights`` calls, but both must be in by now. Works
        ``chunk`` experts at a time, so the float32 workspace stays bounded; the result
        equals ``quant.requantize(weight, scale, FP8_BLOCK, MXFP8)`` bit for bit. Block
        scales that are not powers of two change the weights when rounded: that is warned
        once, naming ``moe_format="fp8_block"``, which keeps block-FP8. Without in-place
        requantization (any other checkpoint/run pair, or a reload, which is requantized
        as it loads) it only checks completeness.

        Args:
            chunk: experts per ``quant.requantize`` call (>= 1).

        Raises:
            ValueError: ``chunk`` < 1.
            IncompleteShardsError: shards that received only their weight or only their
                scale, named as (local expert, shard), None for the shared expert; the
                update stays pending (load the missing halves and call again).
        """
        if chunk < 1:
            raise ValueError(f"{self.layout.label}: chunk={chunk} must be >= 1 (experts per step)")
        self._check_checkpoint_pairs()
        if not self._new_shards:
            return
        params = self.kernel_params
        for (stem, r0, r1), items in sorted(self._row_plan().items()):
            weight, mx_scale = params[f"{stem}_weight"].data, params[f"{stem}_weight_scale"].data
            block_scale = getattr(self, f"{stem}_{BLOCK_SCALE}")
            b0, b1 = r0 // self.weight_block_size[0], r1 // self.weight_block_size[0]
            for start in range(0, len(items), chunk):
                part = items[start : start + chunk]
                src_weight = torch.stack(
                    [self._read_rows(stem, weight[index], r0, r1) for _, index, _ in part]
                )
                src_scale = torch.stack([block_scale[index, b0:b1] for _, index, _ in part])
                if not quant.is_power_of_two(src_scale):
                    quant.warn_not_power_of_two(
                        self.layout.label, KEEP_BLOCK_FP8_HINT, self.weight_format
                    )
                new_weight, new_scale = quant.requantize(
                    src_weight,
                    src_scale,
                    WeightFormat.FP8_BLOCK,
                    WeightFormat.MXFP8,
                    block_size=self.weight_block_size,
                    name=f"{self.layout.label} {stem}[{r0}:{r1}]",
                )
                for j, (slot, index, shard_ids) in enumerate(part):
                    self._write_rows(stem, weight[index], r0, r1, new_weight[j])
                    mx_scale[index, r0:r1].copy_(new_scale[j])
                    for shard_id in shard_ids:
                        self._new_shards.discard((slot, shard_id))
                        self._mark_written(slot, shard_id)
                    self._requantized_slots.add(slot)

    def _row_plan(self) -> _RowPlan:
        """New shards grouped by (parameter stem, first row, end row).

        A slot whose gate and up shards are both new is requantized as one 2I-row range;
        rows are independent in MXFP8, so the bits do not depend on this grouping.
        """
        plan: _RowPlan = {}
        i, h = self.intermediate_size, self.hidden_size
        for slot in sorted({s for s, _ in self._new_shards}):
            shards = {sh for s, sh in self._new_shards if s == slot}
            l1 = tuple(sh for sh in (SHARD_GATE, SHARD_UP) if sh in shards)
            if l1:
                r0 = 0 if SHARD_GATE in l1 else i
                r1 = i if l1 == (SHARD_GATE,) else 2 * i
                stem, index = self.layout.slot_param(slot, l1[0])
                plan.setdefault((stem, r0, r1), []).append((slot, index, l1))
            if SHARD_DOWN in shards:
                stem, index = self.layout.slot_param(slot, SHARD_DOWN)
                plan.setdefault((stem, 0, h), []).append((slot, index, (SHARD_DOWN,)))
        return plan

    def finalize(self) -> None:
        """Requantize what is new, then commit and prepare as ``MegaMoEExperts.finalize``.

        Raises:
            IncompleteShardsError: see ``requantize_block_fp8``.
            MissingExpertsError: kernel slots that never received their tensors.
        """
        self.requantize_block_fp8()
        super().finalize()  # prepares the requantized slots too, once every check passed
        self._requantized_slots.clear()
        self._release_block_scales()

    def _rewritten_slots(self) -> set[int]:
        """The slots requantized in place that the backend has not prepared yet."""
        return set(self._requantized_slots)

    def _release_block_scales(self) -> None:
        """Free the staged block scales once serving: a reload is requantized as it loads."""
        for name, staged in list(self.named_buffers(recurse=False)):
            if name.endswith(BLOCK_SCALE) and staged.numel():
                setattr(self, name, staged.new_empty((0, *staged.shape[1:])))
