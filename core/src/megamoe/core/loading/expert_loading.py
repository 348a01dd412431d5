"""The loading half of ``MegaMoEExperts``: checks, pairing, conversion and staging.

Each checkpoint tensor's dtype and shape are checked where it arrives; it is copied to the
module's device once and its NaN/inf are counted there (``DeviceArrival``: the counts are
read back once, when the outermost ``load_*`` call returns; the error names every bad
tensor). A quantized weight is paired with its scale (``ShardPairing``) and the complete
shard is converted to the run format on the device (a Triton conversion reports its
non-finite flag to the same ledger). Before the module first serves (its first
``finalize()``), shards are written straight into the kernel tensors; afterwards they are
staged (``PendingUpdate``) and ``finalize()`` commits them.

Reloads and their memory bound: a reload stages at most ``reload_staging_bytes`` of
run-format shards (default ``RELOAD_STAGING_SHARE`` of the layer's kernel bytes). An
update that fits keeps the previous weights serving whatever happens: any error discards
it. A larger one writes its staged shards in place each time the budget fills, after
reading back the checks of every tensor loaded so far (one host sync), so nothing
unchecked is ever written; ``forward`` then refuses until ``finalize()`` completes the
update. If such an update fails after its first in-place write, the layer keeps refusing
to serve and ``finalize()`` names the shards it wrote in place until they are loaded
again: a half update is never served.

Memory between ``load_*`` calls and ``finalize()``, beyond the kernel tensors: checkpoint
halves waiting for their partner (at most ``arrival.UNPAIRED_DEVICE_SHARE`` of the kernel
bytes on the device), one shard's conversion workspace and, during a reload, at most
``reload_staging_bytes`` staged.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterable, Iterator

import torch

from megamoe.core.checkpoint import nvfp4
from megamoe.core.checkpoint.expert_names import (
    FUSED_DOWN,
    FUSED_GATE_UP,
    GLOBAL_SCALE,
    checkpoint_kinds,
    pairing_kinds,
    parse_expert_name,
)
from megamoe.core.errors import refuse_meta_tensor
from megamoe.core.loading.arrival import DeviceArrival
from megamoe.core.loading.expert_layout import ExpertLayout, Specs
from megamoe.core.loading.finiteness import mx_scale_limit
from megamoe.core.loading.l1_order import L1RowOrder
from megamoe.core.loading.pairing import (
    PROJ_TO_SHARD,
    SHARD_DOWN,
    SHARD_GATE,
    SHARD_IDS,
    SHARD_TO_PROJ,
    SHARD_UP,
    ShardKey,
    ShardPairing,
)
from megamoe.core.loading.staging import PendingUpdate
from megamoe.core.numerics import quant
from megamoe.core.numerics.formats import BLOCK_FP8_DEFAULT, WeightFormat

SCALE = "scale"  # kind of a run-format scale half handed to weight_loader
WEIGHT = "weight"
RELOAD_STAGING_SHARE = 1 / 16  # default reload staging budget, of the kernel tensors' bytes
# reload_staging_bytes that stages any reload whole: a failed one always leaves the previous
# weights serving, at the cost of a second copy of the weights during a full reload.
STAGE_WHOLE_RELOAD = 1 << 62


class ExpertLoading(abc.ABC):
    """Loading API and subclass hooks of ``MegaMoEExperts`` (which sets the attributes)."""

    layout: ExpertLayout
    weight_format: WeightFormat
    checkpoint_format: WeightFormat
    device: torch.device
    num_local_experts: int
    num_shared_experts: int
    hidden_size: int
    intermediate_size: int
    l1_order: L1RowOrder

    @property
    @abc.abstractmethod
    def kernel_params(self) -> dict[str, torch.nn.Parameter]:
        """The kernel tensors by name."""

    @abc.abstractmethod
    def _invalidate(self) -> None:
        """Refuse ``forward`` until the next ``finalize()``."""

    def _init_loading(self, reload_staging_bytes: int | None = None) -> None:
        """Empty pairings and an empty pending update (called by the constructor).

        Args:
            reload_staging_bytes: most bytes a reload stages before it writes in place;
                None takes ``RELOAD_STAGING_SHARE`` of the kernel tensors' bytes.
        """
        self._ckpt_halves = pairing_kinds(self.checkpoint_format)
        run_scaled = self.weight_format.scale_name is not None
        self._pairing = ShardPairing(self._ckpt_halves, prefix=self.layout.label)
        self._run_pairing = ShardPairing(
            (WEIGHT, SCALE) if run_scaled else (WEIGHT,),
            prefix=f"{self.layout.label} (weight_loader)",
        )
        self._pending = PendingUpdate()
        self._direct: set[tuple[int, str]] = set()  # written in place before first serving
        self._serving = False
        kernel_bytes = sum(p.nbytes for p in self.kernel_params.values())
        self._arrival = DeviceArrival(self.device, self.layout.label, kernel_bytes)
        self._guard_depth = 0
        if reload_staging_bytes is not None and reload_staging_bytes < 0:
            raise ValueError(
                f"{self.layout.label}: reload_staging_bytes={reload_staging_bytes} must be "
                ">= 0 (0 writes every reloaded shard in place)"
            )
        self.reload_staging_bytes = (
            int(RELOAD_STAGING_SHARE * kernel_bytes)
            if reload_staging_bytes is None
            else reload_staging_bytes
        )
        # Shards the current reload wrote in place (over budget), and those a failed one
        # wrote and no update has rewritten yet: finalize() refuses while any remain.
        self._in_place: set[tuple[int, str]] = set()
        self._unrepaired: set[tuple[int, str]] = set()

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        """One load call, however many ``load_weights`` calls it makes (a block's).

        The non-finite counts are read back once, when the outermost ends (one host sync on
        a GPU), and any error (a bad tensor, non-finite values found at the end) discards
        the pending update, so the previous weights keep serving.
        """
        self._guard_depth += 1
        try:
            yield
            if self._guard_depth == 1:
                self._arrival.ledger.check()
        except BaseException:
            self.discard_pending()
            raise
        finally:
            self._guard_depth -= 1

    def discard_pending(self) -> None:
        """Forget every tensor loaded since the last ``finalize()``.

        Shards a reload already wrote in place (beyond its staging budget) cannot be taken
        back: they are remembered, and ``finalize()`` refuses until they are loaded again.
        """
        self._unrepaired |= self._in_place
        self._in_place.clear()
        self._pairing.clear()
        self._run_pairing.clear()
        self._pending.clear()
        self._direct.clear()
        self._arrival.ledger.clear()

    @property
    def pending_bytes(self) -> int:
        """Device bytes held by the pending update (at most ``reload_staging_bytes``)."""
        return self._pending.nbytes()

    @property
    def unrepaired_shards(self) -> set[tuple[int, str]]:
        """``(slot, shard id)`` a failed reload wrote in place and no update rewrote since."""
        return set(self._unrepaired)

    def _write_in_place(self) -> None:
        """Over budget: check every tensor loaded so far, then write the staged shards in place.

        From here until ``finalize()`` the layer refuses ``forward`` (part of it is new).

        Raises:
            NonFiniteError / InvalidScaleError: a tensor loaded so far is bad; nothing has
                been written then.
        """
        self._arrival.ledger.check()
        self._invalidate()
        for (slot, shard_id), (weight, scale) in self._pending.take():
            self._commit(slot, shard_id, weight, scale)
            self._in_place.add((slot, shard_id))

    @property
    def checkpoint_halves(self) -> tuple[str, ...]:
        """Tensor kinds that complete one checkpoint shard: ``weight`` and the scale name."""
        return self._ckpt_halves

    def _check_checkpoint_pairs(self) -> None:
        """Raise ``IncompleteShardsError`` for checkpoint shards still missing a half.

        For subclasses that write complete shards in place themselves (``finalize()`` runs
        the same check first).
        """
        self._pairing.check_complete()

    def weight_loader(
        self,
        param: torch.nn.Parameter,
        tensor: torch.Tensor,
        name: str,
        shard_id: str,
        expert_id: int,
    ) -> bool:
        """Stage one run-format half (weight or scale) of one shard (engine-style loader).

        Args:
            param: one of ``kernel_params``.
            tensor: the weight or scale of one shard, already in the run format.
            name: the tensor's name, for messages.
            shard_id: ``w1`` or ``w3`` for ``w13_*`` / ``shared_l1_*``, ``w2`` for the others.
            expert_id: local slot (routed tensors) or shared-expert index (shared tensors).

        Returns:
            True when this call completed the shard (weight and scale both in), False while
            its other half is still missing.

        Raises:
            ValueError: a foreign parameter, a wrong shard id or slot, or a shape or dtype
                that does not match (the message names both).
            NonFiniteError: the tensor holds NaN or infinity.
        """
        label = self.layout.label
        with self.loading():
            pname = next((n for n, p in self.kernel_params.items() if p is param), None)
            if pname is None:
                raise ValueError(f"{label}: {name}: param is not a kernel parameter of this module")
            shared, down = pname.startswith("shared_"), pname.startswith(("w2", "shared_l2"))
            allowed = (SHARD_DOWN,) if down else ("w1", "w3")
            if shard_id not in allowed:
                raise ValueError(
                    f"{label}: {name}: shard_id {shard_id!r} is not one of {allowed} ({pname})"
                )
            count = self.num_shared_experts if shared else self.num_local_experts
            if not 0 <= expert_id < count:
                raise ValueError(
                    f"{label}: {name}: expert_id {expert_id} is out of range [0, {count}) "
                    f"for {pname}"
                )
            kind = SCALE if pname.endswith("_scale") else WEIGHT
            fmt = self.weight_format
            self._check_spec(name, tensor, fmt, self.layout.specs(fmt, shard_id), kind)
            slot = expert_id + (self.num_local_experts if shared else 0)
            ue8m0_from = mx_scale_limit(fmt) if kind == SCALE else None
            block_scale = kind == SCALE and fmt is WeightFormat.FP8_BLOCK
            parts = self._arrival.arrive(
                self._run_pairing,
                (slot, shard_id),
                kind,
                tensor,
                name,
                ue8m0_from=ue8m0_from,
                block_scale=block_scale,
            )
            if parts is None:
                return False
            scale = parts.get(SCALE)
            staged = self._serving
            weight = self._arrival.kept(parts[WEIGHT], staged=staged)
            kept_scale = None if scale is None else self._arrival.kept(scale, staged=staged)
            self._write_shard(slot, shard_id, weight, kept_scale)
            return True

    def load_expert_tensor(
        self, expert_id: int, shard_id: str, kind: str, tensor: torch.Tensor
    ) -> set[str]:
        """Load one checkpoint tensor of routed logical expert ``expert_id``.

        Args:
            expert_id: logical expert id; tensors of experts on other ranks are skipped.
            shard_id: ``w1`` (gate), ``w3`` (up) or ``w2`` (down).
            kind: ``"weight"`` or the checkpoint format's scale name.
            tensor: (I, H) for gate/up, (H, I) for down, in the checkpoint's encoding.

        Returns:
            Kernel parameter names staged by this call (empty while the shard waits for its
            other half, or for a non-local expert).

        Raises:
            ValueError: an unknown shard id or kind, an expert id out of range, a shape or
                dtype that does not match.
            NonFiniteError: the tensor holds NaN or infinity.
        """
        with self.loading():
            slots = self.layout.map_global_expert_id(expert_id)
            if not slots:
                return set()
            return self._load_source((slots[0], shard_id), kind, tensor, f"expert {expert_id}")

    def load_shared_expert_tensor(self, shard_id: str, kind: str, tensor: torch.Tensor) -> set[str]:
        """Load one checkpoint tensor of the shared MLP, fused as the shared expert(s).

        The checkpoint's shared MLP has intermediate size ``S * I``; it is split along that
        dimension into the S fused shared experts.

        Args:
            shard_id: ``w1``, ``w3`` or ``w2``.
            kind: ``"weight"`` or the checkpoint format's scale name.
            tensor: (S*I, H) for gate/up, (H, S*I) for down.

        Returns:
            Kernel parameter names staged by this call.

        Raises:
            ValueError: the module has no fused shared expert, or as ``load_expert_tensor``.
            NonFiniteError: the tensor holds NaN or infinity.
        """
        with self.loading():
            if not self.num_shared_experts:
                raise ValueError(
                    f"{self.layout.label}: built with num_shared_experts=0; pass "
                    "num_shared_experts>0 to fuse the shared expert"
                )
            return self._load_source((None, shard_id), kind, tensor, "shared expert")

    def expected_names(self) -> str:
        """The tensor-name pattern ``load_weights`` takes, for messages."""
        kinds = set(checkpoint_kinds(self.checkpoint_format))
        pattern = "{expert}.{gate,up,down}_proj.{" + ",".join(sorted(kinds)) + "}"
        if self.checkpoint_format is WeightFormat.BF16:
            pattern += f" or fused {FUSED_GATE_UP} / {FUSED_DOWN}"
        num = self.layout.num_logical_experts
        return f"{pattern} ({{expert}}: a decimal id in [0, {num}), no leading zeros)"

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load ``{expert}.{gate,up,down}_proj.{weight,<scale name>}`` tensors.

        ``weight_packed`` is accepted as the weight of an MXFP4 checkpoint; BF16 checkpoints
        may give the fused ``gate_up_proj`` (E, 2I, H; gate rows first) and ``down_proj``
        (E, H, I) instead, of which only this rank's experts are kept. May be called any
        number of times with any subset, chunked and in any order; ``finalize()`` applies
        the update. Any error discards the pending update (the previous weights keep
        serving).

        Args:
            weights: ``(name relative to the experts prefix, tensor)`` pairs.

        Returns:
            The names accepted (other ranks' experts included: they are skipped).

        Raises:
            ValueError: an unexpected name (naming it and the expected pattern), a fused
                tensor of a quantized checkpoint, or as ``load_expert_tensor``.
            NonFiniteError: a tensor holds NaN or infinity.
        """
        kinds = set(checkpoint_kinds(self.checkpoint_format))
        accepted: set[str] = set()
        with self.loading():
            for name, tensor in weights:
                parsed = parse_expert_name(name)
                if parsed is None or not (parsed.is_fused or parsed.kind in kinds):
                    raise ValueError(
                        f"{self.layout.label}: unexpected {self.checkpoint_format.value} "
                        f"expert tensor {name!r}; expected {self.expected_names()}"
                    )
                if parsed.expert is None:
                    self._load_fused(parsed.proj, tensor)
                else:
                    kind = WEIGHT if parsed.is_weight else parsed.kind
                    self.load_expert_tensor(parsed.expert, PROJ_TO_SHARD[parsed.proj], kind, tensor)
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
        layout = self.layout
        num, inter, hidden = layout.num_logical_experts, self.intermediate_size, self.hidden_size
        want = (num, 2 * inter, hidden) if proj == FUSED_GATE_UP else (num, hidden, inter)
        if tuple(tensor.shape) != want:
            dims = "(E, 2I, H)" if proj == FUSED_GATE_UP else "(E, H, I)"
            raise ValueError(
                f"{layout.label}: fused {proj} has shape {tuple(tensor.shape)}, expected "
                f"{want} = {dims} for E={num} logical experts, H={hidden}, I={inter}"
            )
        for expert in range(num):
            if not layout.map_global_expert_id(expert):
                continue
            if proj == FUSED_DOWN:
                self.load_expert_tensor(expert, SHARD_DOWN, WEIGHT, tensor[expert])
                continue
            gate, up = tensor[expert].split(inter)
            self.load_expert_tensor(expert, SHARD_GATE, WEIGHT, gate)
            self.load_expert_tensor(expert, SHARD_UP, WEIGHT, up)

    def _load_source(self, key: ShardKey, kind: str, tensor: torch.Tensor, what: str) -> set[str]:
        """Check one checkpoint half, pair it, and convert the shard once it is complete."""
        slot, shard_id = key
        if self.checkpoint_format is WeightFormat.NVFP4:  # one global-scale kind, no input scales
            half = nvfp4.loaded_half(kind, tensor, f"{self.layout.label}: {what} {kind}")
            if half is None:
                return set()
            kind, tensor = half
        if shard_id not in SHARD_IDS or kind not in self._ckpt_halves:
            raise ValueError(
                f"{self.layout.label}: {what}: shard id {shard_id!r} / kind {kind!r}; expected "
                f"a shard id in {SHARD_IDS} and a kind in {self._ckpt_halves}"
            )
        fmt = self.checkpoint_format
        specs = self.layout.specs(fmt, shard_id, whole_shared=slot is None)
        name = f"{what} {SHARD_TO_PROJ[shard_id]}.{kind}"
        if kind != GLOBAL_SCALE:  # loaded_half checked NVFP4's global scale
            self._check_spec(name, tensor, fmt, specs, kind)
        ue8m0_from = mx_scale_limit(fmt) if kind != WEIGHT else None
        block_scale = kind != WEIGHT and fmt is WeightFormat.FP8_BLOCK
        parts = self._arrival.arrive(
            self._pairing, key, kind, tensor, name, ue8m0_from=ue8m0_from, block_scale=block_scale
        )
        if parts is None:
            return set()
        self._on_shard_complete(key, parts)
        stem, _ = self.layout.slot_param(self.num_local_experts if slot is None else slot, shard_id)
        return {n for n in self.kernel_params if n.startswith(f"{stem}_")}

    def _check_spec(
        self, what: str, tensor: torch.Tensor, fmt: WeightFormat, specs: Specs, kind: str
    ) -> None:
        """Named dtype and shape checks of one weight or scale stored in ``fmt`` (no data read)."""
        label, is_scale = self.layout.label, kind != WEIGHT
        refuse_meta_tensor(f"{label}: {what}", tensor)
        spec = specs[1] if is_scale else specs[0]
        if spec is None:
            raise ValueError(f"{label}: {what}: {fmt.value} has no scale tensor")
        if tensor.dtype != spec.dtype:
            raise ValueError(
                f"{label}: {what} has dtype {tensor.dtype}, expected {spec.dtype} for "
                f"{fmt.value}; convert the tensor or declare the format it is stored in"
            )
        if tuple(tensor.shape) != spec.shape:
            raise ValueError(
                f"{label}: {what} has shape {tuple(tensor.shape)}, expected {spec.shape} for "
                f"{fmt.value} (H={self.hidden_size}, I={self.intermediate_size})"
            )

    # -- hooks for subclasses --------------------------------------------------------------

    def _on_shard_complete(self, key: ShardKey, parts: dict[str, torch.Tensor]) -> None:
        """A checkpoint shard has its weight and scale: convert it, hand it to its slots.

        ``key`` is ``(first local slot of the logical expert, shard id)``, or ``(None, shard
        id)`` for the shared MLP (split into the fused shared experts). Every replica slot
        of the logical expert receives the shard through ``_write_shard``. Subclasses that
        defer conversion override this and convert in ``MegaMoEExperts._prepare_update``.
        """
        slot, shard_id = key
        what = "shared expert" if slot is None else f"expert {self.layout.logical_of(slot)}"
        source_scale = nvfp4.shard_scale(
            self.checkpoint_format, parts, f"{self.layout.label}: {what} {shard_id}"
        )
        nvfp4.warn_requantized(self.layout.label, self.checkpoint_format, self.weight_format)
        weight, scale = self.requantize_shard(
            parts[WEIGHT], source_scale, name=f"{what} {shard_id}"
        )
        if slot is not None:
            for replica in self.layout.map_global_expert_id(self.layout.logical_of(slot)):
                self._write_shard(replica, shard_id, weight, scale)
            return
        n = self.num_shared_experts
        for s in range(n):
            part_scale = None if scale is None else split_shared_shard(scale, n, s, shard_id)
            self._write_shard(
                self.num_local_experts + s,
                shard_id,
                split_shared_shard(weight, n, s, shard_id),
                part_scale,
            )

    def requantize_shard(
        self, weight: torch.Tensor, scale: torch.Tensor | None, *, name: str
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Convert one checkpoint shard to the run format on this module's device.

        A converted shard is new memory. A shard already in the run format comes back on
        the device, as a copy once the module serves (it is staged until the commit, so the
        caller may reuse its tensors). Inside a load call, a Triton conversion's non-finite
        flag goes to the ledger unread (read when the outermost call returns); the torch
        path raises at once.

        Args:
            weight: the checkpoint weight (on any device).
            scale: its scale, None for BF16.
            name: the shard for messages, e.g. ``"expert 3 w1"``.

        Returns:
            ``(weight, scale)`` in the run format on the device (scale None for BF16).

        Raises:
            NonFiniteError: NaN/inf, or weight x scale overflowing float32; when the load
                call ends for a Triton conversion inside one, else at once.
        """
        src, dst = self.checkpoint_format, self.weight_format
        if src is dst:
            staged = self._serving
            kept = self._arrival.kept(weight, staged=staged)
            return kept, None if scale is None else self._arrival.kept(scale, staged=staged)
        weight = weight.to(self.device)
        scale = None if scale is None else scale.to(self.device)
        converted: tuple[torch.Tensor, torch.Tensor | None]
        if dst is WeightFormat.BF16:
            dense = quant.dequantize(weight, scale, src, block_size=BLOCK_FP8_DEFAULT)
            converted = dense.to(torch.bfloat16), None
            self._arrival.ledger.record(f"{name} weight x scale", converted[0])  # inf: overflow
        else:
            flags: list[torch.Tensor] = []
            converted = quant.requantize(
                weight,
                scale,
                src,
                dst,
                block_size=BLOCK_FP8_DEFAULT,
                name=f"{self.layout.label}: {name}",
                nonfinite_flags=flags,
            )
            for flag in flags:
                self._arrival.ledger.record_flag(f"{name} weight x scale", flag)
        if not self._guard_depth:  # called on its own, not by a load call: read them now
            self._arrival.ledger.check()
        return converted

    def _write_shard(
        self, local_slot: int, shard_id: str, weight: torch.Tensor, scale: torch.Tensor | None
    ) -> None:
        """Hand one run-format shard of one kernel slot to the next ``finalize()``.

        Checks shape and dtype (naming the slot) first; finiteness was counted when the
        checkpoint tensors arrived (and by the conversion). Before the module first serves,
        the shard is written into place at once; afterwards it is staged, held as given (on
        the device): the caller must not change the tensors afterwards.
        """
        what, fmt = f"{self.layout.slot_label(local_slot)} {shard_id}", self.weight_format
        specs = self.layout.specs(fmt, shard_id)
        self._check_spec(f"{what} weight", weight, fmt, specs, WEIGHT)
        if (scale is None) != (specs[1] is None):
            raise ValueError(
                f"{self.layout.label}: {what}: got scale={'None' if scale is None else 'a tensor'}"
                f", but {fmt.value} {'needs a' if specs[1] else 'has no'} scale"
            )
        if scale is not None:
            self._check_spec(f"{what} scale", scale, fmt, specs, SCALE)
            scale = scale.to(self.device)
        if self._serving:
            self._pending.stage(local_slot, shard_id, weight.to(self.device), scale)
            if self._pending.held_bytes > self.reload_staging_bytes:
                self._write_in_place()
        else:
            self._commit(local_slot, shard_id, weight, scale)
            self._direct.add((local_slot, shard_id))

    def _commit(
        self, slot: int, shard_id: str, weight: torch.Tensor, scale: torch.Tensor | None
    ) -> None:
        """Copy one shard into the kernel tensors, in place (they keep their storage).

        First-projection weight rows go where ``l1_order`` puts them; scales keep the
        canonical ``[gate | up]`` order.
        """
        stem, index = self.layout.slot_param(slot, shard_id)
        params = self.kernel_params
        for suffix, value in ((WEIGHT, weight), ("weight_scale", scale)):
            if value is None:
                continue
            target = params[f"{stem}_{suffix}"].data[index]
            if shard_id == SHARD_DOWN:
                target.copy_(value)
            elif suffix == WEIGHT:
                self.l1_order.write(target, shard_id, value)
            else:
                rows = value.shape[0]
                (target[:rows] if shard_id == SHARD_GATE else target[rows:]).copy_(value)


def split_shared_shard(tensor: torch.Tensor, n: int, s: int, shard_id: str) -> torch.Tensor:
    """Fused shared expert ``s`` of ``n``'s part of one shard of the whole shared MLP.

    The checkpoint's shared MLP has intermediate size ``n * I``: this is part ``s`` along
    that dimension (rows for gate/up ``w1``/``w3``, columns for down ``w2``), as a view.
    Works alike on a weight and on its scale.
    """
    if shard_id == SHARD_DOWN:
        return tensor.reshape(tensor.shape[0], n, -1)[:, s]
    return tensor.reshape(n, -1, tensor.shape[-1])[s]
