"""The GLM-5.3-Flash MoE block: grouped sigmoid router, MegaMoE experts, shared expert."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from megamoe.core.adapters import MoEBlock
from megamoe.core.expert_names import parse_expert_name
from megamoe.core.formats import ARCH_REFERENCE, WeightFormat, detect_arch, resolve_formats
from megamoe.core.parallel import ParallelSettings
from megamoe.core.quant_config import detect_expert_format
from megamoe.core.shared_expert import AuxStream, SwiGLUMLP
from megamoe.glm5next.config import MODEL_NAME, Glm5NextConfig
from megamoe.glm5next.experts import DEFAULT_REQUANT_CHUNK, Glm5NextMegaMoEExperts
from megamoe.glm5next.router import Glm5NextRouter

if TYPE_CHECKING:
    from megamoe.core.checkpoint import CheckpointReader

logger = logging.getLogger("megamoe")

ROUTER = "gate.weight"
ROUTER_BIAS = "gate.e_score_correction_bias"
EXPERTS = "experts"
SHARED_EXPERTS = "shared_experts"
MTP_PREFIX = "mtp."  # the MTP drafter's layers never take a forced run format
# Run formats whose SM100 kernel can take the shared expert as one more expert.
FUSABLE_RUN_FORMATS = frozenset({WeightFormat.MXFP8, WeightFormat.MXFP4, WeightFormat.BF16})


class Glm5NextMegaMoeBlock(MoEBlock):
    """One GLM-5.3-Flash (DeepSeek-V3-style) MoE layer with its experts on MegaMoE.

    ``forward``: router logits ``x @ gate.weight^T`` in float32, sigmoid scores,
    group-limited top-k on the scores plus ``e_score_correction_bias`` (see
    ``megamoe.glm5next.router``), weights from the unbiased scores; then the routed experts
    and the shared expert. The shared expert is fused into the kernel as an extra expert
    where the run format allows it (MXFP8, MXFP4, BF16: the SM100 kernel); otherwise
    (FP8_BLOCK: Hopper, or the reference path running block-FP8) it is a separate SwiGLU
    MLP issued on an auxiliary CUDA stream beside the router and joined before the MegaMoE
    launch. Both compute the same function. The router's expert ids go to the experts
    as physical ids (physical expert ``e`` holds logical expert ``e``); an engine with EPLB
    replicas calls ``block.gate`` and ``block.experts`` itself to remap in between.

    Args:
        config: a ``Glm5NextConfig`` or the ``config.json`` mapping.
        prefix: the block's tensor prefix, ``model.layers.{L}.mlp`` or ``mtp.layers.{i}.mlp``.
        parallel: expert-parallel group (required: a group of size 1 for one device),
            linear placement, tensor parallel 1, redundant experts.
        moe_format: run format to force; None runs the experts as stored where the target
            can (block-FP8 on Hopper and the reference path), else converts with a warning
            (block-FP8 -> MXFP8 on SM100). Ignored by the MTP drafter's layers.
        is_mtp: whether the block belongs to the MTP drafter; None infers it from the prefix.
        backend: ``"auto"``, ``"reference"`` or ``"deepgemm"``.
        device: where weights and activations live (None = CPU).
        max_num_tokens: most tokens one forward on this rank may carry.
        fuse_shared: None fuses the shared expert where the run format allows; False never
            fuses; True requires fusing.
        use_aux_stream: False runs an unfused shared expert serially.
        emulate_kernel: reference backend: round activations as the kernel does.
        arch: ``sm90``, ``sm100`` or ``reference`` to decide the run format for; None
            derives it from ``backend`` and ``device``.
        requant_chunk: experts per step of ``requantize_block_fp8``.

    Raises:
        NotImplementedError: no expert-parallel group, tensor parallel > 1, non-linear
            placement, a checkpoint format megamoe cannot load, or ``fuse_shared=True``
            where the run format cannot fuse (each names the option).
        ValueError: sizes or an expert split that cannot run.
    """

    experts: Glm5NextMegaMoEExperts
    gate: Glm5NextRouter

    def __init__(
        self,
        config: Glm5NextConfig | Mapping[str, Any],
        *,
        prefix: str,
        parallel: ParallelSettings,
        moe_format: WeightFormat | str | None = None,
        is_mtp: bool | None = None,
        backend: str = "auto",
        device: torch.device | str | None = None,
        max_num_tokens: int = 256,
        fuse_shared: bool | None = None,
        use_aux_stream: bool = True,
        emulate_kernel: bool = False,
        arch: str | None = None,
        requant_chunk: int = DEFAULT_REQUANT_CHUNK,
    ) -> None:
        super().__init__()
        cfg = config if isinstance(config, Glm5NextConfig) else Glm5NextConfig.from_dict(config)
        parallel.check_megamoe(MODEL_NAME, require_ep_group=True)
        self.config, self.prefix, self.requant_chunk = cfg, prefix, requant_chunk
        self.is_mtp = prefix.startswith(MTP_PREFIX) if is_mtp is None else is_mtp
        self.device = torch.device("cpu") if device is None else torch.device(device)
        quant_config = cfg.quantization_config
        checkpoint_format = detect_expert_format(
            quant_config, f"{prefix}.{EXPERTS}", num_experts=cfg.n_routed_experts
        )
        target = arch or (ARCH_REFERENCE if backend == "reference" else detect_arch(self.device))
        _, run_format = resolve_formats(
            checkpoint_format, None if self.is_mtp else moe_format, target
        )
        shared_format = (
            detect_expert_format(quant_config, f"{prefix}.{SHARED_EXPERTS}")
            if cfg.n_shared_experts
            else None
        )
        self.fused_shared = self._fuses_shared(
            fuse_shared, checkpoint_format, shared_format, run_format
        )
        logger.debug(
            "%s: %s routed experts run as %s, shared expert %s",
            prefix,
            checkpoint_format.value,
            run_format.value,
            "fused" if self.fused_shared else "separate" if shared_format else "absent",
        )
        num_physical = cfg.n_routed_experts + parallel.num_redundant_experts
        num_local = num_physical // parallel.ep_size
        self.experts = Glm5NextMegaMoEExperts(
            num_experts=num_physical,
            num_local_experts=num_local,
            experts_start_idx=parallel.ep_rank * num_local,
            num_logical_experts=cfg.n_routed_experts,
            top_k=cfg.num_experts_per_tok,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.moe_intermediate_size,
            weight_format=run_format,
            checkpoint_format=checkpoint_format,
            num_shared_experts=cfg.n_shared_experts if self.fused_shared else 0,
            max_num_tokens=max_num_tokens,
            process_group=parallel.ep_group,
            backend=backend,
            device=self.device,
            prefix=f"{prefix}.{EXPERTS}",
            emulate_kernel=emulate_kernel,
            weight_block_size=cfg.weight_block_size,
        )
        self.shared_experts: SwiGLUMLP | None = None
        if shared_format is not None and not self.fused_shared:
            self.shared_experts = SwiGLUMLP(
                cfg.hidden_size,
                cfg.shared_intermediate_size,
                checkpoint_format=shared_format,
                device=self.device,
                prefix=f"{prefix}.{SHARED_EXPERTS}",
            )
        self.gate = Glm5NextRouter(cfg, device=self.device)
        self.aux_stream = AuxStream(self.device, enabled=use_aux_stream)
        self._router_loaded: set[str] = set()

    def _fuses_shared(
        self,
        requested: bool | None,
        checkpoint_format: WeightFormat,
        shared_format: WeightFormat | None,
        run_format: WeightFormat,
    ) -> bool:
        """Whether the shared expert runs inside the kernel (see the class docstring)."""
        if shared_format is None or requested is False:
            return False
        why_not = None
        if run_format not in FUSABLE_RUN_FORMATS:
            why_not = f"the {run_format.value} kernel (Hopper) has no shared-expert slot"
        elif shared_format is not checkpoint_format:
            why_not = (
                f"the shared expert is stored as {shared_format.value} but the routed experts "
                f"as {checkpoint_format.value}"
            )
        if why_not is not None and requested:
            raise NotImplementedError(
                f"{self.prefix}: fuse_shared=True, but {why_not}; pass fuse_shared=None to "
                "run it as a separate MLP, or a moe_format of "
                f"{', '.join(sorted(f.value for f in FUSABLE_RUN_FORMATS))}"
            )
        return why_not is None

    # -- forward ---------------------------------------------------------------------------

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Routed plus shared output for this rank's tokens.

        Args:
            hidden_states: (tokens, hidden_size) bfloat16.

        Returns:
            (tokens, hidden_size) bfloat16.

        Raises:
            ValueError: a shape that does not match.
            TypeError: a dtype other than bfloat16.
            RuntimeError: the block was not finalized.
        """
        hidden = self.config.hidden_size
        if hidden_states.dim() != 2 or hidden_states.shape[1] != hidden:
            raise ValueError(
                f"{self.prefix}: hidden_states has shape {tuple(hidden_states.shape)}, "
                f"expected (tokens, hidden_size={hidden})"
            )
        if hidden_states.dtype != torch.bfloat16:
            raise TypeError(
                f"{self.prefix}: hidden_states has dtype {hidden_states.dtype}, expected "
                "torch.bfloat16"
            )
        shared_mlp = self.shared_experts
        join_shared = (
            None
            if shared_mlp is None
            else self.aux_stream.launch(lambda: shared_mlp(hidden_states))
        )
        topk_weights, topk_ids = self.gate(hidden_states)
        shared = None if join_shared is None else join_shared()  # before the MegaMoE launch
        routed = self.experts(hidden_states, topk_weights, topk_ids)
        if shared is None:
            return routed
        return (routed.float() + shared.float()).to(torch.bfloat16)

    # -- loading ---------------------------------------------------------------------------

    def wants(self, name: str) -> bool:
        """Whether ``name`` (relative to the block prefix) concerns this rank.

        Routed-expert tensors of other ranks' experts do not; anything else does (names
        that do not parse are kept so that loading reports them).
        """
        head, _, rest = name.partition(".")
        if head != EXPERTS:
            return True
        parsed = parse_expert_name(rest)
        if parsed is None or parsed.expert is None or parsed.expert >= self.config.n_routed_experts:
            return True
        return bool(self.experts.map_global_expert_id(parsed.expert))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load tensors named relative to the block prefix, in any order and chunking.

        Names: ``gate.weight`` (E, H), ``gate.e_score_correction_bias`` (E,),
        ``shared_experts.{gate,up,down}_proj.{weight,<scale>}`` and
        ``experts.{e}.{gate,up,down}_proj.{weight,<scale>}``. ``finalize()`` applies the
        update (requantizing the new block-FP8 shards first).

        Returns:
            The names loaded or accepted.

        Raises:
            ValueError: an unexpected name (naming the expected ones), or a tensor whose
                shape, dtype or values do not fit.
            NonFiniteError: an expert tensor holds NaN or infinity.
        """
        loaded: set[str] = set()
        for name, tensor in weights:
            head, _, rest = name.partition(".")
            if head == EXPERTS:
                self.experts.load_weights([(rest, tensor)])
            elif head == SHARED_EXPERTS and self.fused_shared:
                self.experts.load_shared_expert_weight(rest, tensor)
            elif head == SHARED_EXPERTS and self.shared_experts is not None:
                self.shared_experts.load_weights([(rest, tensor)])
            elif name in (ROUTER, ROUTER_BIAS):
                self._load_router(name, tensor)
            else:
                shared = f"{SHARED_EXPERTS}.*, " if self.config.n_shared_experts else ""
                raise ValueError(
                    f"{self.prefix}: unexpected tensor {name!r}; a {MODEL_NAME} MoE block "
                    f"loads {ROUTER}, {ROUTER_BIAS}, {shared}{EXPERTS}.{{e}}.{{gate,up,down}}"
                    "_proj.*"
                )
            loaded.add(name)
        return loaded

    def _load_router(self, name: str, tensor: torch.Tensor) -> None:
        """Copy the router weight or its selection bias, checking shape, dtype and values."""
        param = self.gate.weight if name == ROUTER else self.gate.e_score_correction_bias
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(
                f"{self.prefix}.{name} has shape {tuple(tensor.shape)}, expected "
                f"{tuple(param.shape)} (n_routed_experts={self.config.n_routed_experts}, "
                f"hidden_size={self.config.hidden_size})"
            )
        if not tensor.is_floating_point() or tensor.element_size() < 2:
            raise ValueError(
                f"{self.prefix}.{name} has dtype {tensor.dtype}, expected bf16/fp16/fp32: the "
                "router is not quantized"
            )
        if not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{self.prefix}.{name} holds NaN or infinity; fix the checkpoint")
        param.data.copy_(tensor)
        self._router_loaded.add(name)

    def finalize(self) -> None:
        """Check the router and shared expert, requantize new shards, commit the experts.

        Raises:
            ValueError: the router weight or bias, or a shared-expert projection, was never
                loaded.
            IncompleteShardsError: an expert shard lacks its weight or scale (None names
                the shared expert).
            MissingExpertsError: local experts that never received their tensors.
        """
        missing = [n for n in (ROUTER, ROUTER_BIAS) if n not in self._router_loaded]
        if missing:
            raise ValueError(f"{self.prefix}: never loaded: {', '.join(missing)}")
        if self.shared_experts is not None:
            self.shared_experts.check_loaded()
        self.experts.requantize_block_fp8(chunk=self.requant_chunk)
        self.experts.finalize()

    def load_from_checkpoint(self, reader: CheckpointReader) -> None:
        """Load this layer (router, bias, shared expert, this rank's experts) and finalize.

        Only this rank's experts are read, one tensor at a time; with a reader opened with
        an adapter, their headers are checked before anything is loaded.

        Args:
            reader: the checkpoint.

        Raises:
            CheckpointError: missing, unreadable or mismatching tensors.
            ValueError / IncompleteShardsError / MissingExpertsError: see ``load_weights``
                and ``finalize``.
        """
        layer = next((m for m in reader.layers if m.prefix == self.prefix), None)
        if layer is not None:
            local = [
                e
                for e in range(self.config.n_routed_experts)
                if self.experts.map_global_expert_id(e)
            ]
            reader.check_layer(layer, local)
        self.load_weights(reader.iter_tensors(self.prefix, keep=self.wants))
        self.finalize()
