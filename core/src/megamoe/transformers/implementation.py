"""The ``"megamoe"`` experts implementation: registration, building and the forward.

transformers calls an experts implementation as ``fn(experts_module, hidden_states,
top_k_index, top_k_weights)`` in place of the module's own loop. The first call for a
module (or ``prepare(model)``, ahead of time) builds a ``MegaMoEExperts`` from what
transformers loaded into it (``loaded_experts``), registers it as the module's child
``megamoe`` and deletes transformers' expert tensors, so the weights are held once. The
forward then runs it, splitting batches larger than its ``max_num_tokens`` into chunks.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
from transformers.integrations.moe import ExpertsInterface

from megamoe.core.modules.experts import MegaMoEExperts
from megamoe.core.modules.experts_backend import check_experts_path, check_small_batch_max_tokens
from megamoe.core.numerics.formats import ARCH_REFERENCE, WeightFormat, detect_arch, resolve_formats
from megamoe.transformers.loaded_experts import (
    ROUNDED_TO_BF16,
    LoadedExperts,
    is_experts_module,
    read_experts,
)

IMPLEMENTATION = "megamoe"  # the experts_implementation name
CHILD = "megamoe"  # the experts module's child that holds megamoe's experts
# Tokens one call of megamoe's experts takes; DeepGEMM sizes its buffer (shared by every
# layer of one shape) from it. Larger batches (a long prefill) run in chunks.
DEFAULT_MAX_NUM_TOKENS = 2048


def register() -> None:
    """Register ``"megamoe"`` for BF16 and block-FP8 experts (idempotent).

    Both of transformers' registries take it: ``ExpertsInterface`` serves the models' own
    experts classes, ``FP8ExpertsInterface`` the ``FP8Experts`` of block-FP8 models.
    """
    ExpertsInterface.register(IMPLEMENTATION, megamoe_experts_forward)
    FP8ExpertsInterface.register(IMPLEMENTATION, megamoe_experts_forward)


def megamoe_experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """Routed-expert output of one transformers experts module, computed by megamoe.

    Args:
        self: the transformers experts module.
        hidden_states: (T, H) bfloat16; a float32 or float16 model's are rounded to
            bfloat16 (as its experts were: ``build_experts``).
        top_k_index: (T, k) expert ids.
        top_k_weights: (T, k) routing weights (any float dtype; megamoe takes float32).

    Returns:
        (T, H) in the dtype of ``hidden_states``.
    """
    experts = self._modules.get(CHILD)
    if not isinstance(experts, MegaMoEExperts):
        experts = build_experts(self, type(self).__name__)
    weights = top_k_weights.to(torch.float32)
    dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.bfloat16)
    step = experts.max_num_tokens
    if hidden_states.shape[0] <= step:
        return experts(hidden_states, weights, top_k_index).to(dtype)
    chunks = [
        experts(hidden_states[s : s + step], weights[s : s + step], top_k_index[s : s + step])
        for s in range(0, hidden_states.shape[0], step)
    ]
    return torch.cat(chunks).to(dtype)


def build_experts(
    module: torch.nn.Module,
    name: str,
    *,
    max_num_tokens: int = DEFAULT_MAX_NUM_TOKENS,
    backend: str = "auto",
    moe_format: WeightFormat | str | None = None,
    process_group: dist.ProcessGroup | None = None,
    experts_path: str = "auto",
    small_batch_max_tokens: int | None = None,
) -> MegaMoEExperts:
    """Move one experts module's weights into megamoe's experts (its child ``megamoe``).

    The run format is the stored one where the target runs it, else what megamoe converts
    it to (``resolve_formats``; e.g. BF16 -> block-FP8 on Hopper, with a warning). Experts
    of a float32 or float16 model are taken over rounded to BF16 (then to the run format),
    and their inputs rounded alike: one warning says so. The module's ``gate_up_proj`` /
    ``down_proj`` (and FP8 scales) are deleted afterwards.

    Args:
        module: a transformers experts module with its weights loaded.
        name: its name in the model, for messages.
        max_num_tokens: most tokens per call of the experts (larger batches are chunked).
        backend: ``"auto"`` (DeepGEMM where it runs the format, else the reference),
            ``"reference"`` or ``"deepgemm"``.
        moe_format: run format to force; None decides as above.
        process_group: a one-rank group to run over; None makes one where DeepGEMM needs it.
        experts_path: ``"auto"`` (on a Hopper GPU with block-FP8 experts, calls of few
            tokens run the small-batch kernels, larger ones MegaMoE), ``"small_batch"`` or
            ``"megamoe"`` (see ``megamoe.core.modules.experts.MegaMoEExperts``).
        small_batch_max_tokens: the most tokens per call the small-batch path takes (its
            scratch is sized for them); None leaves it to ``experts_path``.

    Returns:
        The finalized experts.

    Raises:
        NotImplementedError: a module megamoe cannot run (see ``read_experts``), or a
            process group of several ranks.
        ValueError / CapabilityError: sizes, formats, options or a backend that cannot run
            here.
        TypeError: a ``small_batch_max_tokens`` that is not an int.
    """
    if process_group is not None and process_group.size() != 1:
        raise NotImplementedError(
            f"{name}: process_group has {process_group.size()} ranks; megamoe in transformers "
            "runs every expert on one rank: pass a one-rank group (torch.distributed."
            "new_group([rank]) on every rank) or None"
        )
    loaded = read_experts(module, name)
    target = ARCH_REFERENCE if backend == "reference" else detect_arch(loaded.device)
    _, run_format = resolve_formats(loaded.checkpoint_format, moe_format, target)
    _warn_rounding(loaded, run_format)
    # Built outside inference mode: the kernel tensors are rewritten in place on reloads.
    with torch.inference_mode(False), torch.no_grad():
        experts = MegaMoEExperts(
            num_experts=loaded.num_experts,
            num_local_experts=loaded.num_experts,
            experts_start_idx=0,
            num_logical_experts=loaded.num_experts,
            top_k=loaded.top_k,
            hidden_size=loaded.hidden_size,
            intermediate_size=loaded.intermediate_size,
            weight_format=run_format,
            checkpoint_format=loaded.checkpoint_format,
            max_num_tokens=max_num_tokens,
            process_group=process_group,
            backend=backend,
            device=loaded.device,
            prefix=name,
            swiglu_limit=loaded.swiglu_limit,
            experts_path=experts_path,
            small_batch_max_tokens=small_batch_max_tokens,
        )
        experts.load_weights(loaded.named_tensors())
        experts.finalize()
    for param in loaded.params:
        delattr(module, param)
    module.add_module(CHILD, experts)
    return experts


def _warn_rounding(loaded: LoadedExperts, run_format: WeightFormat) -> None:
    """Warn (once per dtype and run format: the text names no layer) of the BF16 rounding."""
    if loaded.source_dtype not in ROUNDED_TO_BF16:
        return
    then = "" if run_format is WeightFormat.BF16 else f" (then as {run_format.value})"
    warnings.warn(
        f"megamoe takes over the model's {loaded.source_dtype} experts in bfloat16{then}: "
        "their weights and the tokens they get are rounded to bfloat16 (8 significant bits; "
        f"outputs about 1e-2 relative from {loaded.source_dtype} experts); to keep "
        f"{loaded.source_dtype}, use experts_implementation='grouped_mm'",
        UserWarning,
        stacklevel=3,
    )


def prepare(
    model: torch.nn.Module,
    *,
    max_num_tokens: int = DEFAULT_MAX_NUM_TOKENS,
    backend: str = "auto",
    moe_format: WeightFormat | str | None = None,
    process_group: dist.ProcessGroup | None = None,
    experts_path: str = "auto",
    small_batch_max_tokens: int | None = None,
) -> list[str]:
    """Switch ``model`` to ``"megamoe"`` and build every MoE layer's experts now.

    Optional: without it each layer is built with the defaults at its first forward. Call
    it right after ``from_pretrained`` to choose the options, to have the memory settle
    before the first batch, or before capturing CUDA graphs.

    Args:
        model: a transformers ``PreTrainedModel`` with experts modules.
        max_num_tokens: see ``build_experts``, as the other options.
        backend: see ``build_experts``.
        moe_format: see ``build_experts``.
        process_group: see ``build_experts``.
        experts_path: see ``build_experts``.
        small_batch_max_tokens: see ``build_experts``.

    Returns:
        The names of the experts modules now run by megamoe.

    Raises:
        TypeError: ``model`` is not a transformers model, or a ``small_batch_max_tokens``
            that is not an int.
        ValueError: ``model`` has no experts module transformers dispatches, or an
            ``experts_path`` / ``small_batch_max_tokens`` it cannot take (refused before any
            module changes).
        RuntimeError: a module already runs on megamoe (built by an earlier forward or
            ``prepare``): its transformers weights are gone, so it cannot be rebuilt.
        NotImplementedError / CapabilityError: as ``build_experts``.
    """
    set_implementation = getattr(model, "set_experts_implementation", None)
    if set_implementation is None:
        raise TypeError(
            f"prepare() takes a transformers PreTrainedModel, got {type(model).__name__}; "
            "pass the model from_pretrained returned"
        )
    check_small_batch_max_tokens(
        small_batch_max_tokens, check_experts_path(experts_path, "prepare()"), "prepare()"
    )
    modules = [(n, m) for n, m in model.named_modules() if is_experts_module(m)]
    if not modules:
        raise ValueError(
            f"{type(model).__name__} has no experts module that transformers dispatches through "
            "experts_implementation (classes decorated with use_experts_implementation); "
            "megamoe has nothing to run"
        )
    built = [n for n, m in modules if CHILD in m._modules]
    if built:
        raise RuntimeError(
            f"{built[0]} already runs on megamoe (built at its first forward or by an earlier "
            "prepare()); call prepare() once, right after from_pretrained and before the "
            "first forward"
        )
    set_implementation(IMPLEMENTATION)
    for name, module in modules:
        build_experts(
            module,
            name,
            max_num_tokens=max_num_tokens,
            backend=backend,
            moe_format=moe_format,
            process_group=process_group,
            experts_path=experts_path,
            small_batch_max_tokens=small_batch_max_tokens,
        )
    return [name for name, _ in modules]
