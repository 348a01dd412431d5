"""The Qwen4Exp sparse MoE block with its routed experts on one MegaMoE launch."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from megamoe.core.adapters import MoEBlock
from megamoe.core.expert_names import WEIGHT, WEIGHT_PACKED, parse_expert_name
from megamoe.core.formats import ARCH_REFERENCE, WeightFormat, detect_arch, resolve_formats
from megamoe.core.parallel import ParallelSettings
from megamoe.core.quant_config import detect_expert_format
from megamoe.core.shared_expert import AuxStream, SwiGLUMLP
from megamoe.qwen4exp.config import Qwen4ExpConfig
from megamoe.qwen4exp.experts import Qwen4ExpMegaMoEExperts

if TYPE_CHECKING:
    from megamoe.core.checkpoint import CheckpointReader

logger = logging.getLogger("megamoe")

MODEL_NAME = "Qwen4Exp"
ROUTER = "gate.weight"
SHARED_GATE = "shared_expert_gate.weight"
SHARED_EXPERT = "shared_expert"
EXPERTS = "experts"
MTP_PREFIX = "mtp."  # the MTP drafter's layers; they never take a forced run format
_logged: set[tuple[WeightFormat, WeightFormat]] = set()


class Qwen4ExpMegaMoeBlock(MoEBlock):
    """A Qwen3-Next-style MoE layer whose routed experts run as one MegaMoE launch.

    ``forward`` routes (router linear, float32 softmax, top-k, renormalized when
    ``norm_topk_prob``), runs the shared SwiGLU expert scaled by
    ``sigmoid(shared_expert_gate(x))`` on an auxiliary CUDA stream beside the router, joins
    it before the MegaMoE launch (which needs every SM), and returns routed plus shared
    output for this rank's tokens; no collective follows.

    Args:
        config: the model config (a ``Qwen4ExpConfig`` or the ``config.json`` mapping).
        prefix: the block's tensor prefix, e.g. ``model.layers.3.mlp`` or
            ``mtp.layers.0.mlp``.
        parallel: expert-parallel group (required; a group of size 1 for one device),
            placement (linear) and tensor-parallel size (1).
        moe_format: run format to force (``"mxfp8"``, ``WeightFormat.MXFP4``, ...); None
            runs the experts as stored where the target can, else converts with a warning.
            Ignored by the MTP drafter's layers, which take the default.
        is_mtp: whether the block belongs to the MTP drafter; None infers it from the
            prefix (``mtp.``).
        backend: ``"auto"``, ``"reference"`` or ``"deepgemm"``.
        device: where weights and activations live (None = CPU).
        max_num_tokens: most tokens one forward on this rank may carry.
        use_aux_stream: False runs the shared expert serially on the current stream.
        emulate_kernel: reference backend: round activations as the kernel does.
        arch: target kernel family (``sm90``, ``sm100``, ``reference``) that decides the
            run format; None derives it from ``backend`` and ``device``.

    Raises:
        NotImplementedError: no expert-parallel group, tensor parallel > 1, non-linear
            placement, or a checkpoint format megamoe cannot load (each names the setting).
        ValueError: physical experts that do not split evenly over the EP ranks, or sizes
            the experts cannot run.
    """

    experts: Qwen4ExpMegaMoEExperts

    def __init__(
        self,
        config: Qwen4ExpConfig | Mapping[str, Any],
        *,
        prefix: str,
        parallel: ParallelSettings,
        moe_format: WeightFormat | str | None = None,
        is_mtp: bool | None = None,
        backend: str = "auto",
        device: torch.device | str | None = None,
        max_num_tokens: int = 256,
        use_aux_stream: bool = True,
        emulate_kernel: bool = False,
        arch: str | None = None,
    ) -> None:
        super().__init__()
        cfg = config if isinstance(config, Qwen4ExpConfig) else Qwen4ExpConfig.from_dict(config)
        parallel.check_megamoe(MODEL_NAME, require_ep_group=True)
        self.config, self.prefix = cfg, prefix
        self.is_mtp = prefix.startswith(MTP_PREFIX) if is_mtp is None else is_mtp
        self.device = torch.device("cpu") if device is None else torch.device(device)
        num_physical = cfg.num_experts + parallel.num_redundant_experts
        if num_physical % parallel.ep_size:
            raise ValueError(
                f"{prefix}: {num_physical} physical experts (num_experts={cfg.num_experts} + "
                f"num_redundant_experts={parallel.num_redundant_experts}) do not split evenly "
                f"over {parallel.ep_size} expert-parallel ranks; change num_redundant_experts "
                "so that the total is a multiple of the EP size"
            )
        num_local = num_physical // parallel.ep_size
        quant = cfg.quantization_config
        checkpoint_format = detect_expert_format(
            quant, f"{prefix}.{EXPERTS}", num_experts=cfg.num_experts
        )
        target = arch or (ARCH_REFERENCE if backend == "reference" else detect_arch(self.device))
        _, run_format = resolve_formats(
            checkpoint_format, None if self.is_mtp else moe_format, target
        )
        if (checkpoint_format, run_format) not in _logged:
            _logged.add((checkpoint_format, run_format))
            logger.info(
                "%s MegaMoE runs %s routed experts (checkpoint: %s)",
                MODEL_NAME,
                run_format.value,
                checkpoint_format.value,
            )
        hidden = cfg.hidden_size
        self.experts = Qwen4ExpMegaMoEExperts(
            num_experts=num_physical,
            num_local_experts=num_local,
            experts_start_idx=parallel.ep_rank * num_local,
            num_logical_experts=cfg.num_experts,
            top_k=cfg.num_experts_per_tok,
            hidden_size=hidden,
            intermediate_size=cfg.moe_intermediate_size,
            weight_format=run_format,
            checkpoint_format=checkpoint_format,
            max_num_tokens=max_num_tokens,
            process_group=parallel.ep_group,
            backend=backend,
            device=self.device,
            prefix=f"{prefix}.{EXPERTS}",
            emulate_kernel=emulate_kernel,
        )
        self.gate = torch.nn.Linear(
            hidden, cfg.num_experts, bias=False, device=self.device, dtype=torch.bfloat16
        )
        self.shared_expert_gate = torch.nn.Linear(
            hidden, 1, bias=False, device=self.device, dtype=torch.bfloat16
        )
        self.shared_expert = SwiGLUMLP(
            hidden,
            cfg.shared_expert_intermediate_size,
            checkpoint_format=detect_expert_format(quant, f"{prefix}.{SHARED_EXPERT}"),
            device=self.device,
            prefix=f"{prefix}.{SHARED_EXPERT}",
        )
        for linear in (self.gate, self.shared_expert_gate):
            linear.weight.requires_grad_(False)
        self.aux_stream = AuxStream(self.device, enabled=use_aux_stream)
        self._dense_loaded: set[str] = set()

    # -- forward ---------------------------------------------------------------------------

    def route(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k routing weights (float32) and expert ids (int32) of each token.

        The router logits are computed in float32 from the bf16 weights, so the expert
        choice does not hinge on bf16 rounding of near-equal logits.
        """
        logits = F.linear(hidden_states.float(), self.gate.weight.float())
        probs = torch.softmax(logits, dim=-1)
        topk_weights, topk_ids = probs.topk(self.config.num_experts_per_tok, dim=-1)
        if self.config.norm_topk_prob:
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        return topk_weights, topk_ids.to(torch.int32)

    def shared_output(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The shared expert times ``sigmoid(shared_expert_gate(x))``, float32."""
        gate = torch.sigmoid(F.linear(hidden_states, self.shared_expert_gate.weight).float())
        return self.shared_expert(hidden_states).float() * gate

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Routed plus shared output for this rank's tokens.

        Args:
            hidden_states: (tokens, hidden_size) bfloat16.

        Returns:
            (tokens, hidden_size) bfloat16.

        Raises:
            ValueError / TypeError: a shape or dtype that does not match.
            RuntimeError: the block was not finalized.
        """
        hidden = self.config.hidden_size
        if hidden_states.dim() != 2 or hidden_states.shape[1] != hidden:
            raise ValueError(
                f"{self.prefix}: hidden_states has shape {tuple(hidden_states.shape)}, "
                f"expected (tokens, {hidden})"
            )
        if hidden_states.dtype != torch.bfloat16:
            raise TypeError(
                f"{self.prefix}: hidden_states has dtype {hidden_states.dtype}, expected "
                "torch.bfloat16"
            )
        join_shared = self.aux_stream.launch(lambda: self.shared_output(hidden_states))
        topk_weights, topk_ids = self.route(hidden_states)
        shared = join_shared()  # before the MegaMoE launch: it needs every SM
        routed = self.experts(hidden_states, topk_weights, topk_ids)
        return (routed.float() + shared).to(torch.bfloat16)

    # -- loading ---------------------------------------------------------------------------

    def wants(self, name: str) -> bool:
        """Whether ``name`` (relative to the block prefix) concerns this rank.

        Routed-expert tensors of experts on other ranks are not; fused expert tensors,
        unparsable names (so that loading reports them) and dense tensors are.
        """
        head, _, rest = name.partition(".")
        if head != EXPERTS:
            return True
        parsed = parse_expert_name(rest)
        if parsed is None or parsed.expert is None:
            return True
        if parsed.expert >= self.config.num_experts:
            return True
        return bool(self.experts.map_global_expert_id(parsed.expert))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load tensors named relative to the block prefix, in any order and chunking.

        Names: ``gate.weight`` (router, (E, H)), ``shared_expert_gate.weight`` ((1, H)),
        ``shared_expert.{gate,up,down}_proj.{weight,<scale>}`` and ``experts.*`` (see
        ``Qwen4ExpMegaMoEExperts.load_weights``). ``finalize()`` applies the expert update.

        Returns:
            The names loaded or accepted.

        Raises:
            ValueError: an unexpected name (naming the expected ones), a shape or dtype
                that does not match.
            NonFiniteError: a routed-expert tensor holds NaN or infinity.
        """
        loaded: set[str] = set()
        for name, tensor in weights:
            head, _, rest = name.partition(".")
            if head == EXPERTS:
                self.experts.load_weights([(rest, tensor)])
            elif head == SHARED_EXPERT:
                proj, _, kind = rest.partition(".")
                kind = WEIGHT if kind == WEIGHT_PACKED else kind
                self.shared_expert.load_weights([(f"{proj}.{kind}", tensor)])
            elif name in (ROUTER, SHARED_GATE):
                self._load_dense(name, tensor)
            else:
                raise ValueError(
                    f"{self.prefix}: unexpected tensor {name!r}; a Qwen4Exp MoE block loads "
                    f"{ROUTER}, {SHARED_GATE}, {SHARED_EXPERT}.{{gate,up,down}}_proj.* and "
                    f"{EXPERTS}.* ({self.experts.expected_names()})"
                )
            loaded.add(name)
        return loaded

    def _load_dense(self, name: str, tensor: torch.Tensor) -> None:
        """Copy the router or the shared-expert gate, checking shape, dtype and values."""
        param = (self.gate if name == ROUTER else self.shared_expert_gate).weight
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(
                f"{self.prefix}.{name} has shape {tuple(tensor.shape)}, expected "
                f"{tuple(param.shape)} (out, hidden_size={self.config.hidden_size})"
            )
        if not tensor.is_floating_point() or tensor.element_size() < 2:
            raise ValueError(
                f"{self.prefix}.{name} has dtype {tensor.dtype}, expected bf16/fp16/fp32: "
                "the router and shared-expert gate are not quantized"
            )
        if not torch.isfinite(tensor).all():
            raise ValueError(f"{self.prefix}.{name} holds NaN or infinity; fix the checkpoint")
        param.data.copy_(tensor)
        self._dense_loaded.add(name)

    def finalize(self) -> None:
        """Check every dense tensor arrived and commit the routed experts' update.

        Raises:
            ValueError: the router or shared-expert gate was never loaded.
            IncompleteShardsError: an expert or shared-expert projection lacks a half.
            MissingExpertsError: local experts that never received their tensors.
        """
        missing = [n for n in (ROUTER, SHARED_GATE) if n not in self._dense_loaded]
        if missing:
            raise ValueError(f"{self.prefix}: never loaded: {', '.join(missing)}")
        self.shared_expert.check_loaded()
        self.experts.finalize()

    def load_from_checkpoint(self, reader: CheckpointReader) -> None:
        """Load this layer's router, shared expert, shared gate and local experts; finalize.

        Only this rank's experts are read (each tensor on its own); the reader checks the
        headers of what it reads first, and, opened with an adapter, that every local
        expert's tensors are present before anything is loaded.

        Args:
            reader: the checkpoint.

        Raises:
            CheckpointError: missing, unreadable or mismatching tensors.
            ValueError / IncompleteShardsError / MissingExpertsError: see ``load_weights``
                and ``finalize``.
        """
        layer = next((m for m in reader.layers if m.prefix == self.prefix), None)
        if layer is not None:
            experts = range(self.config.num_experts)
            reader.check_layer(layer, [e for e in experts if self.experts.map_global_expert_id(e)])
        self.load_weights(reader.iter_tensors(self.prefix, keep=self.wants))
        self.finalize()
