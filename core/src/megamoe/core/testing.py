"""Synthetic checkpoints in true Hugging Face layout, for the demo, tests and users.

Expert weights are synthesized directly in their stored encoding (elements plus scales),
with magnitudes that differ per expert, per projection (gate / up / down) and per 128x128
block, so that a mixed-up row, block, scale or expert shows in any comparison.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from megamoe.core import adapters as adapter_registry
from megamoe.core.adapters import ModelAdapter, SyntheticSizes
from megamoe.core.checkpoint.expert_names import (
    CT_GLOBAL_SCALE,
    GLOBAL_SCALE,
    INPUT_SCALES,
    WEIGHT_PACKED,
)
from megamoe.core.checkpoint.nvfp4 import quantize_nvfp4
from megamoe.core.checkpoint.reader import CONFIG_FILE, INDEX_FILE, SINGLE_FILE
from megamoe.core.modules.experts import MegaMoEExperts
from megamoe.core.numerics.formats import WeightFormat
from megamoe.core.numerics.mx_codes import E2M1_MAX

DEFAULT_MAX_SHARD_BYTES = 2 * 1024 * 1024  # 2 MiB: a default synthetic checkpoint has shards
BLOCK = 128  # rows and columns of one magnitude block
E4M3_MAX = 448.0  # largest finite float8_e4m3fn
UE8M0_BIAS = 127  # UE8M0 exponent e encodes 2^(e - 127)
WEIGHT_STD = 0.03  # typical dequantized weight magnitude
# Per projection multipliers so gate, up and down differ even for one expert.
_SHARD_GAIN = {"gate_proj": 1.0, "up_proj": 1.7, "down_proj": 0.6}
_PROJ_SHAPES = ("gate_proj", "up_proj", "down_proj")


def _seed_of(seed: int, *parts: object) -> int:
    """A stable 63-bit seed for one tensor, independent of generation order."""
    return zlib.crc32(repr((seed, *parts)).encode()) * 2654435761 % (2**63 - 1)


def _generator(seed: int, *parts: object) -> torch.Generator:
    """A CPU generator seeded for one tensor."""
    return torch.Generator().manual_seed(_seed_of(seed, *parts))


def synthetic_dense(shape: tuple[int, ...], std: float, seed: int) -> torch.Tensor:
    """A bf16 tensor whose magnitude varies per 128x128 block of its last two dimensions.

    Args:
        shape: tensor shape (1-D tensors get one magnitude per 128 elements).
        std: typical magnitude; blocks range over about ``std/4 .. 4*std``.
        seed: reproducible contents.

    Returns:
        bfloat16 tensor of ``shape``.
    """
    gen = _generator(seed, "dense", tuple(shape))
    values = torch.randn(shape, generator=gen, dtype=torch.float32)
    return (values * _block_gain(shape, std, gen)).to(torch.bfloat16)


def _block_gain(shape: tuple[int, ...], std: float, gen: torch.Generator) -> torch.Tensor:
    """Log-uniform magnitudes in [std/4, 4*std], one per 128x128 block, broadcast to shape."""
    if len(shape) == 0:
        return torch.tensor(std)
    rows, cols = (1, shape[-1]) if len(shape) == 1 else (shape[-2], shape[-1])
    lead = tuple(shape[:-2])
    blocks = (*lead, math.ceil(rows / BLOCK), math.ceil(cols / BLOCK))
    gain = std * torch.exp2(torch.rand(blocks, generator=gen) * 4.0 - 2.0)
    full = gain.repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)
    full = full[..., :rows, :cols]
    return full.reshape(shape)


def synthetic_expert_tensors(
    fmt: WeightFormat | str,
    num_experts: int,
    hidden_size: int,
    intermediate_size: int,
    *,
    seed: int,
    fused_bf16: bool = False,
    pow2_block_scales: bool | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Routed-expert tensors of one layer in checkpoint naming, relative to ``...experts``.

    Per expert: ``{e}.{gate,up,down}_proj.weight`` plus the format's scale
    (``weight_scale_inv`` float32 per 128x128 block for FP8_BLOCK, ``weight_scale`` uint8
    UE8M0 per 1x32 for MXFP8/MXFP4; MXFP4 weights pack two E2M1 codes per byte). NVFP4
    projections are laid out as ModelOpt writes them (``weight``, ``weight_scale`` E4M3 per
    1x16, ``weight_scale_2`` and ``input_scale``; ``nvfp4_as_compressed_tensors`` turns
    them into the compressed-tensors layout). With
    ``fused_bf16`` (BF16 only): ``gate_up_proj`` (E, 2I, H), gate rows first, and
    ``down_proj`` (E, H, I).

    Args:
        fmt: stored expert format.
        num_experts: E.
        hidden_size: H.
        intermediate_size: I.
        seed: reproducible contents; each tensor depends only on (seed, expert, name).
        fused_bf16: yield the fused BF16 layout.
        pow2_block_scales: FP8_BLOCK only: True makes every block scale a power of two
            (requantizes to MXFP8 exactly), False none, None (default) a mix: alternate
            blocks of each projection (a projection of one block picks at random).

    Yields:
        ``(name, tensor)``.

    Raises:
        ValueError: ``fused_bf16`` with a quantized format, or a size that is not a
            positive multiple of 128.
    """
    fmt = WeightFormat.parse(fmt)
    for dim, value in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
        if value <= 0 or value % BLOCK:
            raise ValueError(f"{dim}={value}: synthetic experts need a positive multiple of 128")
    if fused_bf16 and fmt is not WeightFormat.BF16:
        raise ValueError(f"fused_bf16=True needs fmt=bf16, got {fmt.value}; fused layouts are BF16")
    shapes = {
        "gate_proj": (intermediate_size, hidden_size),
        "up_proj": (intermediate_size, hidden_size),
        "down_proj": (hidden_size, intermediate_size),
    }
    if fused_bf16:
        yield from _fused_bf16(num_experts, shapes, seed)
        return
    for expert in range(num_experts):
        for proj in _PROJ_SHAPES:
            rows, cols = shapes[proj]
            gain = _expert_gain(expert, proj)
            if fmt is WeightFormat.BF16:
                yield f"{expert}.{proj}.weight", _dense_bf16(rows, cols, gain, seed, expert, proj)
                continue
            gen = _generator(seed, fmt.value, expert, proj)
            if fmt is WeightFormat.NVFP4:
                parts = _encode_nvfp4(_dense_bf16(rows, cols, gain, seed, expert, proj))
            elif fmt is WeightFormat.FP8_BLOCK:
                parts = _encode_fp8_block(rows, cols, gain, gen, pow2_block_scales)
            else:
                parts = _encode_mx(fmt, rows, cols, gain, gen)
            for kind, tensor in parts:
                yield f"{expert}.{proj}.{kind}", tensor


def one_rank_experts(
    num_experts: int,
    hidden_size: int,
    intermediate_size: int,
    *,
    weight_format: WeightFormat | str,
    checkpoint_format: WeightFormat | str,
    top_k: int = 2,
    **options: Any,
) -> MegaMoEExperts:
    """An empty ``MegaMoEExperts`` whose one rank holds every expert (no redundant copies).

    Args:
        num_experts: routed experts (physical = logical = local).
        hidden_size: H.
        intermediate_size: I.
        weight_format: run format.
        checkpoint_format: stored format.
        top_k: experts per token.
        **options: any other constructor keyword (``backend``, ``device``, ``prefix``,
            ``num_shared_experts``, ``max_num_tokens``, ``emulate_kernel``).
    """
    return MegaMoEExperts(
        num_experts=num_experts,
        num_local_experts=num_experts,
        experts_start_idx=0,
        num_logical_experts=num_experts,
        top_k=top_k,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        weight_format=weight_format,
        checkpoint_format=checkpoint_format,
        **options,
    )


def synthetic_layer_tensors(
    adapter: ModelAdapter, config: Mapping[str, Any], prefix: str, seed: int = 0
) -> dict[str, torch.Tensor]:
    """One MoE layer's synthetic tensors, named relative to the block ``prefix``.

    The names a block's ``load_weights`` takes (``gate.weight``, ``experts.3.up_proj.weight``).
    """
    head = prefix + "."
    return {
        name[len(head) :]: tensor
        for name, tensor in adapter.synthetic_tensors(config, seed=seed)
        if name.startswith(head)
    }


def _expert_gain(expert: int, proj: str) -> float:
    """Magnitude multiplier of one projection of one expert."""
    return _SHARD_GAIN[proj] * (1.0 + 0.15 * expert)


def _fused_bf16(
    num_experts: int, shapes: Mapping[str, tuple[int, int]], seed: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """The fused BF16 layout, built from the same per-expert projections."""
    dense = {
        proj: torch.stack(
            [
                _dense_bf16(*shapes[proj], _expert_gain(e, proj), seed, e, proj)
                for e in range(num_experts)
            ]
        )
        for proj in _PROJ_SHAPES
    }
    yield "gate_up_proj", torch.cat([dense["gate_proj"], dense["up_proj"]], dim=1).contiguous()
    yield "down_proj", dense["down_proj"]


def _dense_bf16(
    rows: int, cols: int, gain: float, seed: int, expert: int, proj: str
) -> torch.Tensor:
    """One BF16 projection; the fused and per-expert layouts share these contents."""
    gen = _generator(seed, WeightFormat.BF16.value, expert, proj)
    values = torch.randn((rows, cols), generator=gen)
    return (values * _block_gain((rows, cols), WEIGHT_STD * gain, gen)).to(torch.bfloat16)


def _encode_fp8_block(
    rows: int, cols: int, gain: float, gen: torch.Generator, pow2: bool | None
) -> list[tuple[str, torch.Tensor]]:
    """E4M3 elements using most of their range, and one float32 scale per 128x128 block."""
    blocks = (math.ceil(rows / BLOCK), math.ceil(cols / BLOCK))
    # Elements span up to ~E4M3_MAX; the dequantized block magnitude is ~ scale * 150.
    elements = (torch.randn((rows, cols), generator=gen) * 150.0).clamp(-E4M3_MAX, E4M3_MAX)
    weight_fp8 = elements.to(torch.float8_e4m3fn)
    target = WEIGHT_STD * gain / 150.0
    scale = target * torch.exp2(torch.rand(blocks, generator=gen) * 4.0 - 2.0)
    scale_pow2 = torch.exp2(torch.ceil(torch.log2(scale)))
    # Not a power of two: a mantissa between 1.05 and 1.95 times the power below.
    scale_odd = scale_pow2 / 2 * (1.05 + 0.9 * torch.rand(blocks, generator=gen))
    if pow2 is None:
        checker = (torch.arange(blocks[0])[:, None] + torch.arange(blocks[1])[None, :]) % 2 == 0
        if checker.all():  # a single block: make the mix visible across projections instead
            checker = torch.rand(blocks, generator=gen) < 0.5
        scale_f32 = torch.where(checker, scale_pow2, scale_odd)
    else:
        scale_f32 = scale_pow2 if pow2 else scale_odd
    return [("weight", weight_fp8), ("weight_scale_inv", scale_f32.to(torch.float32))]


def _encode_mx(
    fmt: WeightFormat, rows: int, cols: int, gain: float, gen: torch.Generator
) -> list[tuple[str, torch.Tensor]]:
    """E4M3 or packed E2M1 elements and UE8M0 exponents per 1x32, varying per 128x128 block."""
    groups = cols // 32
    blocks = (math.ceil(rows / BLOCK), math.ceil(cols / BLOCK))
    # The block's exponent offset, an integer in [-2, 2], plus a per-block element amplitude.
    offset = torch.randint(-2, 3, blocks, generator=gen)
    amplitude = 0.35 + 0.65 * torch.rand(blocks, generator=gen)
    amp_full = amplitude.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]
    if fmt is WeightFormat.MXFP8:
        typical = 150.0  # elements use most of E4M3's range
        elements = (torch.randn((rows, cols), generator=gen) * typical * amp_full).clamp(
            -E4M3_MAX, E4M3_MAX
        )
        weight = elements.to(torch.float8_e4m3fn)
    else:
        typical = 3.0  # E2M1 magnitudes 0..6
        codes = torch.randint(0, 8, (rows, cols), generator=gen)
        # Small codes more often where the block amplitude is low.
        codes = torch.minimum(codes, (amp_full * 8).floor().long().clamp(1, 7))
        sign = torch.randint(0, 2, (rows, cols), generator=gen) * 8
        nibbles = (codes + torch.where(codes > 0, sign, 0)).to(torch.uint8)
        weight = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
    base = round(math.log2(WEIGHT_STD * gain / typical))
    exponent_block = UE8M0_BIAS + base + offset
    scale_ue8m0 = exponent_block.repeat_interleave(BLOCK // 32, dim=1)[:, :groups]
    scale_ue8m0 = scale_ue8m0.repeat_interleave(BLOCK, dim=0)[:rows]
    return [("weight", weight.contiguous()), ("weight_scale", scale_ue8m0.to(torch.uint8))]


def _encode_nvfp4(dense: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A projection quantized to NVFP4 in ModelOpt's layout (global scale amax / 2688).

    The input scale is what a calibration of unit-size activations gives (ModelOpt's
    ``input_scale`` = activation amax / 2688); megamoe ignores it.
    """
    global_scale = (dense.float().abs().amax() / (E2M1_MAX * E4M3_MAX)).reshape(())
    packed, scale_e4m3 = quantize_nvfp4(dense.float() / global_scale)
    input_scale = torch.tensor(4.0 / (E2M1_MAX * E4M3_MAX), dtype=torch.float32)
    return [
        ("weight", packed),
        ("weight_scale", scale_e4m3),
        (GLOBAL_SCALE, global_scale),
        (INPUT_SCALES[0], input_scale),
    ]


def nvfp4_as_compressed_tensors(
    config: Mapping[str, Any], tensors: Iterable[tuple[str, torch.Tensor]]
) -> tuple[dict[str, Any], Iterator[tuple[str, torch.Tensor]]]:
    """A ModelOpt NVFP4 checkpoint (config and tensors) in compressed-tensors' layout.

    ``quantization_config`` becomes compressed-tensors ``nvfp4-pack-quantized`` with the
    same ignore list; per NVFP4 projection ``weight`` becomes ``weight_packed``, the global
    scale ``weight_global_scale`` = float32(1 / ``weight_scale_2``) and ``input_scale``
    ``input_global_scale`` = float32(1 / ``input_scale``), both of shape (1,). The values
    a projection dequantizes to change by at most the one rounding of the reciprocal.

    Args:
        config: a ``config.json`` with a ModelOpt NVFP4 ``quantization_config`` at the top.
        tensors: its tensors.

    Returns:
        The new config and tensor stream.

    Raises:
        ValueError: the config is no ModelOpt NVFP4 config.
    """
    quant = dict(config.get("quantization_config") or {})
    if quant.get("quant_method") != "modelopt" or quant.get("quant_algo") != "NVFP4":
        raise ValueError(
            f"quantization_config {quant!r} is not ModelOpt NVFP4; pass a config from "
            "synthetic_config(WeightFormat.NVFP4, ...)"
        )
    scheme = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}
    converted = dict(config)
    converted["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "format": "nvfp4-pack-quantized",
                "weights": scheme,
                "input_activations": {**scheme, "dynamic": "local"},
            }
        },
        "ignore": list(quant.get("ignore") or []),
    }
    held = dict(tensors)
    stems = {n.removesuffix(f".{GLOBAL_SCALE}") for n in held if n.endswith(f".{GLOBAL_SCALE}")}

    def renamed() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in held.items():
            stem, _, kind = name.rpartition(".")
            if stem not in stems:
                yield name, tensor
            elif kind == "weight":
                yield f"{stem}.{WEIGHT_PACKED}", tensor
            elif kind in (GLOBAL_SCALE, INPUT_SCALES[0]):
                new_kind = CT_GLOBAL_SCALE if kind == GLOBAL_SCALE else INPUT_SCALES[1]
                yield f"{stem}.{new_kind}", torch.reciprocal(tensor).reshape(1)
            else:
                yield name, tensor

    return converted, renamed()


def write_checkpoint(
    path: str | Path,
    config: Mapping[str, Any],
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write a checkpoint directory in Hugging Face layout, streaming shard by shard.

    Tensors are buffered until a shard would exceed ``max_shard_bytes``, then written as
    ``model-0000k-of-0000n.safetensors``; ``model.safetensors.index.json`` maps every name
    to its shard. A checkpoint that fits in one shard is written as ``model.safetensors``
    without an index, as Hugging Face does.

    Args:
        path: directory to create (may exist and be empty).
        config: the ``config.json`` contents.
        tensors: ``(name, tensor)`` pairs, each name once.
        max_shard_bytes: shard size limit (a larger single tensor gets a shard of its own).

    Returns:
        ``path`` as a Path.

    Raises:
        ValueError: a name given twice, or a non-positive ``max_shard_bytes``.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    shard_names: list[str] = []
    weight_map: dict[str, int] = {}
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = total_bytes = 0

    def flush() -> None:
        nonlocal pending_bytes
        if not pending:
            return
        temp = f".shard-{len(shard_names)}.safetensors"
        save_file(pending, str(out / temp), metadata={"format": "pt"})
        shard_names.append(temp)
        pending.clear()
        pending_bytes = 0

    for name, tensor in tensors:
        if name in weight_map:
            raise ValueError(f"tensor {name!r} was given twice; checkpoint names are unique")
        size = tensor.numel() * tensor.element_size()
        if pending and pending_bytes + size > max_shard_bytes:
            flush()
        pending[name] = tensor.detach().cpu().contiguous()
        pending_bytes += size
        total_bytes += size
        weight_map[name] = len(shard_names)
    flush()
    _finish_layout(out, shard_names, weight_map, total_bytes)
    (out / CONFIG_FILE).write_text(json.dumps(dict(config), indent=2, sort_keys=True) + "\n")
    return out


def _finish_layout(
    out: Path, temp_names: list[str], weight_map: Mapping[str, int], total_bytes: int
) -> None:
    """Rename temporary shards to their HF names and write the index."""
    count = len(temp_names)
    if count <= 1:
        if temp_names:
            os.replace(out / temp_names[0], out / SINGLE_FILE)
        else:
            save_file({}, str(out / SINGLE_FILE), metadata={"format": "pt"})
        return
    final = [shard_file_name(k, count) for k in range(count)]
    for temp, name in zip(temp_names, final, strict=True):
        os.replace(out / temp, out / name)
    index = {
        "metadata": {"total_size": total_bytes},
        "weight_map": {name: final[k] for name, k in sorted(weight_map.items())},
    }
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def shard_file_name(index: int, count: int) -> str:
    """Hugging Face shard name: ``model-00001-of-00003.safetensors`` for index 0 of 3."""
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def write_synthetic_checkpoint(
    path: str | Path,
    adapter: str | ModelAdapter,
    fmt: WeightFormat | str,
    sizes: SyntheticSizes | None = None,
    seed: int = 0,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write a small but real checkpoint for an adapter, storing its experts as ``fmt``.

    Args:
        path: directory to create.
        adapter: an installed adapter's name, or the adapter itself.
        fmt: expert checkpoint format; the adapter must load it.
        sizes: layer count and dimensions (``SyntheticSizes()`` when None).
        seed: reproducible contents.
        max_shard_bytes: shard size limit.

    Returns:
        ``path`` as a Path.

    Raises:
        LookupError: no installed adapter has that name; the message lists them.
        ValueError: the adapter does not load ``fmt``.
    """
    if isinstance(adapter, str):
        adapters = adapter_registry.installed_adapters()
        if adapter not in adapters:
            raise LookupError(
                f"no installed megamoe adapter named {adapter!r}; installed: "
                f"{', '.join(adapters) or 'none'}"
            )
        adapter = adapters[adapter]
    fmt = WeightFormat.parse(fmt)
    if fmt not in adapter.checkpoint_formats:
        loads = ", ".join(f.value for f in adapter.checkpoint_formats)
        raise ValueError(
            f"{adapter.name} does not load {fmt.value} checkpoints (it loads: {loads}); "
            "pick one of those formats"
        )
    config = adapter.synthetic_config(fmt, sizes or SyntheticSizes())
    return write_checkpoint(
        path, config, adapter.synthetic_tensors(config, seed), max_shard_bytes=max_shard_bytes
    )
