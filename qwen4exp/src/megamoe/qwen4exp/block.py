"""The Qwen4Exp sparse MoE block with its routed experts on one MegaMoE launch."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Unpack

import torch

from megamoe.core.adapters import MoEBlock
from megamoe.core.checkpoint.expert_names import WEIGHT, WEIGHT_PACKED
from megamoe.core.checkpoint.quant_config import detect_mlp_format
from megamoe.core.errors import IncompleteShardsError, MissingExpertsError
from megamoe.core.kernels import TRITON_AVAILABLE, one_launch_router, router_scratch
from megamoe.core.loading.dense_update import DenseUpdate, discard_on_error
from megamoe.core.modules.block_setup import (
    EXPERTS,
    BlockOptions,
    check_hidden_states,
    plan_experts,
)
from megamoe.core.modules.parallel import ParallelSettings
from megamoe.core.modules.shared_expert import AUX_IN_GRAPHS, AuxStream, SwiGLUMLP
from megamoe.core.numerics.dispatch import DispatchBuffer
from megamoe.core.numerics.router_logits import router_logits
from megamoe.qwen4exp.config import MODEL_NAME, Qwen4ExpConfig
from megamoe.qwen4exp.experts import Qwen4ExpMegaMoEExperts

ROUTER = "gate.weight"
SHARED_GATE = "shared_expert_gate.weight"
SHARED_EXPERT = "shared_expert"


def softmax_topk(
    logits: torch.Tensor, top_k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path of the router's selection (see ``Qwen4ExpMegaMoeBlock.route``).

    Returns:
        ``(topk_weights float32, topk_ids int32)``, each (tokens, top_k).
    """
    if norm_topk_prob:
        top_logits, topk_ids = logits.topk(top_k, dim=-1)
        topk_weights = torch.softmax(top_logits, dim=-1)
    else:
        topk_weights, topk_ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    return topk_weights, topk_ids.to(torch.int32)


def fused_combine(device: torch.device) -> Callable[..., torch.Tensor] | None:
    """``combine_triton.gated_add`` where it runs (Triton, a CUDA device), else None."""
    if not TRITON_AVAILABLE or device.type != "cuda":
        return None
    from megamoe.qwen4exp.combine_triton import gated_add

    return gated_add


class Qwen4ExpMegaMoeBlock(MoEBlock):
    """A Qwen3-Next-style MoE layer whose routed experts run as one MegaMoE launch.

    ``forward`` routes (router linear, float32 softmax, top-k, renormalized when
    ``norm_topk_prob``), launches the routed experts, runs the shared SwiGLU expert scaled
    by ``sigmoid(shared_expert_gate(x))`` after that launch on the same stream (its host
    work overlaps the kernel) or, while a CUDA graph is captured, on an auxiliary stream
    beside the router, joined before the launch, which needs every SM (``use_aux_stream``),
    and returns routed plus shared output for this rank's tokens; no collective follows.
    On the Hopper kernel the router kernel also writes the kernel's inputs
    (``experts.dispatch_buffer``), so the experts skip DeepGEMM's pre-dispatch launch.

    Args:
        config: the model config (a ``Qwen4ExpConfig`` or the ``config.json`` mapping).
        prefix: the block's tensor prefix, e.g. ``model.layers.3.mlp`` or
            ``mtp.layers.0.mlp``.
        parallel: expert-parallel group (required; a group of size 1 for one device),
            placement (linear) and tensor-parallel size (1).
        use_aux_stream: the shared expert's schedule, ``"graphs"`` (default: the
            auxiliary stream only inside captured CUDA graphs), True or False; see
            ``megamoe.core.modules.shared_expert.AuxStream``.
        shared_gemm: how the (unfused) shared expert multiplies
            (``megamoe.core.numerics.fp8_gemm.SharedGemm``): ``"bf16"`` (default; a block-FP8
            checkpoint is dequantized at load: measured faster on the H200), ``"deep_gemm"``
            (keeps block-FP8: half the memory, 1.4-2.0x slower on the H200 until its
            activation casts are fused), None picks ``deep_gemm`` where it runs.
        **options: ``moe_format``, ``is_mtp``, ``backend``, ``device``, ``max_num_tokens``,
            ``emulate_kernel``, ``arch``, ``reload_staging_bytes``, ``experts_path``,
            ``small_batch_max_tokens`` (see ``megamoe.core.modules.block_setup.BlockOptions``).

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
        use_aux_stream: bool | str = AUX_IN_GRAPHS,
        shared_gemm: str | None = "bf16",
        **options: Unpack[BlockOptions],
    ) -> None:
        super().__init__()
        cfg = config if isinstance(config, Qwen4ExpConfig) else Qwen4ExpConfig.from_dict(config)
        plan = plan_experts(MODEL_NAME, prefix, cfg, parallel=parallel, **options)
        self.config, self.prefix, self.is_mtp, self.device = cfg, prefix, plan.is_mtp, plan.device
        self.experts = plan.build_experts(Qwen4ExpMegaMoEExperts)
        hidden = cfg.hidden_size
        self.gate = torch.nn.Linear(
            hidden, cfg.num_experts, bias=False, device=self.device, dtype=torch.bfloat16
        )
        self.shared_expert_gate = torch.nn.Linear(
            hidden, 1, bias=False, device=self.device, dtype=torch.bfloat16
        )
        self.shared_expert = SwiGLUMLP(
            hidden,
            cfg.shared_expert_intermediate_size,
            checkpoint_format=detect_mlp_format(
                cfg.quantization_config, f"{prefix}.{SHARED_EXPERT}"
            ),
            device=self.device,
            prefix=f"{prefix}.{SHARED_EXPERT}",
            gemm=shared_gemm,
        )
        for linear in (self.gate, self.shared_expert_gate):
            linear.weight.requires_grad_(False)
        self.aux_stream = AuxStream(self.device, enabled=use_aux_stream)
        self._dense = DenseUpdate(prefix)
        self.router_kernel, tickets = one_launch_router(
            "softmax", plan.max_num_tokens, self.device, num_experts=cfg.num_experts,
            top_k=cfg.num_experts_per_tok, norm_topk_prob=cfg.norm_topk_prob,
        )  # fmt: skip
        self.router_tickets: torch.Tensor
        self.register_buffer("router_tickets", tickets, persistent=False)
        scratch = router_scratch(
            self.router_kernel, plan.max_num_tokens, cfg.hidden_size, self.device
        )
        self.router_scratch: torch.Tensor | None
        self.register_buffer("router_scratch", scratch, persistent=False)
        self._gated_add = fused_combine(self.device)

    # -- forward ---------------------------------------------------------------------------

    def route(
        self, hidden_states: torch.Tensor, dispatch: DispatchBuffer | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k routing weights (float32) and expert ids (int32) of each token.

        Logits precision: float32, from the bf16 input and router weight (exact products,
        float32 sums: ``router_logits``). transformers computes them in the model dtype
        (bf16); a bf16 GEMM's result depends on the kernel's accumulation order and output
        rounding, so bf16 logits would not reproduce the model's choice at near-ties anyway,
        while float32 logits are the closest to the exact product. Away from near-ties both
        pick the same experts (checked against transformers).

        The k largest logits are the k largest softmax probabilities (softmax is monotone),
        so the ids come from the logits. With ``norm_topk_prob`` the weights are the softmax
        of the k chosen logits, which is the chosen probabilities divided by their sum (no
        epsilon), within float32 rounding, and never needs the other experts' exponentials;
        without it, softmax over all experts in float32, then top-k.

        On CUDA with Triton (E <= 512, top-k <= 16) all of it is one kernel launch under
        ``matmul_tokens`` (64 for 256 experts or more, else 256; eagerly up to 1024 tokens
        under 256 experts), cuBLAS's logits and the kernel's selection from there
        (``megamoe.core.kernels.router_triton``, softmax scoring: the same rule, its own
        float32 summation order and ``exp``); elsewhere four torch operations. The kernel
        also fills ``dispatch`` when given (the experts' ``dispatch_buffer()``).

        Raises:
            ValueError: a ``dispatch`` where the kernel does not run (no Triton, CPU).
        """
        if self.router_kernel is not None and hidden_states.is_cuda:
            weights, ids, _ = self.router_kernel.route(
                hidden_states, self.gate.weight, self.router_tickets, dispatch=dispatch,
                scratch=self.router_scratch,
            )  # fmt: skip
            return weights, ids
        if dispatch is not None:
            raise ValueError(
                f"{self.prefix}: route() got a dispatch buffer, but the one-launch router "
                f"does not run on {hidden_states.device} (Triton "
                f"{'present' if TRITON_AVAILABLE else 'missing'}); route without one"
            )
        return softmax_topk(
            router_logits(hidden_states, self.gate.weight),
            self.config.num_experts_per_tok,
            self.config.norm_topk_prob,
        )

    def shared_gate(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``sigmoid(shared_expert_gate(x))`` in float32, (tokens, 1).

        The gate's logit is float32 (exact products, float32 sums: ``router_logits``), as
        the routing logits are; transformers rounds it to bf16 first.
        """
        return torch.sigmoid(router_logits(hidden_states, self.shared_expert_gate.weight))

    def shared_output(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The shared expert times ``sigmoid(shared_expert_gate(x))``, float32."""
        return self.shared_expert(hidden_states).float() * self.shared_gate(hidden_states)

    def combine(
        self, routed: torch.Tensor, shared: torch.Tensor, hidden_states: torch.Tensor
    ) -> torch.Tensor:
        """``routed + shared_gate(x) * shared`` in float32, rounded to bf16 once.

        On CUDA with Triton one launch (``combine_triton.gated_add``: the same rule, its own
        float32 summation order for the gate's logit); elsewhere the float32 gate and one
        ``addcmul``.
        """
        if self._gated_add is not None and hidden_states.is_cuda:
            return self._gated_add(routed, shared, hidden_states, self.shared_expert_gate.weight)
        gate = self.shared_gate(hidden_states)
        return torch.addcmul(routed, shared, gate).to(torch.bfloat16)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Routed plus gated shared-expert output (see ``MoEBlock.forward`` and ``combine``)."""
        check_hidden_states(self.prefix, hidden_states, self.config.hidden_size, self.device)
        # The router kernel writes the kernel's inputs itself where it can: no pre-dispatch.
        kernel = self.router_kernel
        dispatch = None if kernel is None else self.experts.dispatch_buffer(hidden_states)
        routed, (shared,) = self.aux_stream.schedule(
            lambda: (self.shared_expert(hidden_states),),
            lambda: self.route(hidden_states, dispatch),
            lambda weights, ids: self.experts(
                hidden_states, weights, ids, dispatched=dispatch is not None
            ),
            tokens=hidden_states.shape[0],
        )
        return self.combine(routed, shared, hidden_states)

    # -- loading ---------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load tensors named relative to the block prefix, in any order and chunking.

        Names: ``gate.weight`` (router, (E, H)), ``shared_expert_gate.weight`` ((1, H)),
        ``shared_expert.{gate,up,down}_proj.{weight,<scale>}`` and ``experts.*`` (see
        ``Qwen4ExpMegaMoEExperts.load_weights``). The first load writes the router, gate
        and shared expert straight in; after a successful ``finalize()`` they are staged and
        ``finalize()`` commits them with the expert update. Any error drops the whole
        pending update (``discard_pending``): the previous weights keep serving.

        Returns:
            The names loaded or accepted.

        Raises:
            ValueError: an unexpected name (naming the expected ones), a shape or dtype
                that does not match.
            NonFiniteError: a routed-expert tensor holds NaN or infinity.
        """
        loaded: set[str] = set()
        with discard_on_error(self), self.experts.loading():
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
                        f"{self.prefix}: unexpected tensor {name!r}; a Qwen4Exp MoE block "
                        f"loads {ROUTER}, {SHARED_GATE}, {SHARED_EXPERT}.{{gate,up,down}}_proj.* "
                        f"and {EXPERTS}.* ({self.experts.expected_names()})"
                    )
                loaded.add(name)
        return loaded

    def _load_dense(self, name: str, tensor: torch.Tensor) -> None:
        """Load the router or the shared-expert gate, checking shape, dtype and values."""
        param = (self.gate if name == ROUTER else self.shared_expert_gate).weight
        note = f"out, hidden_size={self.config.hidden_size}"
        self._dense.load(name, param, tensor, shape_note=note)

    def discard_pending(self) -> None:
        """Forget every tensor loaded since the last successful ``finalize()``."""
        self.experts.discard_pending()
        self._dense.discard_pending()
        self.shared_expert.discard_pending()

    def finalize(self) -> None:
        """Check every tensor arrived, commit the experts' update, then the dense tensors.

        Router, gate and shared expert change only here, in place, and only once the
        experts' update succeeded. An incomplete load keeps the update pending (load the
        missing tensors and finalize again); any other error drops it.

        Raises:
            ValueError: the router or shared-expert gate was never loaded.
            IncompleteShardsError: an expert or shared-expert projection lacks a half.
            MissingExpertsError: local experts that never received their tensors.
        """
        self._dense.check_loaded((ROUTER, SHARED_GATE))
        self.shared_expert.check_loaded()
        with discard_on_error(self, keep=(IncompleteShardsError, MissingExpertsError)):
            self.experts.finalize()
        self._dense.commit()
        self.shared_expert.commit()
