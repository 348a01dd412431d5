"""Safe reload of a whole GLM-5.3-Flash block (SPEC §5): the router, its bias and the
unfused shared expert change at ``finalize()``, in place, with the routed experts. Run as
stored (block-FP8) a failed reload leaves the output bit-identical; requantizing to MXFP8
the experts are written in place (SPEC §4.2), so a failed reload stops ``forward`` until an
update completes, and the router and shared expert still hold the previous weights."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from megamoe.core.adapters import SyntheticSizes
from megamoe.core.bitcheck import assert_bitwise_equal
from megamoe.core.formats import WeightFormat
from megamoe.core.parallel import ParallelSettings
from megamoe.core.testing import synthetic_layer_tensors
from megamoe.glm5next import ADAPTER, Glm5NextMegaMoeBlock

pytestmark = pytest.mark.filterwarnings("ignore:.*not powers of two:UserWarning")

SIZES = SyntheticSizes(
    num_layers=2, hidden_size=128, intermediate_size=128, num_experts=4, top_k=2,
    shared_intermediate_size=128,
)  # fmt: skip
FP8, MX = WeightFormat.FP8_BLOCK, WeightFormat.MXFP8
PREFIX = "model.language_model.layers.1.mlp"
NAN_SCALE = "experts.1.down_proj.weight_scale_inv"
DENSE_PARAMS = ("gate.weight", "gate.e_score_correction_bias")
Tensors = dict[str, torch.Tensor]


def _config() -> dict[str, Any]:
    return ADAPTER.synthetic_config(FP8, SIZES)


def _layer(seed: int) -> Tensors:
    return synthetic_layer_tensors(ADAPTER, _config(), PREFIX, seed)


def _block(
    parallel: ParallelSettings, run_format: WeightFormat, tensors: Tensors
) -> Glm5NextMegaMoeBlock:
    block = Glm5NextMegaMoeBlock(
        _config(), prefix=PREFIX, parallel=parallel, backend="reference",
        moe_format=run_format, fuse_shared=False,
    )  # fmt: skip
    assert block.shared_experts is not None and block.experts.weight_format is run_format
    block.load_weights(tensors.items())
    block.finalize()
    return block


def _tokens() -> torch.Tensor:
    gen = torch.Generator().manual_seed(9)
    x = torch.randn((16, SIZES.hidden_size), generator=gen)
    return (x * torch.linspace(0.5, 2.0, 16)[:, None]).to(torch.bfloat16)


def _dense_state(block: Glm5NextMegaMoeBlock) -> dict[str, torch.Tensor]:
    """Router weight, bias and shared-expert projections."""
    return {
        n: t.detach().clone()
        for n, t in block.state_dict().items()
        if n in DENSE_PARAMS or n.startswith("shared_experts.")
    }


def _pointers(block: Glm5NextMegaMoeBlock) -> dict[str, int]:
    return {n: t.data_ptr() for n, t in block.state_dict(keep_vars=True).items()}


def _new_dense_first(new: Tensors) -> list[tuple[str, torch.Tensor]]:
    dense = [(n, t) for n, t in new.items() if not n.startswith("experts.")]
    return dense + [(n, t) for n, t in new.items() if n.startswith("experts.")]


@pytest.mark.parametrize("run_format", [FP8, MX])
def test_a_reload_with_a_nan_expert_tensor_keeps_the_previous_router_and_shared_expert(
    parallel: ParallelSettings, run_format: WeightFormat
) -> None:
    block, x = _block(parallel, run_format, _layer(seed=1)), _tokens()
    before, dense = block(x), _dense_state(block)
    stream = _new_dense_first(_layer(seed=2))
    bad = dict(stream)[NAN_SCALE].clone()
    bad[0, 0] = float("nan")
    stream = [(n, bad if n == NAN_SCALE else t) for n, t in stream]  # after experts.0.*
    with pytest.raises(ValueError, match=r"NaN"):
        block.load_weights(stream)
    assert block.shared_experts is not None and block.shared_experts.pending_bytes == 0
    for name, value in _dense_state(block).items():
        assert_bitwise_equal(value, dense[name], f"{name} after the failed reload")
    if run_format is FP8:  # staged experts: the previous weights keep serving
        assert_bitwise_equal(block(x), before, "output after the failed reload")
    else:  # experts 0 were requantized in place: refused until an update completes
        with pytest.raises(RuntimeError, match=r"before finalize"):
            block(x)


@pytest.mark.parametrize("run_format", [FP8, MX])
def test_a_good_reload_lands_at_finalize_in_place(
    parallel: ParallelSettings, run_format: WeightFormat
) -> None:
    block, x = _block(parallel, run_format, _layer(seed=1)), _tokens()
    pointers, dense = _pointers(block), _dense_state(block)
    new = _layer(seed=2)
    block.load_weights(_new_dense_first(new))
    for name, value in _dense_state(block).items():  # staged until finalize
        assert_bitwise_equal(value, dense[name], f"{name} before finalize")
    block.finalize()
    fresh = _block(parallel, run_format, new)
    for name, value in _dense_state(fresh).items():
        assert_bitwise_equal(block.state_dict()[name], value, f"{name} after finalize")
        assert not torch.equal(value, dense[name])
    assert_bitwise_equal(block(x), fresh(x), "reloaded block vs a fresh one")
    assert _pointers(block) == pointers
