"""Safe reload of a whole GLM-5.3-Flash block (SPEC §5): the router, its bias and the
(unfused or fused) shared expert change at ``finalize()``, in place, with the routed
experts. A reload that fails midway drops the whole update, run as stored (block-FP8) or
requantized to MXFP8: a bare ``finalize()`` afterwards keeps the previous weights serving,
bit for bit. MXFP8 writes only the first load in place (SPEC §4.2); a reload is requantized
shard by shard and staged in MXFP8 until ``finalize()`` (a full reload holds a second copy
of the experts meanwhile), with the same bits. A failed first load commits nothing: its
slots are reported missing."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from bitcheck import assert_bitwise_equal

from megamoe.core.adapters import SyntheticSizes
from megamoe.core.errors import MissingExpertsError, NonFiniteError
from megamoe.core.loading.expert_loading import STAGE_WHOLE_RELOAD
from megamoe.core.modules.parallel import ParallelSettings
from megamoe.core.numerics.formats import WeightFormat
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
WRONG_SHAPE = "experts.1.down_proj.weight"  # both after expert 0 and expert 1's gate/up
# Bad tensor: (name, error type, message fragment).
BAD = {
    "nan-scale": (NAN_SCALE, NonFiniteError, r"NaN"),
    "wrong-shape": (WRONG_SHAPE, ValueError, r"has shape \(128, 64\), expected \(128, 128\)"),
}
# (run format, fused shared expert): MXFP8 requantizes the first load in place.
CASES = [(FP8, False), (MX, False), (MX, True)]
CASE_IDS = ["fp8_block", "mxfp8", "mxfp8-fused"]
Tensors = dict[str, torch.Tensor]


def _config() -> dict[str, Any]:
    return ADAPTER.synthetic_config(FP8, SIZES)


def _layer(seed: int) -> Tensors:
    return synthetic_layer_tensors(ADAPTER, _config(), PREFIX, seed)


def _empty_block(
    parallel: ParallelSettings, run_format: WeightFormat, fused: bool = False
) -> Glm5NextMegaMoeBlock:
    block = Glm5NextMegaMoeBlock(
        _config(), prefix=PREFIX, parallel=parallel, backend="reference",
        moe_format=run_format, fuse_shared=fused, reload_staging_bytes=STAGE_WHOLE_RELOAD,
    )  # fmt: skip
    assert block.fused_shared is fused and (block.shared_experts is None) is fused
    assert block.experts.weight_format is run_format
    assert block.experts.requantizes_in_place is (run_format is MX)
    return block


def _block(
    parallel: ParallelSettings, run_format: WeightFormat, tensors: Tensors, fused: bool = False
) -> Glm5NextMegaMoeBlock:
    block = _empty_block(parallel, run_format, fused)
    block.load_weights(tensors.items())
    block.finalize()
    return block


def _tokens() -> torch.Tensor:
    gen = torch.Generator().manual_seed(9)
    x = torch.randn((16, SIZES.hidden_size), generator=gen)
    return (x * torch.linspace(0.5, 2.0, 16)[:, None]).to(torch.bfloat16)


def _pointers(block: Glm5NextMegaMoeBlock) -> dict[str, int]:
    return {n: t.data_ptr() for n, t in block.state_dict(keep_vars=True).items()}


def _state(block: Glm5NextMegaMoeBlock) -> dict[str, torch.Tensor]:
    """Every parameter: kernel tensors, router, shared expert."""
    return {n: t.detach().clone() for n, t in block.state_dict().items()}


def _new_dense_first(new: Tensors) -> list[tuple[str, torch.Tensor]]:
    dense = [(n, t) for n, t in new.items() if not n.startswith("experts.")]
    return dense + [(n, t) for n, t in new.items() if n.startswith("experts.")]


def _spoiled_stream(new: Tensors, bad: str) -> list[tuple[str, torch.Tensor]]:
    """The new tensors, dense ones first, with ``BAD[bad]``'s tensor spoiled."""
    name = BAD[bad][0]
    spoiled = new[name].clone()
    if name == NAN_SCALE:
        spoiled[0, 0] = float("nan")
    else:
        spoiled = spoiled[:, :64]
    return [(n, spoiled if n == name else t) for n, t in _new_dense_first(new)]


@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize(("run_format", "fused"), CASES, ids=CASE_IDS)
def test_a_failed_reload_then_a_bare_finalize_keeps_the_previous_weights(
    parallel: ParallelSettings, run_format: WeightFormat, fused: bool, bad: str
) -> None:
    block, x = _block(parallel, run_format, _layer(seed=1), fused), _tokens()
    before, state, pointers = block(x), _state(block), _pointers(block)
    _, error, match = BAD[bad]
    with pytest.raises(error, match=match):
        block.load_weights(_spoiled_stream(_layer(seed=2), bad))
    assert block.experts.pending_bytes == 0 and not block.experts.pending_requantization
    if block.shared_experts is not None:
        assert block.shared_experts.pending_bytes == 0
    assert_bitwise_equal(block(x), before, "output after the failed reload")
    block.finalize()  # nothing pending: the whole update was dropped
    for name, value in _state(block).items():
        assert_bitwise_equal(value, state[name], f"{name} after the failed reload")
    assert_bitwise_equal(block(x), before, "output after finalize() of the failed reload")
    assert _pointers(block) == pointers
    new = _layer(seed=2)
    block.load_weights(new.items())  # the same update, unspoiled, still lands
    block.finalize()
    fresh = _block(parallel, run_format, new, fused)
    assert not torch.equal(fresh(x), before)
    assert_bitwise_equal(block(x), fresh(x), "reloaded block vs a fresh one")
    assert _pointers(block) == pointers


@pytest.mark.parametrize("rounded_midway", [False, True], ids=["at-once", "rounded-midway"])
@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
def test_a_failed_first_load_in_place_commits_nothing(
    parallel: ParallelSettings, fused: bool, bad: str, rounded_midway: bool
) -> None:
    block, new = _empty_block(parallel, MX, fused), _layer(seed=2)
    stream, _, error, match = _spoiled_stream(new, bad), *BAD[bad]
    if rounded_midway:  # expert 0 (and the shared expert) requantized before the error
        cut = next(i for i, (n, _) in enumerate(stream) if n.startswith("experts.1."))
        block.load_weights(stream[:cut])
        block.experts.requantize_block_fp8()
        assert not block.experts.pending_requantization
        stream = stream[cut:]
    with pytest.raises(error, match=match):
        block.load_weights(stream)
    assert not block.experts.pending_requantization  # in-place shards forgotten
    slots = SIZES.num_experts + fused  # every slot: expert 0 (and the shared one) too
    with pytest.raises(MissingExpertsError, match=rf"^\S+: {slots} kernel slot\(s\) never"):
        block.experts.finalize()
    with pytest.raises(RuntimeError, match=r"before finalize"):
        block(_tokens())
    block.load_weights(new.items())  # a complete load afterwards serves as a fresh one
    block.finalize()
    fresh = _block(parallel, MX, new, fused)
    assert_bitwise_equal(block(_tokens()), fresh(_tokens()), "after a failed first load")


@pytest.mark.parametrize(("run_format", "fused"), CASES, ids=CASE_IDS)
def test_a_good_reload_lands_at_finalize_in_place(
    parallel: ParallelSettings, run_format: WeightFormat, fused: bool
) -> None:
    block, x = _block(parallel, run_format, _layer(seed=1), fused), _tokens()
    before, pointers, state = block(x), _pointers(block), _state(block)
    new = _layer(seed=2)
    block.load_weights(_new_dense_first(new))
    # Staged in the run format (none written in place), nothing served changed yet.
    assert not block.experts.pending_requantization
    kernel_bytes = sum(p.nbytes for p in block.experts.kernel_params.values())
    assert block.experts.pending_bytes >= kernel_bytes  # a full reload: a second copy
    for name, value in _state(block).items():
        assert_bitwise_equal(value, state[name], f"{name} before finalize")
    assert_bitwise_equal(block(x), before, "output before finalize")
    block.finalize()
    # The fresh block requantizes its first load in place (MXFP8), the reload went through
    # requantize_shard and the staging: the same tensors give the same bits.
    fresh = _block(parallel, run_format, new, fused)
    for name, value in _state(fresh).items():
        assert_bitwise_equal(block.state_dict()[name], value, f"{name} after finalize")
        assert not torch.equal(value, state[name]), name
    assert not torch.equal(fresh(x), before)
    assert_bitwise_equal(block(x), fresh(x), "reloaded block vs a fresh one")
    assert _pointers(block) == pointers
    assert block.experts.pending_bytes == 0
