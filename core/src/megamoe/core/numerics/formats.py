"""Expert weight formats and the choice of run format for a target (SPEC §3.1)."""

from __future__ import annotations

import enum
import warnings

import torch

ARCH_SM90 = "sm90"  # Hopper: the fp8_mega_moe kernel
ARCH_SM100 = "sm100"  # Blackwell: fp8_fp4_mega_moe / bf16_mega_moe
ARCH_REFERENCE = "reference"  # the torch reference backend, any device
ARCHES = (ARCH_SM90, ARCH_SM100, ARCH_REFERENCE)

BLOCK_FP8_DEFAULT = (128, 128)  # rows x columns of one float32 block scale
MX_BLOCK = (1, 32)  # one UE8M0 scale per 32 consecutive columns of a row
NVFP4_BLOCK = (1, 16)  # one E4M3 scale per 16 consecutive columns of a row


class WeightFormat(enum.Enum):
    """How expert weights are encoded.

    Members (value = name used in options, configs and the CLI):

    - ``BF16`` ``"bf16"``: bfloat16 elements, no scale.
    - ``FP8_BLOCK`` ``"fp8_block"``: E4M3 (``float8_e4m3fn``) elements, one float32 scale per
      128x128 block, stored as ``weight_scale_inv`` (value = amax / 448, multiply to
      dequantize). DeepSeek-V3 style block FP8.
    - ``MXFP8`` ``"mxfp8"``: E4M3 elements, one UE8M0 scale per 1x32 (uint8 exponent e,
      value 2^(e-127)), stored as ``weight_scale``. OCP Microscaling MXFP8.
    - ``MXFP4`` ``"mxfp4"``: E2M1 elements packed two per uint8 (low nibble = even column),
      one UE8M0 scale per 1x32, stored as ``weight_scale``. OCP Microscaling MXFP4.
    - ``NVFP4`` ``"nvfp4"``: E2M1 elements packed as MXFP4, one E4M3 (``float8_e4m3fn``)
      scale per 1x16 stored as ``weight_scale``, and one float32 global scale per tensor
      stored as ``weight_scale_2`` (value = E2M1 x E4M3 x global). NVIDIA's NVFP4 as
      ModelOpt writes it; compressed-tensors ``nvfp4-pack-quantized`` stores the reciprocal
      global scale as ``weight_global_scale`` (``megamoe.core.checkpoint.expert_names`` has the
      names, ``megamoe.core.checkpoint.nvfp4`` the rules). A checkpoint format only: megamoe
      requantizes it to a format its kernels run.
    """

    BF16 = "bf16"
    FP8_BLOCK = "fp8_block"
    MXFP8 = "mxfp8"
    MXFP4 = "mxfp4"
    NVFP4 = "nvfp4"

    @property
    def element_dtype(self) -> torch.dtype:
        """Dtype of the stored weight tensor."""
        return _ELEMENT_DTYPE[self]

    @property
    def values_per_byte(self) -> int:
        """Weight values per stored element (2 for packed E2M1, else 1)."""
        return 2 if self in (WeightFormat.MXFP4, WeightFormat.NVFP4) else 1

    @property
    def scale_block(self) -> tuple[int, int] | None:
        """Rows x columns covered by one scale, None for unscaled BF16."""
        return _SCALE_BLOCK[self]

    @property
    def scale_dtype(self) -> torch.dtype | None:
        """Dtype of the stored scale tensor (uint8 = UE8M0 exponent), None for BF16."""
        return _SCALE_DTYPE[self]

    @property
    def scale_name(self) -> str | None:
        """Checkpoint name of the scale tensor beside ``weight``, None for BF16."""
        return _SCALE_NAME[self]

    @property
    def is_mx(self) -> bool:
        """True for the microscaling formats (UE8M0 1x32 scales)."""
        return self in (WeightFormat.MXFP8, WeightFormat.MXFP4)

    @classmethod
    def parse(cls, value: str | WeightFormat) -> WeightFormat:
        """Accept a member or its value (case-insensitive).

        Raises:
            ValueError: the string names no format; the message lists the valid ones.
        """
        if isinstance(value, WeightFormat):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            valid = ", ".join(f.value for f in cls)
            raise ValueError(f"unknown weight format {value!r}; expected one of: {valid}") from None


_ELEMENT_DTYPE = {
    WeightFormat.BF16: torch.bfloat16,
    WeightFormat.FP8_BLOCK: torch.float8_e4m3fn,
    WeightFormat.MXFP8: torch.float8_e4m3fn,
    WeightFormat.MXFP4: torch.uint8,
    WeightFormat.NVFP4: torch.uint8,
}
_SCALE_BLOCK: dict[WeightFormat, tuple[int, int] | None] = {
    WeightFormat.BF16: None,
    WeightFormat.FP8_BLOCK: BLOCK_FP8_DEFAULT,
    WeightFormat.MXFP8: MX_BLOCK,
    WeightFormat.MXFP4: MX_BLOCK,
    WeightFormat.NVFP4: NVFP4_BLOCK,
}
_SCALE_DTYPE: dict[WeightFormat, torch.dtype | None] = {
    WeightFormat.BF16: None,
    WeightFormat.FP8_BLOCK: torch.float32,
    WeightFormat.MXFP8: torch.uint8,
    WeightFormat.MXFP4: torch.uint8,
    WeightFormat.NVFP4: torch.float8_e4m3fn,
}
_SCALE_NAME: dict[WeightFormat, str | None] = {
    WeightFormat.BF16: None,
    WeightFormat.FP8_BLOCK: "weight_scale_inv",
    WeightFormat.MXFP8: "weight_scale",
    WeightFormat.MXFP4: "weight_scale",
    WeightFormat.NVFP4: "weight_scale",
}

# Formats megamoe's experts can hold and its backends run: every format but NVFP4.
# sgl-deep-gemm 0.2.5 has an SM100 ``nvfp4_mega_moe`` kernel, but megamoe's DeepGEMM backend
# does not call it (nor does its reference backend run NVFP4): NVFP4 checkpoints are
# requantized to one of these while loading.
RUN_FORMATS = (WeightFormat.BF16, WeightFormat.FP8_BLOCK, WeightFormat.MXFP8, WeightFormat.MXFP4)
RUNNABLE_FORMATS: dict[str, frozenset[WeightFormat]] = {
    ARCH_SM90: frozenset({WeightFormat.FP8_BLOCK}),
    ARCH_SM100: frozenset({WeightFormat.BF16, WeightFormat.MXFP8, WeightFormat.MXFP4}),
    ARCH_REFERENCE: frozenset(RUN_FORMATS),
}
# Where the target cannot run the stored format: what it converts to by default. The
# reference backend converts like SM100, whose run it emulates.
_DEFAULT_CONVERSION = {
    ARCH_SM90: WeightFormat.FP8_BLOCK,
    ARCH_SM100: WeightFormat.MXFP8,
    ARCH_REFERENCE: WeightFormat.MXFP8,
}

_warned: set[tuple[WeightFormat, WeightFormat, str]] = set()


def detect_arch(device: torch.device | str | None = None) -> str:
    """Kernel family of ``device``: ``sm100`` (Blackwell), ``sm90`` (Hopper) or ``reference``.

    Args:
        device: a CUDA device; None or a non-CUDA device (or no CUDA at all) gives
            ``reference``.

    Returns:
        One of ``ARCHES``.
    """
    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return ARCH_REFERENCE
    major, _ = torch.cuda.get_device_capability(device)
    if major >= 10:
        return ARCH_SM100
    if major == 9:
        return ARCH_SM90
    return ARCH_REFERENCE


def runnable_formats(arch: str) -> frozenset[WeightFormat]:
    """Formats the given target runs.

    Raises:
        ValueError: ``arch`` is not one of ``ARCHES``.
    """
    if arch not in RUNNABLE_FORMATS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {', '.join(ARCHES)}")
    return RUNNABLE_FORMATS[arch]


def check_run_format(fmt: WeightFormat, what: str) -> WeightFormat:
    """Return ``fmt`` when megamoe's experts can hold and run it (one of ``RUN_FORMATS``).

    Raises:
        ValueError: ``fmt`` is a checkpoint format only (NVFP4); the message names the fix.
    """
    if fmt not in RUN_FORMATS:
        runs = ", ".join(f.value for f in RUN_FORMATS)
        raise ValueError(
            f"{what}: weight_format={fmt.value!r} is a checkpoint format megamoe does not run "
            f"(it runs: {runs}); pass checkpoint_format={fmt.value!r} and one of those as "
            "weight_format, and the experts are requantized while loading"
        )
    return fmt


def resolve_formats(
    checkpoint: WeightFormat | str,
    requested: WeightFormat | str | None = None,
    arch: str | None = None,
) -> tuple[WeightFormat, WeightFormat]:
    """Pick the run format for experts stored as ``checkpoint`` on target ``arch``.

    A requested (forced) run format wins. Otherwise the experts run as stored; where the
    target cannot run the stored format they are converted (block-FP8 on SM100 -> MXFP8;
    BF16 or MX on SM90 -> FP8_BLOCK; NVFP4 -> MXFP8 on SM100 and the reference backend,
    FP8_BLOCK on SM90) with a warning, given once per conversion, that names the
    ``moe_format`` option which chooses explicitly.

    Args:
        checkpoint: format the checkpoint stores the experts in.
        requested: the ``moe_format`` option, None to decide automatically.
        arch: ``sm90``, ``sm100`` or ``reference``; None detects the current CUDA device.

    Returns:
        ``(checkpoint_format, run_format)``.

    Raises:
        ValueError: the requested format cannot run on ``arch``.
    """
    ckpt = WeightFormat.parse(checkpoint)
    arch = detect_arch("cuda") if arch is None else arch
    runnable = runnable_formats(arch)
    if requested is not None:
        run = WeightFormat.parse(requested)
        if run not in runnable:
            can = ", ".join(sorted(f.value for f in runnable))
            raise ValueError(
                f"moe_format={run.value!r} cannot run on {arch} (it runs: {can}); choose one of "
                "those or leave moe_format unset to convert automatically"
            )
        return ckpt, run
    if ckpt in runnable:
        return ckpt, ckpt
    run = _DEFAULT_CONVERSION[arch]
    key = (ckpt, run, arch)
    if key not in _warned:
        _warned.add(key)
        warnings.warn(
            f"{arch} cannot run {ckpt.value} experts; requantizing them to {run.value} while "
            f"loading. Pass moe_format={run.value!r} to choose this explicitly (or another "
            f"format {arch} runs) and silence this warning.",
            UserWarning,
            stacklevel=2,
        )
    return ckpt, run


# ---------------------------------------------------------------- kernel sizes and dtypes
ALIGN = 128  # hidden and intermediate sizes must be multiples of this (kernel tiles)
UNQUANTIZED_DTYPES = "bf16/fp16/fp32"  # what loads_unquantized accepts, for messages


_UNQUANTIZED = (torch.bfloat16, torch.float16, torch.float32)


def loads_unquantized(dtype: torch.dtype) -> bool:
    """Whether a router, bias or gate stored as ``dtype`` loads (``UNQUANTIZED_DTYPES``)."""
    return dtype in _UNQUANTIZED


def check_kernel_dims(hidden_size: int, intermediate_size: int) -> None:
    """Raise unless the expert sizes suit the kernel tiles (positive multiples of 128).

    Raises:
        ValueError: names the size, its value and the rule.
    """
    for option, size in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
        if not kernel_aligned(size):
            raise ValueError(
                f"expert {option}={size} must be a positive multiple of {ALIGN} (MegaMoE "
                "kernel tiles)"
            )


def kernel_aligned(size: int) -> bool:
    """Whether ``size`` is a positive multiple of ``ALIGN``."""
    return size > 0 and size % ALIGN == 0
