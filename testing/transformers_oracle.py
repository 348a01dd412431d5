"""Tiny random transformers MoE models: the external oracle for our MoE blocks (tests only).

transformers is a test dependency: nothing under ``*/src`` may import this module. It builds
tiny bf16 models of each MoE family with transformers 5.24.0, gives every MoE block seeded
weights whose magnitudes differ per expert, per projection and per 128x128 block, writes
them the ways the releases lay them out (per-expert or fused, bf16 or block-FP8, with or
without MTP layers) and runs a float64 copy of transformers' own MoE module as reference.
"""

from __future__ import annotations

import copy
import json
import math
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

E4M3_MAX = 448.0  # largest finite float8_e4m3fn
BLOCK = 128  # FP8 scale block edge, and the granularity of the seeded weight gains
GAIN_RANGE = (0.5, 2.0)  # log-uniform gains per block, per expert and per projection
BIAS_STD = 0.1  # e_score_correction_bias: the size of a few selection-score gaps
INDEX_NAME = "model.safetensors.index.json"
# Text-config sizes the Hopper kernel runs (tests/test_gpu_deepgemm.py's): a tiny model of
# either family at these sizes goes through the GPU kernel (GPU tests).
KERNEL_SIZES: dict[str, dict[str, int]] = {
    "qwen4_exp": dict(
        hidden_size=2048,
        moe_intermediate_size=768,
        shared_expert_intermediate_size=768,
        num_experts=32,
        num_experts_per_tok=8,
    ),
    "glm5_next": dict(
        hidden_size=2048,
        moe_intermediate_size=768,
        n_routed_experts=32,
        num_experts_per_tok=8,
        n_group=4,
        topk_group=2,
    ),
}
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")

_ROUTED = dict(
    vocab_size=512,
    hidden_size=256,
    moe_intermediate_size=128,
    num_experts_per_tok=2,
    max_position_embeddings=128,
)
_QWEN_TEXT = _ROUTED | dict(
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=2,
    num_experts=8,
    shared_expert_intermediate_size=128,
)
# The default layer_types make layer 3 indexed attention, which needs a QSA indexer.
_QWEN4_TEXT = _QWEN_TEXT | dict(
    hc_count=2,
    hc_lowrank=16,
    indexer_n_heads=2,
    indexer_kv_heads=1,
    indexer_head_dim=64,
    indexer_budget=16,
    indexer_compress_ratio=4,
)
# n_group 2 / topk_group 1 make group limiting matter; top-k 2 <= 1 * 8 / 2.
_GROUPED = _ROUTED | dict(intermediate_size=256, n_routed_experts=8, n_group=2, topk_group=1)
_VISION = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=4)


@dataclass(frozen=True)
class Family:
    """How one model family is built and where its MoE blocks and MTP layers live.

    Attributes:
        config_cls: The transformers config class (the composite one for VL models).
        model_cls: The transformers model class whose ``save_pretrained`` writes the checkpoint.
        text_config: Tiny text-config keys.
        vision_config: Tiny vision-config keys; None for a flat (text-only) config.
        mtp_key: The config key that counts MTP layers (in ``text_config`` when composite).
        mtp_in_decoder: True where MTP layers continue the decoder stack at index
            ``num_hidden_layers + j`` (GLM, DeepSeek); False for Qwen's ``mtp.layers.{j}``.
    """

    config_cls: type
    model_cls: type
    text_config: dict[str, Any]
    vision_config: dict[str, Any] | None = None
    mtp_key: str = "num_nextn_predict_layers"
    mtp_in_decoder: bool = True

    @property
    def decoder_prefix(self) -> str:
        """Checkpoint prefix of the decoder layers."""
        return "model.language_model.layers" if self.vision_config else "model.layers"


FAMILIES: dict[str, Family] = {
    "qwen4_exp": Family(
        transformers.Qwen4ExpConfig,
        transformers.Qwen4ExpForConditionalGeneration,
        _QWEN4_TEXT,
        _VISION | dict(out_hidden_size=256, num_position_embeddings=16),
        mtp_key="mtp_num_hidden_layers",
        mtp_in_decoder=False,
    ),
    "qwen4_exp_text": Family(
        transformers.Qwen4ExpTextConfig,
        transformers.Qwen4ExpForCausalLM,
        _QWEN4_TEXT,
        mtp_key="mtp_num_hidden_layers",
        mtp_in_decoder=False,
    ),
    "glm5_next": Family(
        transformers.Glm5NextConfig,
        transformers.Glm5NextForConditionalGeneration,
        # mlp_layer_types interleaved on purpose: the sparse set comes from this list alone.
        _GROUPED
        | dict(
            num_hidden_layers=4,
            mlp_layer_types=["dense", "sparse", "dense", "sparse"],
            num_attention_heads=2,
            num_key_value_heads=2,
            q_lora_rank=64,
            kv_lora_rank=32,
            qk_nope_head_dim=32,
            v_head_dim=32,
            index_topk=16,
            index_head_dim=32,
            index_n_heads=2,
            linear_head_dim=32,
            linear_num_heads=2,
            hc_mult=2,
            pad_token_id=0,
        ),
        _VISION | dict(out_hidden_size=256, image_size=16, projection_intermediate_size=128),
    ),
    "qwen3_next": Family(
        transformers.Qwen3NextConfig,
        transformers.Qwen3NextForCausalLM,
        _QWEN_TEXT | dict(intermediate_size=256, decoder_sparse_step=2),  # MoE at 1 and 3
        mtp_in_decoder=False,
    ),
    "deepseek_v3": Family(
        transformers.DeepseekV3Config,
        transformers.DeepseekV3ForCausalLM,
        _GROUPED
        | dict(
            num_hidden_layers=3,
            first_k_dense_replace=1,
            num_attention_heads=2,
            q_lora_rank=64,
            kv_lora_rank=32,
            qk_rope_head_dim=16,
            qk_nope_head_dim=32,
            v_head_dim=32,
        ),
    ),
    "glm4_moe": Family(
        transformers.Glm4MoeConfig,
        transformers.Glm4MoeForCausalLM,
        _GROUPED
        | dict(
            num_hidden_layers=3,
            first_k_dense_replace=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=64,
        ),
    ),
}


@dataclass
class TinyModel:
    """A tiny transformers model and its MoE blocks by checkpoint prefix.

    Attributes:
        family: Key of ``FAMILIES``.
        model: The transformers model (bf16, eager experts, eval mode).
        config_dict: What ``save_pretrained`` writes to config.json, before
            ``save_checkpoint`` adds MTP counts or a quantization_config.
        moe_blocks: Checkpoint prefix (e.g. ``model.layers.1.mlp``) to the transformers
            MoE module; ``save_checkpoint(mtp_layers=n)`` adds the MTP blocks.
        seed: The seed the MoE weights were drawn from.
        exact_weights: Per prefix, parameter name within the block to its exact float64
            value where the module can only hold it rounded (dequantized FP8 weights);
            ``reference_moe`` uses these.
    """

    family: str
    model: torch.nn.Module
    config_dict: dict[str, Any]
    moe_blocks: dict[str, torch.nn.Module]
    seed: int = 0
    exact_weights: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)

    @property
    def text_config(self) -> Any:
        """The transformers text config (the config itself when flat)."""
        return self.model.config.get_text_config()


@dataclass
class OracleOutput:
    """What the float64 reference MoE computed for (T, H) hidden states.

    Attributes:
        output: (T, H) float64 block output.
        topk_ids: (T, k) chosen experts, sorted per row.
        margin: (T,) gap between the k-th chosen selection score and the best unchosen one
            (for grouped routers also the gap between the last kept and the best dropped
            group); near zero means a near-tie that rounding may flip.
    """

    output: torch.Tensor
    topk_ids: torch.Tensor
    margin: torch.Tensor


def build_tiny_model(
    family: str, *, seed: int = 0, swiglu_limit: float | None = None, **text_overrides: Any
) -> TinyModel:
    """Build a tiny bf16 model of ``family`` and give its MoE blocks seeded weights.

    Args:
        family: A key of ``FAMILIES``.
        seed: Seeds both transformers' own init and the MoE weights.
        swiglu_limit: glm5_next only: ``text_config.swiglu_limit`` (the class default is 10).
        **text_overrides: Text-config keys that replace the tiny defaults.

    Returns:
        The model with its MoE blocks by checkpoint prefix.

    Raises:
        ValueError: For an unknown family, or a swiglu_limit for a family without a clamp.
    """
    spec = _family(family)
    text = spec.text_config | text_overrides
    if swiglu_limit is not None:
        if family != "glm5_next":
            raise ValueError(f"swiglu_limit={swiglu_limit}: only glm5_next has a SwiGLU clamp")
        text["swiglu_limit"] = swiglu_limit
    if spec.vision_config is None:
        config = spec.config_cls(**text)
    else:
        config = spec.config_cls(text_config=text, vision_config=dict(spec.vision_config))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = spec.model_cls._from_config(
            config, dtype=torch.bfloat16, experts_implementation="eager"
        )
    model.eval()
    model.config.architectures = [spec.model_cls.__name__]  # as save_pretrained sets it
    blocks = {
        name: module
        for name, module in model.named_modules()
        if name.endswith(".mlp") and hasattr(module, "experts")
    }
    for prefix, block in blocks.items():
        _reinit_block(block, prefix, seed)
    config_dict = json.loads(model.config.to_json_string())
    return TinyModel(family, model, config_dict, blocks, seed)


def save_checkpoint(
    tiny: TinyModel,
    path: str | Path,
    *,
    fused: bool = False,
    fp8_block: bool = False,
    fp8_shared: bool = True,
    mtp_layers: int = 0,
    max_shard_size: str = "1MB",
) -> Path:
    """Write ``tiny`` with ``save_pretrained``, then add MTP layers and FP8 as releases do.

    Per-expert (default) names are ``{prefix}.experts.{e}.{gate,up,down}_proj.weight``;
    fused names are ``{prefix}.experts.gate_up_proj`` (E, 2I, H) and ``.down_proj`` (E, H, I).
    MTP blocks get fresh seeded weights and replace, in ``tiny.moe_blocks``, those of an
    earlier save. ``fp8_block`` changes
    ``tiny`` in place (its experts hold the dequantized weights), so use one TinyModel per
    FP8 checkpoint.

    Args:
        tiny: The model to write.
        path: Output folder.
        fused: Write the fused in-memory expert tensors (``save_original_format=False``).
        fp8_block: Store every routed- and shared-expert weight as float8_e4m3fn with a
            float32 ``weight_scale_inv`` per 128x128 block, plus a top-level
            quantization_config.
        fp8_shared: With ``fp8_block``, the shared expert in block-FP8 too (as releases
            store it); False keeps it in BF16 (transformers runs BF16 linears without its
            Hub-fetched FP8 kernel).
        mtp_layers: MTP layers to append, each with a routed MoE named like a main layer's.
        max_shard_size: Passed to ``save_pretrained``; small so there are several shards.

    Returns:
        The checkpoint folder.

    Raises:
        ValueError: For FP8 with fused experts, or FP8 twice on one TinyModel.
    """
    if fp8_block and fused:
        raise ValueError("fp8_block=True needs fused=False: FP8 releases store per-expert weights")
    if fp8_block and tiny.exact_weights:
        raise ValueError("this TinyModel already holds FP8-dequantized weights; build a new one")
    spec = FAMILIES[tiny.family]
    path = Path(path)
    main = dict(tiny.model.named_modules())
    for prefix in [p for p in tiny.moe_blocks if p not in main]:  # MTP blocks of an earlier save
        del tiny.moe_blocks[prefix]
    tiny.model.save_pretrained(path, save_original_format=not fused, max_shard_size=max_shard_size)
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config", config)
    # DeepSeek-V3 and GLM-4-MoE write num_nextn_predict_layers=1 by default; keep it true.
    if mtp_layers or spec.mtp_key in text:
        text[spec.mtp_key] = mtp_layers
    extra: dict[str, torch.Tensor] = {}
    for j in range(mtp_layers):
        extra |= _mtp_tensors(tiny, j, fused)
    if extra:
        _append_shard(path, extra)
    if fp8_block:
        config["quantization_config"] = _quantize_checkpoint(tiny, path, fp8_shared)
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return path


def declare_mtp_without_tensors(path: str | Path, n: int) -> None:
    """Set the MTP count in config.json without adding tensors (a re-saved release config).

    Args:
        path: A checkpoint folder written by ``save_checkpoint``.
        n: The number of MTP layers to declare.
    """
    config_file = Path(path) / "config.json"
    config = json.loads(config_file.read_text())
    spec = next(s for s in FAMILIES.values() if s.config_cls.model_type == config["model_type"])
    config.get("text_config", config)[spec.mtp_key] = n
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def reference_moe(
    tiny: TinyModel, prefix: str, hidden_states: torch.Tensor, *, clamp: bool = True
) -> OracleOutput:
    """Run a float64 copy of the transformers MoE block at ``prefix``.

    The routers keep their own internal casts (GLM/DeepSeek route in float32, Qwen's
    softmax is float32), as transformers does.

    Args:
        tiny: The model.
        prefix: A key of ``tiny.moe_blocks``.
        hidden_states: (T, H) block input, any float dtype.
        clamp: False removes GLM's SwiGLU clamp (glm5_next only), to show it matters.

    Returns:
        Output, sorted chosen ids and selection margins.
    """
    block = _float64_block(tiny, prefix, clamp)
    x = hidden_states.to(torch.float64).reshape(1, -1, hidden_states.shape[-1])
    with torch.no_grad():
        output = block(x).reshape(x.shape[1:])
        logits, _, topk_ids = block.gate(x)
    return OracleOutput(output, topk_ids.sort(dim=-1).values, _margin(block.gate, logits))


def clamped_fraction(
    tiny: TinyModel, prefix: str, hidden_states: torch.Tensor
) -> tuple[float, float]:
    """Share of gate values > L and of up values outside [-L, L] over chosen (token, expert).

    Args:
        tiny: A glm5_next model.
        prefix: A key of ``tiny.moe_blocks``.
        hidden_states: (T, H) block input.

    Returns:
        (gate share, up share) over the routed experts' T * k * I values each.

    Raises:
        ValueError: For a family without a SwiGLU clamp.
    """
    _require_clamp(tiny)
    block = _float64_block(tiny, prefix, clamp=True)
    x = hidden_states.to(torch.float64).reshape(-1, hidden_states.shape[-1])
    with torch.no_grad():
        topk_ids = block.gate(x)[2]
        gate_up = torch.einsum("th,eoh->teo", x, block.experts.gate_up_proj)
    chosen = gate_up[torch.arange(x.shape[0])[:, None], topk_ids]  # (T, k, 2I)
    gate, up = chosen.chunk(2, dim=-1)
    limit = block.experts.swiglu_limit
    return (gate > limit).double().mean().item(), (up.abs() > limit).double().mean().item()


def _family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown family {name!r}; expected one of {sorted(FAMILIES)}")
    return FAMILIES[name]


def _shared_name(block: torch.nn.Module) -> str:
    """Qwen calls its shared MLP ``shared_expert``; GLM and DeepSeek ``shared_experts``."""
    return "shared_expert" if hasattr(block, "shared_expert") else "shared_experts"


def _log_uniform(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    low, high = math.log(GAIN_RANGE[0]), math.log(GAIN_RANGE[1])
    return torch.exp(torch.empty(shape).uniform_(low, high, generator=gen))


def _gained_normal(shape: tuple[int, int], gain: float, gen: torch.Generator) -> torch.Tensor:
    """N(0, 1/fan_in) times ``gain`` times a log-uniform gain per 128x128 block."""
    rows, cols = shape
    blocks = _log_uniform((math.ceil(rows / BLOCK), math.ceil(cols / BLOCK)), gen)
    gains = blocks.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]
    return torch.randn(shape, generator=gen) * gains * (gain / math.sqrt(max(cols, 1)))


def _reinit_block(block: torch.nn.Module, prefix: str, seed: int) -> None:
    """Seeded weights for every tensor of one MoE block; the prefix keeps blocks distinct."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(prefix.encode()))
    experts, shared = block.experts, getattr(block, _shared_name(block))
    num_experts, hidden = experts.num_experts, experts.hidden_dim
    proj_gain = dict(zip(PROJECTIONS, _log_uniform((3,), gen).tolist(), strict=True))
    unit = 1 / math.sqrt(hidden)  # randn * unit: logits of order 1 for unit-size inputs
    values = {"gate.weight": torch.randn(num_experts, hidden, generator=gen) * unit}
    if hasattr(block.gate, "e_score_correction_bias"):
        values["gate.e_score_correction_bias"] = torch.randn(num_experts, generator=gen) * BIAS_STD
    if hasattr(block, "shared_expert_gate"):
        values["shared_expert_gate.weight"] = torch.randn(1, hidden, generator=gen) * unit
    gate_up, down = [], []
    for expert_gain in _log_uniform((num_experts,), gen).tolist():
        inter = experts.intermediate_dim
        gate_up.append(
            torch.cat(
                [
                    _gained_normal((inter, hidden), expert_gain * proj_gain["gate_proj"], gen),
                    _gained_normal((inter, hidden), expert_gain * proj_gain["up_proj"], gen),
                ]
            )
        )
        down.append(_gained_normal((hidden, inter), expert_gain * proj_gain["down_proj"], gen))
    values["experts.gate_up_proj"] = torch.stack(gate_up)
    values["experts.down_proj"] = torch.stack(down)
    shared_gain = _log_uniform((1,), gen).item()
    for proj in PROJECTIONS:
        weight = getattr(shared, proj).weight
        values[f"{_shared_name(block)}.{proj}.weight"] = _gained_normal(
            tuple(weight.shape), shared_gain * proj_gain[proj], gen
        )
    tensors = dict(block.named_parameters()) | dict(block.named_buffers())
    if set(tensors) != set(values):
        raise ValueError(f"{prefix}: tensors {sorted(tensors)} differ from the seeded set")
    with torch.no_grad():
        for name, value in values.items():
            tensors[name].copy_(value)


def _block_to_disk(block: torch.nn.Module, prefix: str, fused: bool) -> dict[str, torch.Tensor]:
    """A block's tensors under the names save_pretrained gives them (per-expert or fused)."""
    state = {f"{prefix}.{k}": v.detach().clone() for k, v in block.state_dict().items()}
    if fused:
        return state
    gate_up = state.pop(f"{prefix}.experts.gate_up_proj")
    down = state.pop(f"{prefix}.experts.down_proj")
    for e in range(gate_up.shape[0]):
        gate, up = gate_up[e].chunk(2)
        state[f"{prefix}.experts.{e}.gate_proj.weight"] = gate.clone()
        state[f"{prefix}.experts.{e}.up_proj.weight"] = up.clone()
        state[f"{prefix}.experts.{e}.down_proj.weight"] = down[e].clone()
    return state


def _mtp_tensors(tiny: TinyModel, j: int, fused: bool) -> dict[str, torch.Tensor]:
    """MTP layer ``j``: a new seeded MoE block (added to ``tiny.moe_blocks``) and stand-ins."""
    spec = FAMILIES[tiny.family]
    text = tiny.text_config
    hidden = text.hidden_size
    if spec.mtp_in_decoder:
        layer = f"{spec.decoder_prefix}.{text.num_hidden_layers + j}"
        stand_ins = {f"{layer}.{n}": (hidden,) for n in ("enorm", "hnorm", "shared_head.norm")}
        stand_ins[f"{layer}.eh_proj"] = (hidden, 2 * hidden)
    else:
        layer = f"mtp.layers.{j}"
        stand_ins = {f"mtp.{n}": (hidden,) for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden")}
        stand_ins |= {"mtp.norm": (hidden,), "mtp.fc": (hidden, 2 * hidden)}
    for name in ("input_layernorm", "post_attention_layernorm"):
        stand_ins[f"{layer}.{name}"] = (hidden,)
    stand_ins[f"{layer}.self_attn.o_proj"] = (hidden, hidden)

    template = next(iter(tiny.moe_blocks.values()))
    with torch.random.fork_rng(devices=[]):  # nn.Linear init draws from the global generator
        block = type(template)(template.experts.config)
    like = dict(template.named_parameters()) | dict(template.named_buffers())
    for name, tensor in list(block.named_parameters()) + list(block.named_buffers()):
        tensor.data = tensor.data.to(like[name].dtype)  # e.g. GLM keeps its router in float32
    prefix = f"{layer}.mlp"
    _reinit_block(block, prefix, tiny.seed)
    tiny.moe_blocks[prefix] = block.eval()
    out = _block_to_disk(block, prefix, fused)
    for name, shape in stand_ins.items():
        value = torch.ones(shape) if len(shape) == 1 else torch.full(shape, 0.01)
        out[f"{name}.weight"] = value.to(torch.bfloat16)
    return out


def _shard_files(path: Path) -> tuple[list[str], dict[str, Any]]:
    """Shard file names in order, and the index (built for a single-file save)."""
    index_file = path / INDEX_NAME
    if index_file.exists():
        index = json.loads(index_file.read_text())
    else:
        with safe_open(path / "model.safetensors", "pt") as f:
            keys = list(f.keys())
        index = {"metadata": {}, "weight_map": dict.fromkeys(keys, "model.safetensors")}
    return sorted(set(index["weight_map"].values())), index


def _write_index(path: Path, files: list[str], metadata: dict[str, Any]) -> None:
    """Rebuild the weight map and total_size from what the shards hold."""
    weight_map, total_size = {}, 0
    for name in files:
        for key, tensor in load_file(path / name).items():
            weight_map[key] = name
            total_size += tensor.numel() * tensor.element_size()
    metadata = metadata | {"total_size": total_size}
    index = {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
    (path / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def _append_shard(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Add ``tensors`` as a new last shard, renumbering the others ``-of-{n + 1}``."""
    files, index = _shard_files(path)
    count = len(files) + 1
    renamed = [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    for old, new in zip(files, renamed, strict=False):
        (path / old).rename(path / new)
    save_file(tensors, path / renamed[-1], metadata={"format": "pt"})
    metadata = dict(index["metadata"])
    if "total_parameters" in metadata:
        metadata["total_parameters"] += sum(t.numel() for t in tensors.values())
    _write_index(path, renamed, metadata)


def _bf16_to_fp8_block(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) weight to e4m3 with a float32 scale = amax / 448 per 128x128 block."""
    rows, cols = weight.shape
    row_blocks, col_blocks = math.ceil(rows / BLOCK), math.ceil(cols / BLOCK)
    padded = torch.zeros(row_blocks * BLOCK, col_blocks * BLOCK)
    padded[:rows, :cols] = weight.float()
    tiles = padded.view(row_blocks, BLOCK, col_blocks, BLOCK)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = amax.clamp(min=1e-12) / E4M3_MAX  # the floor only guards all-zero blocks
    scaled = (tiles / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
    weight_fp8 = scaled.view_as(padded)[:rows, :cols].to(torch.float8_e4m3fn)
    return weight_fp8.contiguous(), scale


def _fp8_block_to_f64(weight_fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Exact w * s per block (float64 holds every e4m3 x float32 product exactly)."""
    rows, cols = weight_fp8.shape
    full = scale.double().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    return weight_fp8.double() * full[:rows, :cols]


def _quantize_checkpoint(tiny: TinyModel, path: Path, shared: bool) -> dict[str, Any]:
    """Rewrite the expert weights on disk as block-FP8; put the dequantized values in tiny.

    Every routed expert's; the shared expert's too where ``shared``.
    """
    targets: dict[str, tuple[str, str, tuple[Any, ...]]] = {}  # disk name: prefix, param, index
    for prefix, block in tiny.moe_blocks.items():
        inter = block.experts.intermediate_dim
        for proj in PROJECTIONS if shared else ():
            targets[f"{prefix}.{_shared_name(block)}.{proj}.weight"] = (
                prefix,
                f"{_shared_name(block)}.{proj}.weight",
                (),
            )
        for e in range(block.experts.num_experts):
            base = f"{prefix}.experts.{e}"
            targets[f"{base}.gate_proj.weight"] = (
                prefix,
                "experts.gate_up_proj",
                (e, slice(inter)),
            )
            targets[f"{base}.up_proj.weight"] = (
                prefix,
                "experts.gate_up_proj",
                (e, slice(inter, None)),
            )
            targets[f"{base}.down_proj.weight"] = (prefix, "experts.down_proj", (e,))
    exact: dict[str, dict[str, torch.Tensor]] = {}
    kept: set[str] = set()
    files, index = _shard_files(path)
    for file_name in files:
        with safe_open(path / file_name, "pt") as f:
            metadata = f.metadata()
        tensors = load_file(path / file_name)
        for name in list(tensors):
            if name not in targets:
                if name.endswith(".weight") and tensors[name].dim() == 2:
                    kept.add(name.removesuffix(".weight"))
                continue
            prefix, param, where = targets.pop(name)
            weight_fp8, scale = _bf16_to_fp8_block(tensors[name])
            tensors[name], tensors[f"{name}_scale_inv"] = weight_fp8, scale
            block_exact = exact.setdefault(prefix, {})
            if param not in block_exact:
                block_exact[param] = tiny.moe_blocks[prefix].get_parameter(param).detach().double()
            block_exact[param][where] = _fp8_block_to_f64(weight_fp8, scale)
        save_file(tensors, path / file_name, metadata=metadata)
    if targets:
        raise ValueError(f"{path}: expert weights missing on disk: {sorted(targets)[:4]} ...")
    _write_index(path, files, index["metadata"])
    with torch.no_grad():
        for prefix, params in exact.items():
            for param, value in params.items():
                tiny.moe_blocks[prefix].get_parameter(param).copy_(value)  # rounds to bf16
    tiny.exact_weights = exact
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK],
        # Every 2-D weight left in high precision: routers, shared_expert_gate, lm_head,
        # embeddings, attention, dense MLPs, vision and MTP stand-ins.
        "modules_to_not_convert": sorted(kept),
    }


def _float64_block(tiny: TinyModel, prefix: str, clamp: bool) -> torch.nn.Module:
    if prefix not in tiny.moe_blocks:
        raise ValueError(f"no MoE block {prefix!r}; have {sorted(tiny.moe_blocks)}")
    block = copy.deepcopy(tiny.moe_blocks[prefix]).to(torch.float64)
    with torch.no_grad():
        for param, value in tiny.exact_weights.get(prefix, {}).items():
            block.get_parameter(param).copy_(value)
    if not clamp:
        _require_clamp(tiny)
        block.experts.swiglu_limit = block.shared_experts.swiglu_limit = math.inf
    return block


def _require_clamp(tiny: TinyModel) -> None:
    if tiny.family != "glm5_next":
        raise ValueError(f"{tiny.family} has no SwiGLU clamp; only glm5_next has one")


def _margin(router: torch.nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """Gap between the k-th chosen and the best unchosen selection score, per token."""
    k = router.top_k
    if not hasattr(router, "e_score_correction_bias"):  # Qwen: float32 softmax, plain top-k
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        top = probs.topk(k + 1, dim=-1).values
        return (top[:, k - 1] - top[:, k]).double()
    scores = logits.sigmoid() + router.e_score_correction_bias
    groups = scores.view(scores.shape[0], router.num_group, -1)
    group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)
    kept = group_scores.topk(router.topk_group, dim=-1).indices
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
    allowed = groups.masked_fill(~mask[..., None], -math.inf).flatten(1)
    top = allowed.topk(k + 1, dim=-1).values
    margin = (top[:, k - 1] - top[:, k]).double()
    if router.num_group > router.topk_group:
        ranked = group_scores.topk(router.topk_group + 1, dim=-1).values
        group_gap = ranked[:, -2] - ranked[:, -1]
        margin = torch.minimum(margin, group_gap.double())
    return margin
