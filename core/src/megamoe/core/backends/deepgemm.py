"""DeepGEMM MegaMoE backend (SPEC §3.5): one fused kernel per MoE layer forward.

Kernel kinds, chosen by the device architecture and the run format:

- ``sm90_fp8`` (Hopper, FP8_BLOCK): ``fp8_mega_moe``. Activations are cast to FP8 with
  float32 1x128 scales by ``mega_moe_pre_dispatch_sm90``; the weights keep their float32
  128x128 block scales in [gate | up] order while ``transform_weights_for_mega_moe_sm90``
  interleaves the gate and up rows of ``w13`` in groups of 8.
- ``fp8xfp4`` / ``fp8xfp8`` (SM100, MXFP4 / MXFP8): ``fp8_fp4_mega_moe``. Activations are
  cast to MXFP8 (UE8M0 1x32 scales); weight scales become packed UE8M0 int32 in DeepGEMM's
  layout (``transform_sf_into_required_layout``) before ``transform_weights_for_mega_moe``
  interleaves gate/up and rearranges the scales.
- ``bf16xbf16`` (SM100, BF16): ``bf16_mega_moe``.

What the installed DeepGEMM can do is read from its API (the functions it exposes), never
from version strings. The experts store their weights in the kernel's row order, so the
kernel reads them in place; what the kernel needs beyond them (SM100's packed scales) is
built expert by expert into tensors allocated once (``deepgemm_layout``), so finalizing
needs one expert's temporaries, and a reload rewrites only the changed experts, in place.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch

from megamoe.core.backends import small_batch
from megamoe.core.backends.deepgemm_layout import (
    KIND_BF16,
    KIND_FP8XFP4,
    KIND_FP8XFP8,
    KIND_SM90,
    L1_ROW_ORDER,
    KernelLayout,
    takes,
    transform_expert,
)
from megamoe.core.backends.symm_buffer import (
    BufferKey,
    SymmBufferEntry,
    check_group,
    get_symm_buffer,
    resolve_group,
)
from megamoe.core.errors import CapabilityError, KernelSizeError
from megamoe.core.loading.l1_order import L1RowOrder
from megamoe.core.loading.tagging import KernelTag, check_tags
from megamoe.core.modules.experts_backend import ExpertsBackend
from megamoe.core.numerics import quant
from megamoe.core.numerics.dispatch import DispatchBuffer
from megamoe.core.numerics.formats import (
    ARCH_REFERENCE,
    ARCH_SM90,
    ARCH_SM100,
    RUNNABLE_FORMATS,
    WeightFormat,
    detect_arch,
)

if TYPE_CHECKING:
    from megamoe.core.modules.experts import MegaMoEExperts

KERNEL_KINDS = {
    (ARCH_SM90, WeightFormat.FP8_BLOCK): KIND_SM90,
    (ARCH_SM100, WeightFormat.MXFP4): KIND_FP8XFP4,
    (ARCH_SM100, WeightFormat.MXFP8): KIND_FP8XFP8,
    (ARCH_SM100, WeightFormat.BF16): KIND_BF16,
}
PIP_PACKAGE = "sgl-deep-gemm"  # a DeepGEMM build with the Hopper and SM100 MegaMoE kernels
SM90_MAX_INTERMEDIATE = 4096  # fp8_mega_moe requires intermediate / 64 <= 64
# The Hopper kernel's buffer holds each token's float32 scales, H / 128 of the activations
# and I / 64 of the intermediate ones, in rows that TMA reads in 16-byte units: hidden sizes
# are multiples of 512 and intermediate ones of 256 (sgl-deep-gemm 0.1.4.post1 asserts it in
# its buffer's layout, 0.2.5 in so many words).
SM90_HIDDEN_MULTIPLE = 512
SM90_INTERMEDIATE_MULTIPLE = 256

_BUFFER_FN = "get_symm_buffer_for_mega_moe"
_SM100_FP8_API = (
    _BUFFER_FN,
    "transform_sf_into_required_layout",
    "transform_weights_for_mega_moe",
    "fp8_fp4_mega_moe",
)
REQUIRED_API: dict[str, tuple[str, ...]] = {
    KIND_SM90: (
        _BUFFER_FN,
        "transform_weights_for_mega_moe_sm90",
        "mega_moe_pre_dispatch_sm90",
        "fp8_mega_moe",
    ),
    KIND_FP8XFP4: _SM100_FP8_API,
    KIND_FP8XFP8: _SM100_FP8_API,
    KIND_BF16: (_BUFFER_FN, "transform_weights_for_mega_moe", "bf16_mega_moe"),
}
# FP8xFP8 has no entry point of its own: it is fp8_fp4_mega_moe on a buffer built with
# mma_type="fp8xfp8". It is taken as present when the buffer factory takes
# ``num_shared_experts``, the API generation that documents that mma_type; a build that
# still refuses it fails at buffer allocation with a CapabilityError.
FP8XFP8_MARKER = "num_shared_experts"
# Keyword of the MegaMoE entry points that clamps the SwiGLU inputs (GLM's swiglu_limit).
CLAMP_KEYWORD = "activation_clamp"
# sgl-deep-gemm 0.2.5's SM100 entry points take fused shared experts' weights
# (``shared_l1_weights`` / ``shared_l2_weights``, laid out as the routed experts'), for a
# buffer built with ``num_shared_experts``; 0.1.4.post1's take none.
SHARED_KEYWORDS = ("shared_l1_weights", "shared_l2_weights")
# 0.2.5's fp8_mega_moe takes an upper bound of every rank's tokens in this call, to pick
# its schedule by the call instead of by the buffer capacity.
BOUND_KEYWORD = "num_tokens_bound"
KERNEL_FUNCTIONS = {
    KIND_SM90: "fp8_mega_moe",
    KIND_FP8XFP4: "fp8_fp4_mega_moe",
    KIND_FP8XFP8: "fp8_fp4_mega_moe",
    KIND_BF16: "bf16_mega_moe",
}


def _device_arch(device: torch.device) -> str:
    """Kernel family of ``device`` (a seam for tests that fake an architecture)."""
    return detect_arch(device)


def load_deep_gemm() -> ModuleType:
    """Import the installed ``deep_gemm``.

    Raises:
        ImportError: it is missing or fails to load; the message names the pip package.
    """
    try:
        return importlib.import_module("deep_gemm")
    except Exception as exc:  # a broken build fails with OSError/RuntimeError too
        raise ImportError(
            f"deep_gemm does not import ({type(exc).__name__}: {exc}); "
            f"pip install {PIP_PACKAGE} (a build matching this torch and CUDA)"
        ) from exc


def missing_api(module: ModuleType, kind: str) -> list[str]:
    """Names of what ``module`` lacks for kernel ``kind`` (empty when it has everything)."""
    missing = [n for n in REQUIRED_API[kind] if not callable(getattr(module, n, None))]
    if (
        kind == KIND_FP8XFP8
        and not missing
        and not takes(module.get_symm_buffer_for_mega_moe, FP8XFP8_MARKER)
    ):
        missing.append(f"{_BUFFER_FN}(mma_type='fp8xfp8') (no {FP8XFP8_MARKER} parameter)")
    return missing


def fuses_shared(module: ModuleType, kind: str) -> bool:
    """Whether ``module``'s kernel of ``kind`` runs fused shared experts."""
    kernel = getattr(module, KERNEL_FUNCTIONS[kind], None)
    return (
        kind != KIND_SM90
        and all(takes(kernel, keyword) for keyword in SHARED_KEYWORDS)
        and takes(getattr(module, _BUFFER_FN, None), FP8XFP8_MARKER)
    )


def supported_kinds(module: ModuleType) -> frozenset[str]:
    """The MegaMoE kernel kinds ``module`` exposes."""
    return frozenset(kind for kind in REQUIRED_API if not missing_api(module, kind))


def resolve_kernel(
    run_format: WeightFormat | str, device: torch.device | str
) -> tuple[ModuleType, str]:
    """The ``deep_gemm`` module and kernel kind that run ``run_format`` on ``device``.

    Raises:
        CapabilityError: the device is not SM90/SM100, its kernel does not run the format,
            or the installed DeepGEMM lacks a function it needs (named).
        ImportError: ``deep_gemm`` is not installed or fails to load.
    """
    fmt, dev = WeightFormat.parse(run_format), torch.device(device)
    arch = _device_arch(dev)
    if arch == ARCH_REFERENCE:
        cuda = "" if torch.cuda.is_available() else " (CUDA is not available)"
        raise CapabilityError(
            f"{dev} is not a CUDA device of a MegaMoE architecture (SM90 Hopper or SM100 "
            f"Blackwell){cuda}"
        )
    kind = KERNEL_KINDS.get((arch, fmt))
    if kind is None:
        runs = ", ".join(sorted(f.value for f in RUNNABLE_FORMATS[arch]))
        raise CapabilityError(
            f"the {arch} MegaMoE kernel does not run {fmt.value} experts (it runs {runs}); "
            "pick one of those as the run format (moe_format) or use backend='reference'"
        )
    module = load_deep_gemm()
    missing = missing_api(module, kind)
    if missing:
        raise CapabilityError(
            f"the installed deep_gemm lacks {', '.join(missing)}, needed by the {kind} "
            f"MegaMoE kernel on {arch}; pip install {PIP_PACKAGE} (a build with MegaMoE)"
        )
    return module, kind


def check_sm90_sizes(label: str, hidden: int, intermediate: int) -> None:
    """Refuse expert sizes the Hopper ``fp8_mega_moe`` kernel does not run.

    Hidden sizes are multiples of ``SM90_HIDDEN_MULTIPLE`` and intermediate sizes of
    ``SM90_INTERMEDIATE_MULTIPLE``, at most ``SM90_MAX_INTERMEDIATE``.

    Raises:
        KernelSizeError: naming ``label``, both sizes, the rule and ``backend='reference'``.
    """
    if hidden % SM90_HIDDEN_MULTIPLE or intermediate % SM90_INTERMEDIATE_MULTIPLE:
        raise KernelSizeError(
            f"{label}: hidden_size={hidden}, intermediate_size={intermediate}; the Hopper "
            f"fp8_mega_moe kernel runs hidden sizes that are multiples of "
            f"{SM90_HIDDEN_MULTIPLE} and intermediate sizes that are multiples of "
            f"{SM90_INTERMEDIATE_MULTIPLE} (its buffer's per-token scale rows are read in "
            "16-byte units); use backend='reference' for this layer"
        )
    if intermediate > SM90_MAX_INTERMEDIATE:
        raise KernelSizeError(
            f"{label}: intermediate_size={intermediate} exceeds "
            f"{SM90_MAX_INTERMEDIATE}, the largest the Hopper fp8_mega_moe kernel runs "
            "(intermediate / 64 <= 64); use backend='reference' for this layer"
        )


def _other_device(device: torch.device) -> bool:
    """Whether ``device`` is a CUDA device other than the current one."""
    return device.type == "cuda" and device.index not in (None, torch.cuda.current_device())


_T = TypeVar("_T")


def _launch_on(device: torch.device, launch: Callable[..., _T], *args: Any) -> _T:
    """``launch(*args)`` with ``device`` current (``_on_device`` without its host time)."""
    if _other_device(device):
        with torch.cuda.device(device):
            return launch(*args)
    return launch(*args)


@contextlib.contextmanager
def _on_device(device: torch.device) -> Iterator[None]:
    """Make ``device`` current (DeepGEMM allocates and launches on the current device)."""
    if not _other_device(device):
        yield
        return
    with torch.cuda.device(device):
        yield


def _sm90_dispatch(buf: Any, experts: MegaMoEExperts) -> DispatchBuffer | None:
    """``buf``'s Hopper input rows as a ``DispatchBuffer``, None if they are laid out otherwise."""
    found = DispatchBuffer(buf.x, buf.x_sf, buf.topk_idx, buf.topk_weights)
    return found if found.fits(experts.hidden_size, experts.top_k) else None


def _contiguous_as(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` in ``dtype``, contiguous (itself, with no call, when it already is)."""
    if tensor.dtype == dtype and tensor.is_contiguous():
        return tensor
    return tensor.to(dtype).contiguous()


class DeepGemmBackend(ExpertsBackend):
    """Runs the experts through DeepGEMM's MegaMoE kernel for the device and run format.

    Every rank of the expert-parallel group must call ``forward`` for each layer (the kernel
    exchanges tokens between ranks). With ``process_group=None`` the layer runs on one rank
    over a one-rank group; see ``symm_buffer.resolve_group`` for how that group is found or
    created. Fused shared experts run inside the kernel where the installed DeepGEMM's SM100
    entry points take them (sgl-deep-gemm 0.2.5: ``shared_l1_weights``); elsewhere run the
    shared expert as a separate MLP (``megamoe.core.modules.shared_expert.SwiGLUMLP``).
    """

    name: ClassVar[str] = "deepgemm"

    def __init__(self) -> None:
        self._layout: KernelLayout | None = None
        self._shared_layout: KernelLayout | None = None
        self._entry: SymmBufferEntry | None = None
        self._kernel: tuple[ModuleType, str] | None = None
        self._bound_tokens = False  # pass num_tokens_bound (0.2.5's fp8_mega_moe, one rank)
        self._shared_args: dict[str, Any] = {}  # the fused shared experts' kernel arguments
        self._tagged: dict[str, torch.Tensor] = {}  # kernel_weights, gathered once per prepare
        self._buffer_check: tuple[KernelTag, dict[str, Any]] | None = None  # its tag, by name
        self._clamp: dict[str, float] = {}  # activation_clamp where the experts clamp
        self._dispatch: DispatchBuffer | None = None  # the Hopper buffer's inputs, if as known
        self._small: Any = None  # the small-batch kernels (SmallBatchExperts), where they run
        self._resident: Any = None  # the experts' tensors those kernels read (ExpertWeights)
        self._small_tokens = (
            0  # calls of up to this many tokens take them (0: none; set with _small)
        )

    @classmethod
    def unsupported_reason(cls, run_format: WeightFormat, device: torch.device) -> str | None:
        """Why DeepGEMM cannot run ``run_format`` on ``device``, None when it can."""
        try:
            resolve_kernel(run_format, device)
        except (CapabilityError, ImportError) as exc:
            return str(exc)
        return None

    @classmethod
    def fuses_shared_experts(cls, run_format: WeightFormat, device: torch.device) -> bool:
        """Whether the installed DeepGEMM's kernel for ``run_format`` here fuses shared experts."""
        try:
            module, kind = resolve_kernel(run_format, device)
        except (CapabilityError, ImportError):
            return False
        return fuses_shared(module, kind)

    def rounds_activations(self, experts: MegaMoEExperts) -> bool:
        """In every quantized format: the kernels take FP8 activations (not the BF16 one)."""
        return experts.weight_format is not WeightFormat.BF16

    @property
    def kernel_weights(self) -> dict[str, torch.Tensor]:
        """The tensors the kernel reads, by name (empty before the first ``prepare``)."""
        named = {} if self._layout is None else self._layout.named("deepgemm")
        if self._shared_layout is not None:
            named |= self._shared_layout.named("deepgemm shared")
        return named

    @property
    def symm_buffer(self) -> SymmBufferEntry | None:
        """The symmetric buffer this layer uses (None before the first ``prepare``)."""
        return self._entry

    def check_layer(self, experts: MegaMoEExperts) -> None:
        """Refuse what DeepGEMM cannot run, before the experts allocate their weights.

        Raises:
            CapabilityError: no kernel for the format here, a missing DeepGEMM function,
                a kernel that cannot clamp SwiGLU for experts with a ``swiglu_limit``, or
                fused shared experts where the kernel takes none.
            KernelSizeError: a hidden or intermediate size the Hopper kernel does not run
                (``SM90_HIDDEN_MULTIPLE``, ``SM90_INTERMEDIATE_MULTIPLE``,
                ``SM90_MAX_INTERMEDIATE``); a CapabilityError and a ValueError.
            ImportError: ``deep_gemm`` does not import.
            ValueError: ``process_group=None`` while several ranks run.
        """
        module, kind = resolve_kernel(experts.weight_format, experts.device)
        label = experts.layout.label
        kernel_fn = KERNEL_FUNCTIONS[kind]
        if experts.swiglu_limit is not None and not takes(
            getattr(module, kernel_fn), CLAMP_KEYWORD
        ):
            raise CapabilityError(
                f"{label}: the experts clamp SwiGLU at swiglu_limit={experts.swiglu_limit:g}, "
                f"but the installed deep_gemm.{kernel_fn} takes no {CLAMP_KEYWORD}; running "
                f"without the clamp would be wrong: pip install {PIP_PACKAGE} (a build whose "
                "MegaMoE kernels take activation_clamp) or use backend='reference'"
            )
        if experts.num_shared_experts and not fuses_shared(module, kind):
            raise CapabilityError(
                f"{label}: num_shared_experts={experts.num_shared_experts}, but the installed "
                f"deep_gemm.{kernel_fn} takes no {SHARED_KEYWORDS[0]} (the {kind} kernel "
                "fuses shared experts from sgl-deep-gemm 0.2.5 on SM100); build the layer with "
                "num_shared_experts=0 and run the shared expert as a separate MLP "
                "(megamoe.core.modules.shared_expert.SwiGLUMLP), or use backend='reference'"
            )
        if kind == KIND_SM90:
            check_sm90_sizes(label, experts.hidden_size, experts.intermediate_size)
        check_group(experts.process_group)

    def small_batch_unavailable(self, experts: MegaMoEExperts) -> str | None:
        """Why the small-batch kernels cannot run this layer (``backends.small_batch``)."""
        try:
            _, kind = resolve_kernel(experts.weight_format, experts.device)
        except (CapabilityError, ImportError) as exc:
            return str(exc)
        return small_batch.unavailable_reason(experts, kind)

    def path_for(self, experts: MegaMoEExperts, tokens: int) -> str:
        """``"small_batch"`` for the calls the small-batch kernels take, else ``"megamoe"``."""
        if self._kernel is None:  # before prepare: the rule the first prepare applies
            _, kind = resolve_kernel(experts.weight_format, experts.device)
            limit = small_batch.small_batch_tokens(experts, kind)
        else:
            limit = self._small_tokens
        if small_batch.takes_small_batch(tokens, limit):
            return small_batch.PATH_SMALL_BATCH
        return small_batch.PATH_MEGAMOE

    def l1_row_order(self, experts: MegaMoEExperts) -> L1RowOrder:
        """Gate and up rows interleaved in groups of 8: what every MegaMoE kernel reads."""
        del experts
        return L1_ROW_ORDER

    def prepare(self, experts: MegaMoEExperts, local_ids: Sequence[int]) -> None:
        """Build or refresh the kernel layout of the given experts, in place.

        The first call allocates the symmetric buffer (or takes the cached one) and the
        kernel tensors, then transforms every expert; later calls rewrite only the given
        experts into the same tensors.

        Raises:
            CapabilityError / ImportError / ValueError: as ``check_layer``.
            ValueError: the first call does not cover every local expert.
            RuntimeError: the buffer would be allocated during CUDA-graph capture.
        """
        self.check_layer(experts)
        module, kind = resolve_kernel(experts.weight_format, experts.device)
        routed_count, shared_count = experts.num_local_experts, experts.num_shared_experts
        slots = sorted(set(local_ids))
        if self._layout is None and slots != list(range(routed_count + shared_count)):
            raise ValueError(
                f"{experts.layout.label}: the first prepare() must cover all "
                f"{routed_count} local experts and {shared_count} shared ones, got {len(slots)}"
            )
        with _on_device(experts.device):
            self._entry = self._buffer(module, kind, experts)
            routed = [s for s in slots if s < routed_count]
            shared = [s for s in slots if s >= routed_count]
            self._layout = _write_slots(module, kind, experts, routed, self._layout, 0)
            self._shared_layout = _write_slots(
                module, kind, experts, shared, self._shared_layout, routed_count
            )
        self._kernel = (module, kind)
        if self._shared_layout is not None:  # its tensors are allocated once, then rewritten
            self._shared_args = _shared_weights(kind, self._shared_layout)
        self._tagged = self.kernel_weights
        self._buffer_check = (
            experts.kernel_tag.buffer_tag,
            {"symmetric buffer": self._entry.buffer},
        )
        limit = experts.swiglu_limit
        self._clamp = {} if limit is None else {CLAMP_KEYWORD: limit}
        one_rank = self._entry.key.group.size() == 1  # type: ignore[attr-defined]
        self._bound_tokens = (
            kind == KIND_SM90 and one_rank and takes(module.fp8_mega_moe, BOUND_KEYWORD)
        )
        self._dispatch = _sm90_dispatch(self._entry.buffer, experts) if kind == KIND_SM90 else None
        if self._small is None:  # it reads the experts' tensors: a reload needs nothing here
            self._small_tokens = small_batch.small_batch_tokens(experts, kind)
            if self._small_tokens:
                self._small = small_batch.shared_kernels(experts, self._small_tokens)
                # reloads rewrite them in place: the TMA descriptors stay right
                self._resident = self._small.weights(*_resident(experts))

    def _buffer(self, module: ModuleType, kind: str, experts: MegaMoEExperts) -> SymmBufferEntry:
        """The cached symmetric buffer for this layer's shape and kind."""
        group = resolve_group(experts.process_group, experts.device)
        h, i = experts.hidden_size, experts.intermediate_size
        sizes = (experts.num_experts, experts.max_num_tokens, experts.top_k, h, i)
        key = BufferKey(group, experts.device, *sizes, kind, experts.num_shared_experts)
        args = (group, *sizes)

        def allocate() -> Any:
            if kind == KIND_SM90:
                return module.get_symm_buffer_for_mega_moe(*args)
            kwargs: dict[str, Any] = {"mma_type": kind}
            if takes(module.get_symm_buffer_for_mega_moe, FP8XFP8_MARKER):
                kwargs[FP8XFP8_MARKER] = experts.num_shared_experts  # 0 unless fused
            try:
                return module.get_symm_buffer_for_mega_moe(*args, **kwargs)
            except (AssertionError, ValueError, NotImplementedError) as exc:
                raise CapabilityError(
                    f"the installed deep_gemm refused a {kind} MegaMoE buffer ({exc}); "
                    f"pip install {PIP_PACKAGE} (a build with the {kind} kernel) or choose "
                    "another run format"
                ) from exc

        return get_symm_buffer(key, experts.kernel_tag.buffer_tag, allocate)

    def dispatch_buffer(self, experts: MegaMoEExperts) -> DispatchBuffer | None:
        """The Hopper kernel's input rows, where the buffer holds them as a router can write.

        None before ``prepare``, for the SM100 kernels (their pre-dispatch casts to MXFP8)
        and for a DeepGEMM build whose Hopper buffer differs from ``DispatchBuffer``'s
        dtypes and shapes (its pre-dispatch is then the only writer).
        """
        del experts
        return self._dispatch

    def _checked(self, experts: MegaMoEExperts, tokens: int) -> tuple[Any, KernelLayout]:
        """The kernel and layout of a forward of ``tokens`` tokens, after its checks.

        Raises:
            RuntimeError: ``prepare`` has not run.
            ValueError: more tokens than the symmetric buffer holds.
            FormatMismatchError: the buffer or kernel tensors carry another format's tag.
        """
        label = experts.layout.label
        layout, entry, kernel = self._layout, self._entry, self._kernel
        buffer_check = self._buffer_check
        if layout is None or entry is None or kernel is None or buffer_check is None:
            raise RuntimeError(
                f"{label}: the DeepGEMM backend has no kernel weights; call finalize() first"
            )
        if tokens > entry.capacity:
            raise ValueError(
                f"{label}: {tokens} tokens exceed the DeepGEMM symmetric buffer's capacity of "
                f"{entry.capacity} tokens per rank; raise max_num_tokens (now "
                f"{experts.max_num_tokens}) when building the layer, or split the batch"
            )
        check_tags(*buffer_check, label)
        check_tags(experts.kernel_tag, self._tagged, label)
        return kernel, layout

    def forward(
        self,
        experts: MegaMoEExperts,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        """This rank's routed expert output through the MegaMoE kernel, (T, H) bfloat16.

        Raises:
            RuntimeError: ``prepare`` has not run.
            ValueError: more tokens than the symmetric buffer holds.
            FormatMismatchError: the buffer or kernel tensors carry another format's tag.
        """
        kernel, layout = self._checked(experts, hidden_states.shape[0])
        if small_batch.takes_small_batch(hidden_states.shape[0], self._small_tokens):
            return _launch_on(
                experts.device, self._small.forward, self._resident, hidden_states.contiguous(),
                None, _contiguous_as(topk_weights, torch.float32), topk_ids.contiguous(),
            )  # fmt: skip
        buf = self._entry.buffer  # type: ignore[union-attr]  # _checked: prepared
        return _launch_on(
            experts.device, self._launch, kernel, layout, buf, experts.hidden_size,
            hidden_states, topk_weights, topk_ids,
        )  # fmt: skip

    def forward_dispatched(self, experts: MegaMoEExperts, tokens: int) -> torch.Tensor:
        """The Hopper kernel on the ``tokens`` tokens a router wrote into the buffer.

        Raises:
            NotImplementedError: the layer has no dispatch buffer (``dispatch_buffer``).
            RuntimeError / ValueError / FormatMismatchError: as ``forward``.
        """
        if self._dispatch is None:
            return super().forward_dispatched(experts, tokens)
        (module, _), layout = self._checked(experts, tokens)
        if small_batch.takes_small_batch(tokens, self._small_tokens):
            rows = self._dispatch
            return _launch_on(
                experts.device, self._small.forward, self._resident, rows.x[:tokens],
                rows.x_scale[:tokens], rows.topk_weights[:tokens], rows.topk_ids[:tokens],
            )  # fmt: skip
        return _launch_on(experts.device, self._launch_dispatched, module, layout, experts, tokens)

    def _launch_dispatched(
        self, module: ModuleType, layout: KernelLayout, experts: MegaMoEExperts, tokens: int
    ) -> torch.Tensor:
        """:meth:`forward_dispatched` after its checks, on the experts' device."""
        l1w, l1s, l2w, l2s = layout.pieces
        y = torch.empty((tokens, experts.hidden_size), dtype=torch.bfloat16, device=experts.device)
        bound = {BOUND_KEYWORD: tokens} if self._bound_tokens else {}
        buf = self._entry.buffer  # type: ignore[union-attr]  # _checked: prepared
        module.fp8_mega_moe(y, (l1w, l1s), (l2w, l2s), buf, **self._clamp, **bound)
        return y

    def _launch(
        self,
        kernel: tuple[ModuleType, str],
        layout: KernelLayout,
        buf: Any,
        hidden_size: int,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        """:meth:`forward` after its checks, on the experts' device."""
        module, kind = kernel
        l1w, l1s, l2w, l2s = layout.pieces
        tokens = hidden_states.shape[0]
        clamp, shared = self._clamp, self._shared_args
        x = hidden_states.contiguous()
        weights = _contiguous_as(topk_weights, torch.float32)
        y = torch.empty((tokens, hidden_size), dtype=torch.bfloat16, device=x.device)
        if kind == KIND_SM90:
            ids = _contiguous_as(topk_ids, torch.int32)
            module.mega_moe_pre_dispatch_sm90(
                x, ids, weights, buf.x, buf.x_sf, buf.topk_idx, buf.topk_weights, tokens
            )
            bound = {BOUND_KEYWORD: tokens} if self._bound_tokens else {}
            module.fp8_mega_moe(y, (l1w, l1s), (l2w, l2s), buf, **clamp, **bound)
            return y
        if kind == KIND_BF16:
            buf.x[:tokens].copy_(x)
        else:
            values, scale_ue8m0 = quant.quantize_mx(x, WeightFormat.MXFP8, name="hidden_states")
            buf.x[:tokens].copy_(values)
            buf.x_sf[:tokens].copy_(scale_ue8m0.view(torch.int32))  # 4 scales per int32
        buf.topk_idx[:tokens].copy_(topk_ids)
        buf.topk_weights[:tokens].copy_(weights)
        if kind == KIND_BF16:
            module.bf16_mega_moe(y, l1w, l2w, buf, **clamp, **shared)
        else:
            module.fp8_fp4_mega_moe(y, (l1w, l1s), (l2w, l2s), buf, **clamp, **shared)
        return y


def _resident(
    experts: MegaMoEExperts,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The experts' own block-FP8 tensors, as the small-batch kernels read them."""
    params = experts.kernel_params
    return (
        params["w13_weight"].data, params["w13_weight_scale"].data,
        params["w2_weight"].data, params["w2_weight_scale"].data,
    )  # fmt: skip


def _write_slots(
    module: ModuleType,
    kind: str,
    experts: MegaMoEExperts,
    slots: Sequence[int],
    layout: KernelLayout | None,
    first_slot: int,
) -> KernelLayout | None:
    """Transform the experts at kernel ``slots`` into ``layout`` (allocated on first use).

    ``first_slot`` is the kernel slot of the layout's expert 0 (the routed experts' layout
    starts at 0, the fused shared experts' at ``num_local_experts``).
    """
    count = experts.num_shared_experts if first_slot else experts.num_local_experts
    for slot in slots:
        pieces, canonical = transform_expert(module, kind, experts, slot)
        if layout is None:
            layout = KernelLayout.allocate(pieces, canonical, count, experts.kernel_tag)
        layout.write(slot - first_slot, pieces, canonical)
    return layout


def _shared_weights(kind: str, layout: KernelLayout) -> dict[str, Any]:
    """The fused shared experts' kernel arguments (``SHARED_KEYWORDS``) from their layout."""
    l1w, l1s, l2w, l2s = layout.pieces
    if kind == KIND_BF16:
        return dict(zip(SHARED_KEYWORDS, (l1w, l2w), strict=True))
    return dict(zip(SHARED_KEYWORDS, ((l1w, l1s), (l2w, l2s)), strict=True))
