"""Qwen4ExpMegaMoeBlock and the adapter: routing, parallel settings, loading errors,
layer discovery, converted configs and the entry point."""

from __future__ import annotations

import importlib.metadata as md
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megamoe.core.adapters import SyntheticSizes
from megamoe.core.checkpoint.reader import CheckpointReader
from megamoe.core.errors import CheckpointError, IncompleteShardsError
from megamoe.core.modules.parallel import ParallelSettings
from megamoe.core.numerics.formats import WeightFormat
from megamoe.core.testing import write_checkpoint
from megamoe.qwen4exp import ADAPTER, Qwen4ExpAdapter, Qwen4ExpMegaMoeBlock

SIZES = SyntheticSizes(
    num_layers=1, hidden_size=128, intermediate_size=128, num_experts=4, top_k=2,
    shared_intermediate_size=128,
)  # fmt: skip
H, E = SIZES.hidden_size, SIZES.num_experts
PREFIX = "model.language_model.layers.0.mlp"
CheckpointFactory = Callable[[WeightFormat, bool, SyntheticSizes], Path]


def config(fmt: WeightFormat = WeightFormat.BF16, **changes: Any) -> dict[str, Any]:
    """The synthetic composite config with ``changes`` to its text model's keys
    (``quantization_config`` stays at the top level, where transformers writes it)."""
    base = ADAPTER.synthetic_config(fmt, SIZES)
    quant = changes.pop("quantization_config", base.get("quantization_config"))
    text = {**base["text_config"], **changes}
    return {**base, "text_config": text, **({"quantization_config": quant} if quant else {})}


def block_of(parallel: ParallelSettings, **kwargs: Any) -> Qwen4ExpMegaMoeBlock:
    cfg = kwargs.pop("cfg", None) or config()
    return Qwen4ExpMegaMoeBlock(
        cfg, prefix=PREFIX, parallel=parallel, backend="reference", **kwargs
    )


def layer_tensors(fmt: WeightFormat = WeightFormat.BF16) -> dict[str, torch.Tensor]:
    head = PREFIX + "."
    return {
        name[len(head) :]: tensor
        for name, tensor in ADAPTER.synthetic_tensors(config(fmt), seed=1)
        if name.startswith(head)
    }


# -- routing ---------------------------------------------------------------------------------


@pytest.mark.parametrize("norm", [True, False])
def test_route_is_softmax_topk_renormalized_when_asked(
    parallel: ParallelSettings, norm: bool
) -> None:
    block = block_of(parallel, cfg=config(norm_topk_prob=norm))
    block.load_weights({"gate.weight": layer_tensors()["gate.weight"]}.items())
    x = torch.randn(64, H, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    weights, ids = block.route(x)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    probs = torch.softmax(x.double() @ block.gate.weight.double().T, dim=-1)
    for t in range(x.shape[0]):
        order = sorted(range(E), key=lambda e: -float(probs[t, e]))[: SIZES.top_k]
        assert ids[t].tolist() == order
        want = probs[t, order]
        want = want / want.sum() if norm else want
        torch.testing.assert_close(weights[t].double(), want, rtol=1e-5, atol=1e-7)


def test_serial_path_equals_aux_path_on_cpu(
    qwen_checkpoint: CheckpointFactory, parallel: ParallelSettings
) -> None:
    reader = CheckpointReader(qwen_checkpoint(WeightFormat.FP8_BLOCK, False, SIZES), ADAPTER)
    outputs = []
    for aux in (True, False):
        block = block_of(parallel, cfg=reader.config, use_aux_stream=aux)
        assert (block.aux_stream.stream is None) is True  # no CUDA stream on the CPU
        block.load_from_checkpoint(reader)
        x = torch.randn(8, H, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
        outputs.append(block(x))
    assert torch.equal(outputs[0], outputs[1])


def test_shared_output_is_gated_by_sigmoid(parallel: ParallelSettings) -> None:
    block = block_of(parallel)
    tensors = layer_tensors()
    block.load_weights((n, t) for n, t in tensors.items() if not n.startswith("experts."))
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    xd = x.double()
    mlp = tensors
    gate_up = F.silu(xd @ mlp["shared_expert.gate_proj.weight"].double().T) * (
        xd @ mlp["shared_expert.up_proj.weight"].double().T
    )
    want = (gate_up @ mlp["shared_expert.down_proj.weight"].double().T) * torch.sigmoid(
        xd @ mlp["shared_expert_gate.weight"].double().T
    )
    got = block.shared_output(x).double()
    assert float((got - want).norm() / want.norm()) < 1e-2  # bf16 MLP arithmetic


# -- parallel settings -----------------------------------------------------------------------


def test_parallel_settings_are_enforced(ep_group: dist.ProcessGroup) -> None:
    cases = [
        (ParallelSettings(ep_group=None), NotImplementedError, r"runs expert parallel: pass "
         r"ParallelSettings\(ep_group=\.\.\.\)"),
        (ParallelSettings(ep_group=ep_group, tp_size=2), NotImplementedError,
         r"tp_size=1 only, got tp_size=2"),
        (ParallelSettings(ep_group=ep_group, placement="round_robin"), NotImplementedError,
         r"placement='round_robin'; set placement='linear'"),
        (ParallelSettings(ep_group=ep_group, num_redundant_experts=-1), ValueError,
         r"num_redundant_experts must be >= 0"),
    ]  # fmt: skip
    for settings, error, message in cases:
        with pytest.raises(error, match=message):
            block_of(settings)


def test_redundant_experts_on_one_rank(
    qwen_checkpoint: CheckpointFactory, ep_group: dist.ProcessGroup
) -> None:
    reader = CheckpointReader(qwen_checkpoint(WeightFormat.MXFP8, False, SIZES), ADAPTER)
    settings = ParallelSettings(ep_group=ep_group, num_redundant_experts=2)
    block = block_of(settings, cfg=reader.config)
    assert (block.experts.num_experts, block.experts.num_local_experts) == (E + 2, E + 2)
    block.load_from_checkpoint(reader)
    w13 = block.experts.kernel_params["w13_weight"]
    assert torch.equal(w13[E].view(torch.uint8), w13[0].view(torch.uint8))  # replica of 0
    x = torch.randn(8, H, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    expected = ADAPTER.reference_forward(reader, reader.layers[0], x)
    assert float((block(x).double() - expected).norm() / expected.norm()) < 1e-2


# -- loading errors --------------------------------------------------------------------------


def test_unexpected_block_tensor_names_the_expected_ones(parallel: ParallelSettings) -> None:
    block = block_of(parallel)
    with pytest.raises(ValueError, match=r"unexpected tensor 'gate\.bias'; a Qwen4Exp MoE block "
                       r"loads gate\.weight, shared_expert_gate\.weight"):  # fmt: skip
        block.load_weights([("gate.bias", torch.zeros(E))])
    with pytest.raises(ValueError, match=r"unexpected bf16 expert tensor '0\.gate_proj\.qweight'"):
        block.load_weights([("experts.0.gate_proj.qweight", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"unexpected shared-expert tensor 'mid_proj\.weight'"):
        block.load_weights([("shared_expert.mid_proj.weight", torch.zeros(1))])


def test_dense_tensor_checks(parallel: ParallelSettings) -> None:
    block = block_of(parallel)
    with pytest.raises(ValueError, match=rf"{PREFIX}\.gate\.weight has shape \(4, 64\), "
                       r"expected \(4, 128\)"):  # fmt: skip
        block.load_weights([("gate.weight", torch.zeros(E, 64))])
    with pytest.raises(ValueError, match=r"shared_expert_gate\.weight has dtype torch\.uint8"):
        block.load_weights([("shared_expert_gate.weight", torch.zeros(1, H, dtype=torch.uint8))])
    with pytest.raises(ValueError, match=r"gate\.weight holds NaN or infinity"):
        block.load_weights([("gate.weight", torch.full((E, H), float("nan")))])


def test_finalize_names_what_never_arrived(parallel: ParallelSettings) -> None:
    tensors = layer_tensors(WeightFormat.FP8_BLOCK)
    block = block_of(parallel, cfg=config(WeightFormat.FP8_BLOCK))
    block.load_weights((n, t) for n, t in tensors.items() if n != "shared_expert_gate.weight")
    with pytest.raises(ValueError, match=r"never loaded: shared_expert_gate\.weight"):
        block.finalize()
    block.load_weights([("shared_expert_gate.weight", tensors["shared_expert_gate.weight"])])
    block.finalize()
    fresh = block_of(parallel, cfg=config(WeightFormat.FP8_BLOCK))
    skip = "shared_expert.down_proj.weight_scale_inv"
    fresh.load_weights((n, t) for n, t in tensors.items() if n != skip)
    with pytest.raises(
        IncompleteShardsError, match=r"down_proj.weight_scale_inv of the shared expert"
    ):
        fresh.finalize()


def test_forward_input_checks(parallel: ParallelSettings) -> None:
    block = block_of(parallel)
    block.load_weights(layer_tensors().items())
    block.finalize()
    with pytest.raises(
        ValueError, match=r"hidden_states has shape \(2, 64\), expected \(tokens, 128\)"
    ):
        block(torch.zeros(2, 64, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match=r"hidden_states has dtype torch\.float32, expected"):
        block(torch.zeros(2, H))


def test_unsupported_quantization_names_format_and_prefix(parallel: ParallelSettings) -> None:
    awq = config(quantization_config={"quant_method": "awq", "bits": 4})
    with pytest.raises(NotImplementedError, match=rf"{PREFIX}\.experts: .*quant_method='awq'"):
        block_of(parallel, cfg=awq)
    with pytest.raises(NotImplementedError, match=rf"{PREFIX}\.experts.*\[64, 64\]"):
        ADAPTER.moe_layers(
            config(quantization_config={"quant_method": "fp8", "weight_block_size": [64, 64]})
        )


def test_load_from_checkpoint_reports_a_missing_expert_tensor(
    tmp_path: Path, parallel: ParallelSettings
) -> None:
    cfg = config(WeightFormat.MXFP4)
    dropped = f"{PREFIX}.experts.2.down_proj.weight_scale"
    write_checkpoint(
        tmp_path, cfg, ((n, t) for n, t in ADAPTER.synthetic_tensors(cfg) if n != dropped)
    )
    with pytest.raises(CheckpointError, match=r"2\.down_proj\.weight_scale"):
        CheckpointReader(tmp_path, ADAPTER)  # validated when opened, before a block exists


# -- the adapter -----------------------------------------------------------------------------


def test_build_block_forwards_the_block_options(parallel: ParallelSettings) -> None:
    cfg = config(WeightFormat.FP8_BLOCK)
    layer = ADAPTER.moe_layers(cfg)[0]
    block = ADAPTER.build_block(
        cfg, layer, parallel=parallel, backend="reference", reload_staging_bytes=123,
        use_aux_stream=False, shared_gemm="bf16", small_batch_max_tokens=16,
    )  # fmt: skip
    assert block.experts.reload_staging_bytes == 123
    assert block.experts.small_batch_max_tokens == 16
    with pytest.raises(TypeError, match="no_such_option"):
        ADAPTER.build_block(cfg, layer, parallel=parallel, no_such_option=1)


def test_adapter_identity_and_entry_point() -> None:
    assert isinstance(ADAPTER, Qwen4ExpAdapter)
    assert (ADAPTER.name, ADAPTER.distribution) == ("qwen4exp", "megamoe-qwen4exp")
    assert ADAPTER.claims({"model_type": "qwen4_exp"})
    assert ADAPTER.claims({"model_type": "qwen4_exp_text"})
    assert ADAPTER.claims({"model_type": "qwen3_next"})
    assert ADAPTER.claims({"architectures": ["Qwen4ExpForConditionalGeneration"]})
    assert ADAPTER.claims({"architectures": ["Qwen4ExpForCausalLM"]})
    assert not ADAPTER.claims({"model_type": "glm5next"})
    assert not ADAPTER.claims({"model_type": "glm5_next"})
    assert set(ADAPTER.checkpoint_formats) == set(WeightFormat)
    points = md.entry_points(group="megamoe.adapters", name="qwen4exp")
    for point in points:  # present once the distribution is installed
        assert point.value == "megamoe.qwen4exp.adapter:ADAPTER"
        assert point.load() is ADAPTER


def test_moe_layers_of_qwen4exp_are_every_layer_then_mtp() -> None:
    cfg = config(num_hidden_layers=3, mtp_num_hidden_layers=2, decoder_sparse_step=2)
    assert [(m.prefix, m.is_mtp) for m in ADAPTER.moe_layers(cfg)] == [
        ("model.language_model.layers.0.mlp", False),
        ("model.language_model.layers.1.mlp", False),
        ("model.language_model.layers.2.mlp", False),
        ("mtp.layers.0.mlp", True),
        ("mtp.layers.1.mlp", True),
    ]
    # A text-only save (flat config) keeps its layers at model.layers.
    flat = {**cfg["text_config"], "architectures": ["Qwen4ExpForCausalLM"]}
    assert ADAPTER.moe_layers(flat)[0].prefix == "model.layers.0.mlp"


def test_moe_layers_follow_the_checkpoint_tensors(caplog: pytest.LogCaptureFixture) -> None:
    cfg = config(num_hidden_layers=2, mtp_num_hidden_layers=1)
    # A composite config over a text-only tensor layout, and no MTP tensors (what
    # transformers' save_pretrained writes): the tensors decide, and that is said once.
    names = ["model.layers.0.mlp.gate.weight", "model.layers.1.mlp.experts.0.up_proj.weight"]
    with caplog.at_level("WARNING", logger="megamoe"):
        layers = ADAPTER.moe_layers(cfg, names)
    assert [m.prefix for m in layers] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    told = [r.getMessage() for r in caplog.records if "MTP" in r.getMessage()]
    assert len(told) == 1 and "declares 1 MTP layer(s) but holds the experts of 0" in told[0]
    held = [*names, "mtp.layers.0.mlp.experts.0.up_proj.weight"]
    assert ADAPTER.moe_layers(cfg, held)[-1].prefix == "mtp.layers.0.mlp"


def test_moe_layers_of_qwen3_next_follow_sparse_step_mlp_only_and_mtp() -> None:
    base = config(WeightFormat.FP8_BLOCK)
    cfg = {
        **base["text_config"],
        "model_type": "qwen3_next",
        "architectures": ["Qwen3NextForCausalLM"],
        "num_hidden_layers": 6,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [3],
        "num_nextn_predict_layers": 2,
        "quantization_config": base["quantization_config"],
    }
    del cfg["mtp_num_hidden_layers"]
    layers = ADAPTER.moe_layers(cfg)
    assert [(m.prefix, m.is_mtp) for m in layers] == [
        ("model.layers.1.mlp", False),
        ("model.layers.5.mlp", False),
        ("mtp.layers.0.mlp", True),
        ("mtp.layers.1.mlp", True),
    ]
    assert {m.checkpoint_format for m in layers} == {WeightFormat.FP8_BLOCK}
    ignored = dict(cfg["quantization_config"])
    ignored["modules_to_not_convert"] = ["model.layers.5.mlp.experts"]
    formats = [
        m.checkpoint_format for m in ADAPTER.moe_layers({**cfg, "quantization_config": ignored})
    ]
    assert formats == [
        WeightFormat.FP8_BLOCK,
        WeightFormat.BF16,
        WeightFormat.FP8_BLOCK,
        WeightFormat.FP8_BLOCK,
    ]


@pytest.mark.parametrize("checkpoint_format", [WeightFormat.BF16, WeightFormat.FP8_BLOCK])
def test_converted_config_changes_only_the_routed_experts(
    parallel: ParallelSettings, checkpoint_format: WeightFormat
) -> None:
    cfg = config(checkpoint_format)
    converted = ADAPTER.converted_config(cfg, WeightFormat.MXFP4)
    assert (
        "quantization_config" not in cfg
        or "megamoe_converted_experts" not in cfg["quantization_config"]
    )
    assert {m.checkpoint_format for m in ADAPTER.moe_layers(converted)} == {WeightFormat.MXFP4}
    block = block_of(parallel, cfg=converted)
    assert block.experts.checkpoint_format is WeightFormat.MXFP4
    assert block.shared_expert.checkpoint_format is checkpoint_format  # not converted
