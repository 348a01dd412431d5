"""Safe reload of a whole Qwen4Exp block (SPEC §5): router, shared-expert gate and shared
expert change together with the routed experts, at ``finalize()``, in place; a reload that
fails midway (any error while loading) leaves the block computing exactly what it computed
before, in every run format, and a bare ``finalize()`` afterwards commits nothing."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from bitcheck import assert_bitwise_equal

from megamoe.core.adapters import SyntheticSizes
from megamoe.core.errors import IncompleteShardsError, NonFiniteError
from megamoe.core.loading.expert_loading import STAGE_WHOLE_RELOAD
from megamoe.core.modules.parallel import ParallelSettings
from megamoe.core.numerics.formats import WeightFormat
from megamoe.core.testing import synthetic_layer_tensors
from megamoe.qwen4exp import ADAPTER, Qwen4ExpMegaMoeBlock

SIZES = SyntheticSizes(
    num_layers=1, hidden_size=128, intermediate_size=128, num_experts=4, top_k=2,
    shared_intermediate_size=128,
)  # fmt: skip
FP8 = WeightFormat.FP8_BLOCK  # the shared expert is dequantized on load: the staged path
BF16, MX8, MX4 = WeightFormat.BF16, WeightFormat.MXFP8, WeightFormat.MXFP4
# (checkpoint, run) pairs: block-FP8 converted to every run format, and each run format as
# stored (the reference backend runs all four).
FORMAT_PAIRS = [(FP8, BF16), (FP8, FP8), (FP8, MX8), (FP8, MX4), (BF16, BF16), (MX8, MX8),
                (MX4, MX4)]  # fmt: skip
PREFIX = "model.language_model.layers.0.mlp"
DENSE = ("gate.weight", "shared_expert_gate.weight")
NAN_SCALE = "experts.1.down_proj.weight_scale_inv"
Tensors = dict[str, torch.Tensor]


def _config() -> dict[str, Any]:
    return ADAPTER.synthetic_config(FP8, SIZES)


def _layer(seed: int) -> Tensors:
    return synthetic_layer_tensors(ADAPTER, _config(), PREFIX, seed)


def _block(parallel: ParallelSettings, tensors: Tensors) -> Qwen4ExpMegaMoeBlock:
    block = Qwen4ExpMegaMoeBlock(
        _config(), prefix=PREFIX, parallel=parallel, backend="reference",
        reload_staging_bytes=STAGE_WHOLE_RELOAD,
    )  # fmt: skip
    block.load_weights(tensors.items())
    block.finalize()
    return block


def _tokens() -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn((16, SIZES.hidden_size), generator=gen)
    return (x * torch.linspace(0.5, 2.0, 16)[:, None]).to(torch.bfloat16)


def _state(block: Qwen4ExpMegaMoeBlock) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in block.named_parameters()}


def _pointers(block: Qwen4ExpMegaMoeBlock) -> dict[str, int]:
    return {n: p.data_ptr() for n, p in block.named_parameters()}


def _new_dense_first(new: Tensors) -> list[tuple[str, torch.Tensor]]:
    """The new router, gate and shared expert, then every new expert tensor."""
    dense = [(n, t) for n, t in new.items() if not n.startswith("experts.")]
    return dense + [(n, t) for n, t in new.items() if n.startswith("experts.")]


def test_a_reload_with_a_nan_expert_tensor_leaves_the_block_as_it_was(
    parallel: ParallelSettings,
) -> None:
    block, x = _block(parallel, _layer(seed=1)), _tokens()
    before, state = block(x), _state(block)
    stream = _new_dense_first(_layer(seed=2))
    bad = dict(stream)[NAN_SCALE].clone()
    bad[0, 0] = float("nan")
    stream = [(n, bad if n == NAN_SCALE else t) for n, t in stream]
    with pytest.raises(ValueError, match=r"NaN"):
        block.load_weights(stream)
    assert block.experts.pending_bytes == 0 and block.shared_expert.pending_bytes == 0
    block.finalize()  # nothing pending: the whole update was dropped
    for name, value in _state(block).items():
        assert_bitwise_equal(value, state[name], f"{name} after the failed reload")
    assert_bitwise_equal(block(x), before, "output after the failed reload")


def test_a_reload_stopped_by_an_incomplete_shard_changes_nothing(
    parallel: ParallelSettings,
) -> None:
    block, x = _block(parallel, _layer(seed=1)), _tokens()
    before, state = block(x), _state(block)
    new = _layer(seed=2)
    block.load_weights((n, new[n]) for n in (*DENSE, "shared_expert.up_proj.weight"))
    block.load_weights([("experts.0.gate_proj.weight", new["experts.0.gate_proj.weight"])])
    with pytest.raises(IncompleteShardsError):
        block.finalize()
    for name, value in _state(block).items():
        assert_bitwise_equal(value, state[name], f"{name} after the incomplete reload")
    assert_bitwise_equal(block(x), before, "output after the incomplete reload")


def test_a_good_reload_lands_at_finalize_in_place(parallel: ParallelSettings) -> None:
    block, x = _block(parallel, _layer(seed=1)), _tokens()
    before, pointers, state = block(x), _pointers(block), _state(block)
    new = _layer(seed=2)
    block.load_weights(_new_dense_first(new))
    assert block.shared_expert.pending_bytes == 3 * 128 * 128 * 2  # its three bf16 projections
    for name, value in _state(block).items():  # staged: nothing served changed yet
        assert_bitwise_equal(value, state[name], f"{name} before finalize")
    assert_bitwise_equal(block(x), before, "output before finalize")
    block.finalize()
    fresh = _block(parallel, new)
    assert not torch.equal(fresh(x), before)  # the reload is visible in the output
    assert_bitwise_equal(block(x), fresh(x), "reloaded block vs a fresh one")
    for name, value in _state(fresh).items():
        assert_bitwise_equal(dict(block.named_parameters())[name], value, name)
    assert _pointers(block) == pointers
    assert block.shared_expert.pending_bytes == 0


def test_a_partial_reload_of_the_router_alone_commits_at_finalize(
    parallel: ParallelSettings,
) -> None:
    block = _block(parallel, _layer(seed=1))
    old = block.gate.weight.detach().clone()
    router = _layer(seed=2)["gate.weight"]
    block.load_weights([("gate.weight", router)])
    assert_bitwise_equal(block.gate.weight, old, "router before finalize")
    block.finalize()
    assert_bitwise_equal(block.gate.weight, router, "router after finalize")
    assert not torch.equal(old, router)


def _spoiled(tensor: torch.Tensor, bad: str) -> torch.Tensor:
    """A NaN in the first element (NaN bytes for FP8 and UE8M0), or half the columns."""
    if bad == "wrong-shape":
        return tensor[:, : tensor.shape[1] // 2]
    spoiled = tensor.clone()
    if spoiled.dtype in (torch.uint8, torch.float8_e4m3fn):  # UE8M0 / E4M3 NaN byte
        spoiled.view(torch.uint8)[0, 0] = 0xFF
    else:
        spoiled[0, 0] = float("nan")
    return spoiled


@pytest.mark.parametrize("bad", ["nan", "wrong-shape"])
@pytest.mark.parametrize(
    ("checkpoint_format", "run_format"),
    FORMAT_PAIRS,
    ids=[f"{c.value}-to-{r.value}" for c, r in FORMAT_PAIRS],
)
def test_a_failed_reload_then_a_bare_finalize_keeps_the_previous_weights(
    parallel: ParallelSettings, checkpoint_format: WeightFormat, run_format: WeightFormat, bad: str
) -> None:
    config = ADAPTER.synthetic_config(checkpoint_format, SIZES)

    def build(tensors: Tensors) -> Qwen4ExpMegaMoeBlock:
        block = Qwen4ExpMegaMoeBlock(
            config, prefix=PREFIX, parallel=parallel, backend="reference", moe_format=run_format,
            reload_staging_bytes=STAGE_WHOLE_RELOAD,
        )  # fmt: skip
        assert (block.experts.checkpoint_format, block.experts.weight_format) == (
            checkpoint_format,
            run_format,
        )
        block.load_weights(tensors.items())
        block.finalize()
        return block

    block, x = build(synthetic_layer_tensors(ADAPTER, config, PREFIX, 1)), _tokens()
    before, state, pointers = block(x), _state(block), _pointers(block)
    new = synthetic_layer_tensors(ADAPTER, config, PREFIX, 2)
    # After expert 0 and expert 1's gate/up: the scale if there is one, else the weight.
    target = next(n for n in reversed(new) if n.startswith("experts.1.down_proj."))
    if bad == "wrong-shape":
        target = next(n for n in new if n.startswith("experts.1.down_proj.weight"))
    stream = [(n, _spoiled(t, bad) if n == target else t) for n, t in _new_dense_first(new)]
    error, match = (NonFiniteError, r"NaN") if bad == "nan" else (ValueError, r"has shape")
    with pytest.raises(error, match=match):
        block.load_weights(stream)
    assert block.experts.pending_bytes == 0 and block.shared_expert.pending_bytes == 0
    block.finalize()  # nothing pending: the whole update was dropped
    for name, value in _state(block).items():
        assert_bitwise_equal(value, state[name], f"{name} after the failed reload")
    assert_bitwise_equal(block(x), before, "output after the failed reload")
    assert _pointers(block) == pointers
    block.load_weights(new.items())  # the same update, unspoiled, still lands
    block.finalize()
    fresh = build(new)
    assert not torch.equal(fresh(x), before)
    assert_bitwise_equal(block(x), fresh(x), "reloaded block vs a fresh one")
