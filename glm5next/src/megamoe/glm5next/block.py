"""The GLM-5.3-Flash MoE block: grouped sigmoid router, MegaMoE experts, shared expert."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any, Unpack

import torch

from megamoe.core.adapters import MoEBlock
from megamoe.core.checkpoint.quant_config import detect_mlp_format
from megamoe.core.errors import IncompleteShardsError, MissingExpertsError
from megamoe.core.loading.dense_update import DenseUpdate, discard_on_error
from megamoe.core.modules.backend_select import fuses_shared_experts
from megamoe.core.modules.block_setup import (
    EXPERTS,
    BlockOptions,
    ExpertPlan,
    check_hidden_states,
    plan_experts,
)
from megamoe.core.modules.parallel import ParallelSettings
from megamoe.core.modules.shared_expert import AUX_IN_GRAPHS, AuxStream, SwiGLUMLP
from megamoe.core.numerics.formats import WeightFormat
from megamoe.glm5next.config import MODEL_NAME, Glm5NextConfig
from megamoe.glm5next.experts import DEFAULT_REQUANT_CHUNK, Glm5NextMegaMoEExperts
from megamoe.glm5next.router import Glm5NextRouter

logger = logging.getLogger("megamoe")

ROUTER = "gate.weight"
ROUTER_BIAS = "gate.e_score_correction_bias"
SHARED_EXPERTS = "shared_experts"
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
    MLP, issued right after the MegaMoE launch on the same stream so that its host work
    overlaps the kernel, or, while a CUDA graph is captured, on an auxiliary CUDA stream
    beside the router, joined before the launch (``use_aux_stream``,
    ``megamoe.core.modules.shared_expert.AuxStream``).
    Both compute the same function, with the model's SwiGLU clamp
    (``swiglu_limit``: gate <= L, -L <= up <= L, before silu) in the routed experts and the
    shared expert alike. The router's expert ids go to the experts
    as physical ids (physical expert ``e`` holds logical expert ``e``); an engine with EPLB
    replicas calls ``block.gate`` and ``block.experts`` itself to remap in between. On the
    Hopper kernel the router kernel also writes the kernel's inputs
    (``experts.dispatch_buffer``), so the experts skip DeepGEMM's pre-dispatch launch.

    Args:
        config: a ``Glm5NextConfig`` or the ``config.json`` mapping.
        prefix: the block's tensor prefix, e.g. ``model.language_model.layers.{L}.mlp``
            (MTP layers: ``L = num_hidden_layers + j``, built with ``is_mtp=True``).
        parallel: expert-parallel group (required: a group of size 1 for one device),
            linear placement, tensor parallel 1, redundant experts.
        fuse_shared: None fuses the shared expert where the run format allows; False never
            fuses; True requires fusing.
        use_aux_stream: the shared expert's schedule, ``"graphs"`` (default: the
            auxiliary stream only inside captured CUDA graphs), True or False; see
            ``megamoe.core.modules.shared_expert.AuxStream``.
        shared_gemm: how the (unfused) shared expert multiplies
            (``megamoe.core.numerics.fp8_gemm.SharedGemm``): ``"bf16"`` (default; a block-FP8
            checkpoint is dequantized at load: measured faster on the H200), ``"deep_gemm"``
            (keeps block-FP8: half the memory, 1.4-2.0x slower on the H200 until its
            activation casts are fused), None picks ``deep_gemm`` where it runs.
        requant_chunk: experts per step of ``requantize_block_fp8``.
        **options: ``moe_format``, ``is_mtp``, ``backend``, ``device``, ``max_num_tokens``,
            ``emulate_kernel``, ``arch``, ``reload_staging_bytes``, ``experts_path``,
            ``small_batch_max_tokens`` (see ``megamoe.core.modules.block_setup.BlockOptions``).
            With ``moe_format=None`` the experts run as stored where the target can
            (block-FP8 on Hopper and the reference path), else convert with a warning
            (block-FP8 -> MXFP8 on SM100).

    Raises:
        NotImplementedError: no expert-parallel group, tensor parallel > 1, non-linear
            placement, a checkpoint format megamoe cannot load, or ``fuse_shared=True``
            where the run format cannot fuse (each names the option).
        ValueError: sizes or an expert split that cannot run, or ``requant_chunk`` < 1.
    """

    experts: Glm5NextMegaMoEExperts
    gate: Glm5NextRouter

    def __init__(
        self,
        config: Glm5NextConfig | Mapping[str, Any],
        *,
        prefix: str,
        parallel: ParallelSettings,
        fuse_shared: bool | None = None,
        use_aux_stream: bool | str = AUX_IN_GRAPHS,
        shared_gemm: str | None = "bf16",
        requant_chunk: int = DEFAULT_REQUANT_CHUNK,
        **options: Unpack[BlockOptions],
    ) -> None:
        super().__init__()
        if (
            isinstance(requant_chunk, bool)
            or not isinstance(requant_chunk, int)
            or requant_chunk < 1
        ):
            raise ValueError(
                f"{prefix}: requant_chunk={requant_chunk!r} must be an integer >= 1 (experts "
                f"requantized per step; default {DEFAULT_REQUANT_CHUNK})"
            )
        cfg = config if isinstance(config, Glm5NextConfig) else Glm5NextConfig.from_dict(config)
        plan = plan_experts(MODEL_NAME, prefix, cfg, parallel=parallel, **options)
        self.config, self.prefix, self.requant_chunk = cfg, prefix, requant_chunk
        self.is_mtp, self.device = plan.is_mtp, plan.device
        shared_format = (
            detect_mlp_format(cfg.quantization_config, f"{prefix}.{SHARED_EXPERTS}")
            if cfg.n_shared_experts
            else None
        )
        self.fused_shared = self._fuses_shared(fuse_shared, plan, shared_format)
        logger.debug(
            "%s: shared expert %s",
            prefix,
            "fused" if self.fused_shared else "separate" if shared_format else "absent",
        )
        self.experts = plan.build_experts(
            Glm5NextMegaMoEExperts,
            num_shared_experts=cfg.n_shared_experts if self.fused_shared else 0,
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
                swiglu_limit=cfg.swiglu_limit,
                gemm=shared_gemm,
            )
        self.gate = Glm5NextRouter(cfg, device=self.device, max_num_tokens=plan.max_num_tokens)
        self.aux_stream = AuxStream(self.device, enabled=use_aux_stream)
        self._dense = DenseUpdate(prefix)

    def _fuses_shared(
        self, requested: bool | None, plan: ExpertPlan, shared_format: WeightFormat | None
    ) -> bool:
        """Whether the shared expert runs inside the kernel (see the class docstring)."""
        if shared_format is None or requested is False:
            return False
        run_format, checkpoint_format = plan.run_format, plan.checkpoint_format
        why_not = None
        if run_format not in FUSABLE_RUN_FORMATS:
            why_not = f"the {run_format.value} kernel (Hopper) has no shared-expert slot"
        elif shared_format is not checkpoint_format:
            why_not = (
                f"the shared expert is stored as {shared_format.value} but the routed experts "
                f"as {checkpoint_format.value}"
            )
        elif not fuses_shared_experts(plan.backend, run_format, plan.device):
            why_not = (
                f"the {plan.backend} experts backend cannot fuse it here (DeepGEMM's SM100 "
                "kernels take shared experts from sgl-deep-gemm 0.2.5)"
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
        """Routed plus (fused or separate) shared-expert output; see ``MoEBlock.forward``."""
        check_hidden_states(self.prefix, hidden_states, self.config.hidden_size, self.device)
        # The router kernel writes the kernel's inputs itself where it can: no pre-dispatch.
        on_kernel = self.gate.fills_dispatch(hidden_states)
        dispatch = self.experts.dispatch_buffer(hidden_states) if on_kernel else None
        dispatched = dispatch is not None
        shared_mlp = self.shared_experts
        if shared_mlp is None:
            routing = self.gate(hidden_states, dispatch)
            return self.experts(hidden_states, *routing, dispatched=dispatched)
        routed, (shared,) = self.aux_stream.schedule(
            lambda: (shared_mlp(hidden_states),),
            lambda: self.gate(hidden_states, dispatch),
            lambda weights, ids: self.experts(hidden_states, weights, ids, dispatched=dispatched),
            tokens=hidden_states.shape[0],
        )
        return routed + shared  # bf16 + bf16 adds in float32 and rounds once, one kernel

    # -- loading ---------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load tensors named relative to the block prefix, in any order and chunking.

        Names: ``gate.weight`` (E, H), ``gate.e_score_correction_bias`` (E,),
        ``shared_experts.{gate,up,down}_proj.{weight,<scale>}`` and
        ``experts.{e}.{gate,up,down}_proj.{weight,<scale>}``. With ``n_shared_experts=0``
        the shared-expert names are accepted only as the empty tensors transformers writes
        for its zero-width shared MLP. ``finalize()`` applies the
        update (requantizing the new block-FP8 shards first). The first load writes the
        router and the unfused shared expert straight in; after a successful
        ``finalize()`` they are staged and ``finalize()`` commits them. Any error drops
        them with the experts' pending update (``discard_pending``), so the previous
        weights keep serving (see ``Glm5NextMegaMoEExperts``: only a first load is
        written in place).

        Returns:
            The names loaded or accepted.

        Raises:
            ValueError: an unexpected name (naming the expected ones), or a tensor whose
                shape, dtype or values do not fit.
            NonFiniteError: an expert tensor holds NaN or infinity.
        """
        loaded: set[str] = set()
        with discard_on_error(self), self.experts.loading():
            for name, tensor in weights:
                head, _, rest = name.partition(".")
                if head == EXPERTS:
                    self.experts.load_weights([(rest, tensor)])
                elif head == SHARED_EXPERTS and self.fused_shared:
                    self.experts.load_shared_expert_weight(rest, tensor)
                elif head == SHARED_EXPERTS and self.shared_experts is not None:
                    self.shared_experts.load_weights([(rest, tensor)])
                elif head == SHARED_EXPERTS and not self.config.n_shared_experts:
                    _check_empty_shared(self.prefix, name, tensor)  # nothing to load
                elif name in (ROUTER, ROUTER_BIAS):
                    self._load_router(name, tensor)
                else:
                    shared = f"{SHARED_EXPERTS}.*, " if self.config.n_shared_experts else ""
                    raise ValueError(
                        f"{self.prefix}: unexpected tensor {name!r}; a {MODEL_NAME} MoE block "
                        f"loads {ROUTER}, {ROUTER_BIAS}, {shared}{EXPERTS}.{{e}}."
                        "{gate,up,down}_proj.*"
                    )
                loaded.add(name)
        return loaded

    def _load_router(self, name: str, tensor: torch.Tensor) -> None:
        """Load the router weight or its selection bias, checking shape, dtype and values."""
        param = self.gate.weight if name == ROUTER else self.gate.e_score_correction_bias
        cfg = self.config
        note = f"n_routed_experts={cfg.n_routed_experts}, hidden_size={cfg.hidden_size}"
        self._dense.load(name, param, tensor, shape_note=note)

    def discard_pending(self) -> None:
        """Forget every tensor loaded since the last successful ``finalize()``."""
        self.experts.discard_pending()
        self._dense.discard_pending()
        if self.shared_experts is not None:
            self.shared_experts.discard_pending()

    def finalize(self) -> None:
        """Check the router and shared expert, requantize new shards, commit the experts.

        Router and unfused shared expert change only here, in place, once the experts'
        update succeeded. An incomplete load keeps the update pending (load the missing
        tensors and finalize again); any other error drops it.

        Raises:
            ValueError: the router weight or bias, or a shared-expert projection, was never
                loaded.
            IncompleteShardsError: an expert shard lacks its weight or scale (None names
                the shared expert).
            MissingExpertsError: local experts that never received their tensors.
        """
        self._dense.check_loaded((ROUTER, ROUTER_BIAS))
        if self.shared_experts is not None:
            self.shared_experts.check_loaded()
        with discard_on_error(self, keep=(IncompleteShardsError, MissingExpertsError)):
            self.experts.requantize_block_fp8(chunk=self.requant_chunk)
            self.experts.finalize()
        self._dense.commit()
        self.gate.refresh_planes()  # written through ``.data``: no version bump to see
        if self.shared_experts is not None:
            self.shared_experts.commit()


def _check_empty_shared(prefix: str, name: str, tensor: torch.Tensor) -> None:
    """Accept the empty shared-expert tensor of an ``n_shared_experts=0`` checkpoint.

    transformers builds the shared MLP ``n_shared_experts * moe_intermediate_size`` wide
    and saves it, so a model without shared experts stores tensors with no elements.

    Raises:
        ValueError: the tensor holds data, which a model without shared experts cannot use.
    """
    if tensor.numel():
        raise ValueError(
            f"{prefix}: {name} {tuple(tensor.shape)} holds data, but config.json has "
            "n_shared_experts=0; set n_shared_experts to the checkpoint's count, or remove "
            "the shared-expert tensors"
        )
