"""Checkpoint -> Glm5NextMegaMoeBlock -> forward, against a float64 reference written here.

Tolerances (relative Frobenius error of the (tokens, H) output):
- FP8_BLOCK run (weights as stored), reference backend: 1e-2 (bf16 output, bf16 shared MLP).
- MXFP8 run, against the float64 forward of the *original* block-FP8 weights: 6e-2 (the
  checkpoint mixes non-power-of-two block scales, whose UE8M0 rounding re-rounds E4M3
  elements: up to 2^-4 relative each); against the float64 forward of the requantized
  weights: 1e-2.
- Fused vs separate shared expert, power-of-two block scales (no rounding difference):
  1e-2.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from bitcheck import assert_bitwise_equal
from safetensors import safe_open

from megamoe.core.checkpoint.reader import CheckpointReader
from megamoe.core.modules.parallel import ParallelSettings
from megamoe.core.numerics import quant
from megamoe.core.numerics.formats import WeightFormat
from megamoe.core.testing import synthetic_dense, synthetic_expert_tensors
from megamoe.glm5next import ADAPTER, Glm5NextMegaMoeBlock

FP8, MX = WeightFormat.FP8_BLOCK, WeightFormat.MXFP8
PREFIX = "model.language_model.layers.1.mlp"
PROJS = ("gate_proj", "up_proj", "down_proj")
NOT_POW2 = "ignore:.*not powers of two:UserWarning"

pytestmark = pytest.mark.filterwarnings(NOT_POW2)

Checkpoint = Callable[[WeightFormat], Path]


# -- the float64 reference, independent of megamoe's loading and quant code ----------------


def _read_all(path: Path, prefix: str) -> dict[str, torch.Tensor]:
    """Every tensor under ``prefix.`` by its relative name, straight from safetensors."""
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    found: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(path / file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                if name.startswith(prefix + "."):
                    found[name[len(prefix) + 1 :]] = f.get_tensor(name)
    return found


def _f64(tensors: dict[str, torch.Tensor], proj: str) -> torch.Tensor:
    """E4M3 times its 128x128 float32 block scale, in float64 (bf16 weights as they are)."""
    weight = tensors[f"{proj}.weight"].double()
    scale = tensors.get(f"{proj}.weight_scale_inv")
    if scale is None:
        return weight
    full = scale.double().repeat_interleave(128, 0).repeat_interleave(128, 1)
    return weight * full[: weight.shape[0], : weight.shape[1]]


def _route64(
    cfg: dict[str, Any], scores: list[float], bias: list[float]
) -> list[tuple[int, float]]:
    """One token's (expert, weight) pairs by the SPEC's rule, plain Python, float64."""
    n_group, per = cfg["n_group"], cfg["n_routed_experts"] // cfg["n_group"]
    biased = [s + b for s, b in zip(scores, bias, strict=True)]
    group_score = [sum(sorted(biased[g * per : (g + 1) * per])[-2:]) for g in range(n_group)]
    groups = sorted(range(n_group), key=lambda g: (-group_score[g], g))[: cfg["topk_group"]]
    allowed = [e for g in groups for e in range(g * per, (g + 1) * per)]
    chosen = sorted(allowed, key=lambda e: (-biased[e], e))[: cfg["num_experts_per_tok"]]
    weights = [scores[e] for e in chosen]
    total = sum(weights) + 1e-20 if cfg["norm_topk_prob"] else 1.0
    return [
        (e, w / total * cfg["routed_scaling_factor"]) for e, w in zip(chosen, weights, strict=True)
    ]


def _mlp64(
    x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, limit: float
) -> torch.Tensor:
    """GLM's clamped SwiGLU MLP: gate <= limit, -limit <= up <= limit, before silu."""
    g, u = (x @ gate.T).clamp(max=limit), (x @ up.T).clamp(-limit, limit)
    return (F.silu(g) * u) @ down.T


def _reference64(
    cfg: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    x: torch.Tensor,
    dense: Callable[[dict[str, torch.Tensor], str], torch.Tensor] = _f64,
) -> tuple[torch.Tensor, list[list[int]]]:
    """Float64 layer output and each token's chosen experts."""
    x64 = x.double()
    limit = cfg.get("swiglu_limit", 10.0)
    scores = torch.sigmoid(x64 @ tensors["gate.weight"].double().T)
    bias = tensors["gate.e_score_correction_bias"].double().tolist()
    out = _mlp64(x64, *(dense(tensors, f"shared_experts.{p}") for p in PROJS), limit)
    experts = {
        e: [dense(tensors, f"experts.{e}.{p}") for p in PROJS]
        for e in range(cfg["n_routed_experts"])
    }
    chosen = []
    for t in range(x.shape[0]):
        route = _route64(cfg, scores[t].tolist(), bias)
        chosen.append([e for e, _ in route])
        for e, w in route:
            out[t] += w * _mlp64(x64[t : t + 1], *experts[e], limit)[0]
    return out, chosen


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected).norm() / expected.norm())


# -- fixtures -------------------------------------------------------------------------------


def _loaded(path: Path, parallel: ParallelSettings, **kwargs: Any) -> Glm5NextMegaMoeBlock:
    reader = CheckpointReader(path, ADAPTER)
    layer = next(m for m in reader.layers if m.prefix == PREFIX)
    block = Glm5NextMegaMoeBlock(
        reader.config, prefix=layer.prefix, parallel=parallel, backend="reference", **kwargs
    )
    block.load_from_checkpoint(reader)
    return block


# -- forward vs reference ---------------------------------------------------------------------


def test_fp8_block_run_matches_float64_reference(
    glm_checkpoint: Checkpoint, parallel: ParallelSettings, tokens: torch.Tensor
) -> None:
    path = glm_checkpoint(FP8)
    block = _loaded(path, parallel)  # reference target: block-FP8 runs as stored
    assert block.experts.weight_format is FP8 and not block.fused_shared
    cfg = json.loads((path / "config.json").read_text())["text_config"]
    want, chosen = _reference64(cfg, _read_all(path, PREFIX), tokens)
    _, ids = block.gate(tokens)
    assert ids.tolist() == chosen
    error = _rel(block(tokens), want)
    print(f"fp8_block run vs float64: {error:.3e}")
    assert error < 1e-2


def test_mxfp8_run_matches_float64_references(
    glm_checkpoint: Checkpoint, parallel: ParallelSettings, tokens: torch.Tensor
) -> None:
    path = glm_checkpoint(FP8)
    block = _loaded(path, parallel, moe_format="mxfp8")
    assert block.experts.weight_format is MX and block.fused_shared
    cfg = json.loads((path / "config.json").read_text())["text_config"]
    tensors = _read_all(path, PREFIX)
    out = block(tokens)
    original, _ = _reference64(cfg, tensors, tokens)
    error_original = _rel(out, original)
    assert error_original < 6e-2

    def requantized(t: dict[str, torch.Tensor], proj: str) -> torch.Tensor:
        values, scale = quant.requantize(
            t[f"{proj}.weight"], t[f"{proj}.weight_scale_inv"], FP8, MX
        )
        scale_f64 = torch.exp2(scale.double() - 127).repeat_interleave(32, dim=1)
        return values.double() * scale_f64

    rounded, _ = _reference64(cfg, tensors, tokens, dense=requantized)
    print(f"mxfp8 run vs float64 original {error_original:.3e}, rounded {_rel(out, rounded):.3e}")
    assert _rel(out, rounded) < 1e-2
    # The weights really were rounded: the output is closer to the rounded weights.
    assert _rel(out, rounded) < error_original


def test_mxfp8_kernel_weights_equal_quant_requantize(
    glm_checkpoint: Checkpoint, parallel: ParallelSettings
) -> None:
    path = glm_checkpoint(FP8)
    block = _loaded(path, parallel, moe_format="mxfp8")
    tensors = _read_all(path, PREFIX)
    params = block.experts.kernel_params
    for e in range(8):
        w13 = torch.cat([tensors[f"experts.{e}.{p}.weight"] for p in PROJS[:2]])
        s13 = torch.cat([tensors[f"experts.{e}.{p}.weight_scale_inv"] for p in PROJS[:2]])
        values, scale = quant.requantize(w13, s13, FP8, MX)
        assert_bitwise_equal(params["w13_weight"][e], values, f"expert {e} w13")
        assert_bitwise_equal(params["w13_weight_scale"][e], scale, f"expert {e} w13 scale")
    values, scale = quant.requantize(
        tensors["shared_experts.down_proj.weight"],
        tensors["shared_experts.down_proj.weight_scale_inv"],
        FP8,
        MX,
    )
    assert_bitwise_equal(params["shared_l2_weight"][0], values, "shared down")
    assert_bitwise_equal(params["shared_l2_weight_scale"][0], scale, "shared down scale")


def _pow2_layer(cfg: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """A layer's tensors (relative to the block) with power-of-two block scales only."""
    h, i, e = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["n_routed_experts"]
    tensors = [
        ("gate.weight", synthetic_dense((e, h), 0.05, seed=21)),
        ("gate.e_score_correction_bias", torch.linspace(-0.05, 0.05, e)),
    ]
    for name, t in synthetic_expert_tensors(FP8, 1, h, i, seed=22, pow2_block_scales=True):
        tensors.append((f"shared_experts.{name.removeprefix('0.')}", t))
    for name, t in synthetic_expert_tensors(FP8, e, h, i, seed=23, pow2_block_scales=True):
        tensors.append((f"experts.{name}", t))
    return tensors


def test_fused_and_separate_shared_expert_compute_the_same_function(
    glm_checkpoint: Checkpoint, parallel: ParallelSettings, tokens: torch.Tensor
) -> None:
    config = json.loads((glm_checkpoint(FP8) / "config.json").read_text())
    cfg = config["text_config"]
    tensors = _pow2_layer(cfg)
    outputs = {}
    for fuse in (True, False):
        block = Glm5NextMegaMoeBlock(
            config, prefix=PREFIX, parallel=parallel, moe_format="mxfp8", backend="reference",
            fuse_shared=fuse,
        )  # fmt: skip
        assert block.fused_shared is fuse
        assert (block.shared_experts is None) is fuse
        block.load_weights(tensors)
        block.finalize()
        outputs[fuse] = block(tokens)
    want, _ = _reference64(cfg, dict(tensors), tokens)
    print(
        f"fused {_rel(outputs[True], want):.3e}, separate {_rel(outputs[False], want):.3e}, "
        f"fused vs separate {_rel(outputs[True], outputs[False].double()):.3e}"
    )
    assert _rel(outputs[True], want) < 1e-2
    assert _rel(outputs[False], want) < 1e-2
    assert _rel(outputs[True], outputs[False].double()) < 1e-2


def test_mtp_layer_takes_the_default_format(
    glm_checkpoint: Checkpoint, parallel: ParallelSettings
) -> None:
    reader = CheckpointReader(glm_checkpoint(FP8), ADAPTER)
    mtp = next(m for m in reader.layers if m.is_mtp)
    block = ADAPTER.build_block(
        reader.config, mtp, parallel=parallel, moe_format="mxfp8", device="cpu"
    )
    assert block.experts.weight_format is FP8  # forced formats apply to the main model only
    main = ADAPTER.build_block(
        reader.config, reader.layers[0], parallel=parallel, moe_format="mxfp8"
    )
    assert main.experts.weight_format is MX


def test_the_block_passes_small_batch_max_tokens_to_its_experts(
    glm_checkpoint: Checkpoint, parallel: ParallelSettings
) -> None:
    reader = CheckpointReader(glm_checkpoint(FP8), ADAPTER)
    layer = reader.layers[0]
    block = ADAPTER.build_block(reader.config, layer, parallel=parallel, small_batch_max_tokens=8)
    assert block.experts.small_batch_max_tokens == 8
    with pytest.raises(
        ValueError,
        match=rf"^{re.escape(layer.prefix)}\.experts: small_batch_max_tokens=8 beside "
        "experts_path='megamoe'",
    ):
        ADAPTER.build_block(
            reader.config, layer, parallel=parallel, experts_path="megamoe",
            small_batch_max_tokens=8,
        )  # fmt: skip


# -- error paths ----------------------------------------------------------------------------


def _config(glm_checkpoint: Checkpoint) -> dict[str, Any]:
    return json.loads((glm_checkpoint(FP8) / "config.json").read_text())


def test_block_needs_an_expert_parallel_group(glm_checkpoint: Checkpoint) -> None:
    with pytest.raises(NotImplementedError, match=r"pass ParallelSettings\(ep_group=\.\.\.\)"):
        Glm5NextMegaMoeBlock(_config(glm_checkpoint), prefix=PREFIX, parallel=ParallelSettings())


def test_block_refuses_tensor_parallel(glm_checkpoint: Checkpoint, ep_group: Any) -> None:
    with pytest.raises(NotImplementedError, match=r"supports tp_size=1 only, got tp_size=2"):
        Glm5NextMegaMoeBlock(
            _config(glm_checkpoint), prefix=PREFIX, parallel=ParallelSettings(ep_group, tp_size=2)
        )


@pytest.mark.parametrize("chunk", [0, -2, 1.5, True])
def test_a_requant_chunk_below_one_expert_is_refused_when_built(
    glm_checkpoint: Checkpoint, parallel: ParallelSettings, chunk: object
) -> None:
    with pytest.raises(ValueError, match=rf"requant_chunk={chunk!r} must be an integer >= 1"):
        Glm5NextMegaMoeBlock(
            _config(glm_checkpoint), prefix=PREFIX, parallel=parallel, backend="reference",
            requant_chunk=chunk,  # type: ignore[arg-type]
        )  # fmt: skip


def test_fusing_where_the_kernel_cannot_is_refused(
    glm_checkpoint: Checkpoint, parallel: ParallelSettings
) -> None:
    with pytest.raises(NotImplementedError, match=r"fuse_shared=True, but the fp8_block kernel"):
        Glm5NextMegaMoeBlock(
            _config(glm_checkpoint), prefix=PREFIX, parallel=parallel, fuse_shared=True,
            backend="reference",
        )  # fmt: skip


def test_unexpected_tensor_name_is_named(
    glm_checkpoint: Checkpoint, parallel: ParallelSettings
) -> None:
    block = Glm5NextMegaMoeBlock(_config(glm_checkpoint), prefix=PREFIX, parallel=parallel)
    with pytest.raises(
        ValueError, match=r"unexpected tensor 'gate.bias'; a GLM-5.3-Flash MoE block"
    ):
        block.load_weights([("gate.bias", torch.zeros(8))])


def test_without_shared_experts_only_empty_shared_tensors_are_accepted(
    glm_checkpoint: Checkpoint, parallel: ParallelSettings
) -> None:
    cfg = _config(glm_checkpoint)
    text = cfg.get("text_config", cfg)
    text["n_shared_experts"] = 0
    block = Glm5NextMegaMoeBlock(cfg, prefix=PREFIX, parallel=parallel)
    assert block.shared_experts is None
    hidden = text["hidden_size"]
    empty = ("shared_experts.down_proj.weight", torch.zeros(hidden, 0, dtype=torch.bfloat16))
    assert block.load_weights([empty]) == {empty[0]}
    with pytest.raises(ValueError, match=r"shared_experts.up_proj.weight \(2, 256\) holds data"):
        block.load_weights([("shared_experts.up_proj.weight", torch.ones(2, hidden))])


def test_a_cast_of_the_model_leaves_the_block_as_it_is(
    glm_checkpoint: Checkpoint, parallel: ParallelSettings
) -> None:
    # Engines cast whole models; the float32 router, the bf16 shared expert and the FP8
    # experts keep their dtypes, and the block computes the same.
    block = _loaded(glm_checkpoint(FP8), parallel)
    x = torch.randn(5, block.config.hidden_size).to(torch.bfloat16)
    before = block(x)
    dtypes = {name: t.dtype for name, t in block.state_dict().items()}
    block.to(torch.bfloat16).half()
    assert {name: t.dtype for name, t in block.state_dict().items()} == dtypes
    assert block.gate.weight.dtype == torch.float32
    assert torch.equal(block(x), before)


def test_router_shape_and_values_are_checked(
    glm_checkpoint: Checkpoint, parallel: ParallelSettings
) -> None:
    block = Glm5NextMegaMoeBlock(_config(glm_checkpoint), prefix=PREFIX, parallel=parallel)
    with pytest.raises(ValueError, match=r"gate.weight has shape \(8, 128\), expected \(8, 256\)"):
        block.load_weights([("gate.weight", torch.zeros(8, 128))])
    bad = torch.zeros(8)
    bad[3] = float("inf")
    with pytest.raises(ValueError, match=r"e_score_correction_bias holds NaN or infinity"):
        block.load_weights([("gate.e_score_correction_bias", bad)])
    with pytest.raises(
        ValueError, match=r"never loaded: gate.weight, gate.e_score_correction_bias"
    ):
        block.finalize()


def test_forward_input_checks(glm_checkpoint: Checkpoint, parallel: ParallelSettings) -> None:
    block = _loaded(glm_checkpoint(FP8), parallel)
    with pytest.raises(TypeError, match=r"hidden_states has dtype torch.float32, expected"):
        block(torch.zeros(2, 256))
    with pytest.raises(ValueError, match=r"hidden_states has shape \(2, 128\), expected"):
        block(torch.zeros(2, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"\(1, 2, 256\), .* with \.reshape\(-1, 256\)"):
        block(torch.zeros(1, 2, 256, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"hidden_states is on meta, the block on cpu; move"):
        block(torch.zeros(2, 256, dtype=torch.bfloat16, device="meta"))


def test_shared_expert_stored_differently_runs_separately(
    glm_checkpoint: Checkpoint, parallel: ParallelSettings
) -> None:
    config = _config(glm_checkpoint)
    config["quantization_config"] = {
        **config["quantization_config"],
        "modules_to_not_convert": ["shared_experts"],
    }
    block = Glm5NextMegaMoeBlock(config, prefix=PREFIX, parallel=parallel, moe_format="mxfp8")
    assert not block.fused_shared
    assert block.shared_experts is not None
    assert block.shared_experts.checkpoint_format is WeightFormat.BF16
    with pytest.raises(
        NotImplementedError,
        match=r"shared expert is stored as bf16 but the routed experts as fp8_block",
    ):
        Glm5NextMegaMoeBlock(
            config, prefix=PREFIX, parallel=parallel, moe_format="mxfp8", fuse_shared=True
        )


def test_shared_expert_runs_separately_where_the_backend_cannot_fuse_it(
    glm_checkpoint: Checkpoint, parallel: ParallelSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """E.g. DeepGEMM 0.1.4.post1 on SM100, whose kernels take no shared experts."""
    import megamoe.glm5next.block as block_module

    asked = []

    def fuses(backend: str, run_format: WeightFormat, device: torch.device) -> bool:
        asked.append((backend, run_format, torch.device(device).type))
        return False

    monkeypatch.setattr(block_module, "fuses_shared_experts", fuses)
    config = _config(glm_checkpoint)
    block = Glm5NextMegaMoeBlock(config, prefix=PREFIX, parallel=parallel, moe_format="mxfp8")
    assert asked == [("auto", MX, "cpu")]
    assert not block.fused_shared and block.experts.num_shared_experts == 0
    assert block.shared_experts is not None
    with pytest.raises(NotImplementedError, match=r"the auto experts backend cannot fuse it"):
        Glm5NextMegaMoeBlock(
            config, prefix=PREFIX, parallel=parallel, moe_format="mxfp8", fuse_shared=True
        )
