"""The setup every adapter's MoE block shares before it builds its model-specific parts.

A block checks the parallel settings, decides which physical experts this rank holds,
detects how the checkpoint stores the routed experts and picks the format they run in
(the MTP drafter's layers never take a forced one). ``plan_experts`` does all of that and
hands back an ``ExpertPlan`` whose ``build_experts`` constructs the block's
``MegaMoEExperts`` subclass; the block keeps only what is its model's own (router, shared
expert; their safe reload is ``megamoe.core.loading.dense_update``). ``check_hidden_states`` is
the input check of every block's ``forward``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar

import torch
import torch.distributed as dist

from megamoe.core.checkpoint.hf_config import MoEConfig
from megamoe.core.checkpoint.quant_config import detect_expert_format
from megamoe.core.modules.fixed_module import same_device
from megamoe.core.modules.parallel import ParallelSettings
from megamoe.core.numerics.formats import ARCH_REFERENCE, WeightFormat, detect_arch, resolve_formats

if TYPE_CHECKING:
    from megamoe.core.modules.experts import MegaMoEExperts

logger = logging.getLogger("megamoe")

MTP_PREFIX = "mtp."  # tensor prefix of the MTP drafter's layers
EXPERTS = "experts"  # module name of the routed experts inside a block
_logged: set[tuple[str, WeightFormat, WeightFormat]] = set()
E = TypeVar("E", bound="MegaMoEExperts")


class BlockOptions(TypedDict, total=False):
    """Keyword options every adapter's block constructor takes, all optional.

    Attributes:
        moe_format: run format to force (``"mxfp8"``, ``WeightFormat.MXFP4``, ...); None
            runs the experts as stored where the target can, else converts with a warning.
            Ignored by the MTP drafter's layers, which take the default.
        is_mtp: whether the block belongs to the MTP drafter; None infers it from the
            prefix (``mtp.``).
        backend: ``"auto"`` (default), ``"reference"`` or ``"deepgemm"``.
        device: where weights and activations live (None = CPU).
        max_num_tokens: most tokens one forward on this rank may carry (default 256).
        emulate_kernel: reference backend: round activations as the kernel does.
        arch: target kernel family (``sm90``, ``sm100``, ``reference``) that decides the
            run format; None derives it from ``backend`` and ``device``.
        reload_staging_bytes: the most a reload of the routed experts stages before it
            writes in place (``megamoe.core.loading.expert_loading``); None: 1/16 of their bytes.
        experts_path: ``"auto"`` (default), ``"small_batch"`` or ``"megamoe"``: which path
            runs the routed experts on one Hopper rank, by the call's token count or forced
            (``megamoe.core.backends.small_batch``).
        small_batch_max_tokens: the most tokens per call the small-batch path takes, and so
            what its scratch holds; None (default) leaves it to ``experts_path``, larger
            calls run MegaMoE (``megamoe.core.modules.experts.MegaMoEExperts``).
    """

    moe_format: WeightFormat | str | None
    is_mtp: bool | None
    backend: str
    device: torch.device | str | None
    max_num_tokens: int
    emulate_kernel: bool
    arch: str | None
    reload_staging_bytes: int | None
    experts_path: str
    small_batch_max_tokens: int | None


@dataclass(frozen=True)
class ExpertPlan:
    """Where and how one block's routed experts run on this rank.

    Attributes:
        prefix: the block's tensor prefix, e.g. ``model.layers.3.mlp``.
        is_mtp: the block belongs to the MTP drafter.
        device: where weights and activations live.
        checkpoint_format: how the checkpoint stores the routed experts.
        run_format: the format they run in.
        num_logical_experts: routed experts of the model.
        num_physical_experts: physical experts over all ranks (EPLB replicas included).
        num_local_experts: physical experts on this rank.
        experts_start_idx: first physical expert of this rank (linear placement).
        top_k: experts per token.
        hidden_size: H.
        intermediate_size: I of one routed expert.
        backend: the ``backend`` option.
        max_num_tokens: most tokens one forward on this rank may carry.
        emulate_kernel: the ``emulate_kernel`` option.
        swiglu_limit: the model's SwiGLU clamp (``MoEConfig.swiglu_limit``), None for none.
        reload_staging_bytes: the ``reload_staging_bytes`` option.
        experts_path: the ``experts_path`` option.
        small_batch_max_tokens: the ``small_batch_max_tokens`` option.
        process_group: the expert-parallel group.
    """

    prefix: str
    is_mtp: bool
    device: torch.device
    checkpoint_format: WeightFormat
    run_format: WeightFormat
    num_logical_experts: int
    num_physical_experts: int
    num_local_experts: int
    experts_start_idx: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    backend: str
    max_num_tokens: int
    emulate_kernel: bool
    swiglu_limit: float | None = None
    reload_staging_bytes: int | None = None
    experts_path: str = "auto"
    small_batch_max_tokens: int | None = None
    process_group: dist.ProcessGroup | None = field(default=None, compare=False)

    @property
    def experts_prefix(self) -> str:
        """Tensor prefix of the routed experts, ``{prefix}.experts``."""
        return f"{self.prefix}.{EXPERTS}"

    def build_experts(self, experts_class: type[E], **extra: Any) -> E:
        """This rank's routed experts as planned, an instance of ``experts_class``.

        Args:
            experts_class: ``MegaMoEExperts`` or the block's subclass of it.
            **extra: further constructor arguments (e.g. ``num_shared_experts``).

        Raises:
            ValueError: sizes the experts cannot run (see ``MegaMoEExperts``).
        """
        return experts_class(
            num_experts=self.num_physical_experts,
            num_local_experts=self.num_local_experts,
            experts_start_idx=self.experts_start_idx,
            num_logical_experts=self.num_logical_experts,
            top_k=self.top_k,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            weight_format=self.run_format,
            checkpoint_format=self.checkpoint_format,
            max_num_tokens=self.max_num_tokens,
            process_group=self.process_group,
            backend=self.backend,
            device=self.device,
            prefix=self.experts_prefix,
            emulate_kernel=self.emulate_kernel,
            swiglu_limit=self.swiglu_limit,
            reload_staging_bytes=self.reload_staging_bytes,
            experts_path=self.experts_path,
            small_batch_max_tokens=self.small_batch_max_tokens,
            **extra,
        )


def target_arch(arch: str | None, backend: str, device: torch.device) -> str:
    """What a layer's formats are resolved for: ``arch``, else the backend's or device's."""
    return arch or (ARCH_REFERENCE if backend == "reference" else detect_arch(device))


def plan_experts(
    model_name: str,
    prefix: str,
    config: MoEConfig,
    *,
    parallel: ParallelSettings,
    moe_format: WeightFormat | str | None = None,
    is_mtp: bool | None = None,
    backend: str = "auto",
    device: torch.device | str | None = None,
    max_num_tokens: int = 256,
    emulate_kernel: bool = False,
    arch: str | None = None,
    reload_staging_bytes: int | None = None,
    experts_path: str = "auto",
    small_batch_max_tokens: int | None = None,
) -> ExpertPlan:
    """Check the settings of one MoE block and decide its experts' split and formats.

    The first time a (model, checkpoint format, run format) combination is planned, the
    choice is logged (INFO, logger ``megamoe``).

    Args:
        model_name: model name for messages, e.g. ``"Qwen4Exp"``.
        prefix: the block's tensor prefix.
        config: the parsed model config.
        parallel: expert-parallel group (required: a group of size 1 for one device),
            placement (linear), tensor-parallel size (1) and redundant experts.
        moe_format: see ``BlockOptions``, as the other keyword arguments.
        is_mtp: see ``BlockOptions``.
        backend: see ``BlockOptions``.
        device: see ``BlockOptions``.
        max_num_tokens: see ``BlockOptions``.
        emulate_kernel: see ``BlockOptions``.
        arch: see ``BlockOptions``.
        reload_staging_bytes: see ``BlockOptions``.
        experts_path: see ``BlockOptions``.
        small_batch_max_tokens: see ``BlockOptions``.

    Returns:
        The plan.

    Raises:
        NotImplementedError: no expert-parallel group, tensor parallel > 1, non-linear
            placement, or a checkpoint format megamoe cannot load (each names the setting).
        ValueError: physical experts that do not split evenly over the EP ranks, or a
            ``moe_format`` the target cannot run.
    """
    parallel.check_megamoe(model_name)
    num_logical = config.num_routed_experts
    num_physical = num_logical + parallel.num_redundant_experts
    if num_physical % parallel.ep_size:
        raise ValueError(
            f"{prefix}: {num_physical} physical experts ({num_logical} routed + "
            f"num_redundant_experts={parallel.num_redundant_experts}) do not split evenly "
            f"over {parallel.ep_size} expert-parallel ranks; change num_redundant_experts "
            "so that the total is a multiple of the EP size"
        )
    num_local = num_physical // parallel.ep_size
    mtp = prefix.startswith(MTP_PREFIX) if is_mtp is None else is_mtp
    where = torch.device("cpu") if device is None else torch.device(device)
    checkpoint_format = detect_expert_format(
        config.quantization_config, f"{prefix}.{EXPERTS}", num_experts=num_logical
    )
    target = target_arch(arch, backend, where)
    _, run_format = resolve_formats(checkpoint_format, None if mtp else moe_format, target)
    if (model_name, checkpoint_format, run_format) not in _logged:
        _logged.add((model_name, checkpoint_format, run_format))
        logger.info(
            "%s MegaMoE runs %s routed experts (checkpoint: %s)",
            model_name,
            run_format.value,
            checkpoint_format.value,
        )
    return ExpertPlan(
        prefix=prefix,
        is_mtp=mtp,
        device=where,
        checkpoint_format=checkpoint_format,
        run_format=run_format,
        num_logical_experts=num_logical,
        num_physical_experts=num_physical,
        num_local_experts=num_local,
        experts_start_idx=parallel.ep_rank * num_local,
        top_k=config.num_experts_per_tok,
        hidden_size=config.hidden_size,
        intermediate_size=config.moe_intermediate_size,
        backend=backend,
        max_num_tokens=max_num_tokens,
        emulate_kernel=emulate_kernel,
        swiglu_limit=config.swiglu_limit,
        reload_staging_bytes=reload_staging_bytes,
        experts_path=experts_path,
        small_batch_max_tokens=small_batch_max_tokens,
        process_group=parallel.ep_group,
    )


def check_hidden_states(
    prefix: str, hidden_states: torch.Tensor, hidden_size: int, device: torch.device
) -> None:
    """Refuse a block input that is not ``(tokens, hidden_size)`` bfloat16 on ``device``.

    Args:
        prefix: the block's tensor prefix, for the message.
        hidden_states: the input.
        hidden_size: the model width.
        device: the block's device.

    Raises:
        ValueError: a shape other than ``(tokens, hidden_size)``, or another device.
        TypeError: a dtype other than bfloat16.
    """
    if hidden_states.dim() != 2 or hidden_states.shape[1] != hidden_size:
        flat = (
            f"; flatten (batch, sequence, hidden) inputs with .reshape(-1, {hidden_size})"
            if hidden_states.dim() > 2 and hidden_states.shape[-1] == hidden_size
            else ""
        )
        raise ValueError(
            f"{prefix}: hidden_states has shape {tuple(hidden_states.shape)}, expected "
            f"(tokens, {hidden_size}): one row of hidden_size={hidden_size} per token{flat}"
        )
    if not same_device(hidden_states.device, device):
        raise ValueError(
            f"{prefix}: hidden_states is on {hidden_states.device}, the block on {device}; "
            f"move the activations with .to({str(device)!r})"
        )
    if hidden_states.dtype != torch.bfloat16:
        raise TypeError(
            f"{prefix}: hidden_states has dtype {hidden_states.dtype}, expected "
            "torch.bfloat16; cast the activations with .to(torch.bfloat16)"
        )
