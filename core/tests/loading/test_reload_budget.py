"""Bounded reload staging: a reload stages at most ``reload_staging_bytes``, then writes in
place, checking every tensor loaded so far first; a failure after an in-place write leaves
the layer refusing to serve until what it wrote is loaded again (a half update is never
served), and a failure before one leaves the previous weights serving."""

from __future__ import annotations

import pytest
import torch
from bitcheck import assert_bitwise_equal

from megamoe.core.errors import MissingExpertsError, NonFiniteError
from megamoe.core.loading.expert_loading import RELOAD_STAGING_SHARE
from megamoe.core.loading.finiteness import NonFiniteLedger
from megamoe.core.modules.experts import MegaMoEExperts
from megamoe.core.numerics.formats import WeightFormat
from megamoe.core.testing import one_rank_experts, synthetic_expert_tensors

E, H, INTER = 8, 256, 256
FP8 = WeightFormat.FP8_BLOCK
Stream = list[tuple[str, torch.Tensor]]
SHARD_BYTES = INTER * H + (INTER // 128) * (H // 128) * 4  # one fp8_block shard: weight + scale
BUDGET = 5 * SHARD_BYTES  # five shards: a full reload (24 shards) writes in place 4 times


def _experts(budget: int | None = BUDGET, *, deferred: bool = False) -> MegaMoEExperts:
    experts = one_rank_experts(
        E, H, INTER, weight_format=FP8, checkpoint_format=FP8, backend="reference",
        prefix="layers.0.experts", reload_staging_bytes=budget,
    )  # fmt: skip
    if deferred:  # keep CPU checks pending until the load call ends, as on a GPU
        experts._arrival.ledger = NonFiniteLedger(experts.layout.label, defer_cpu=True)
    return experts


def _stream(seed: int) -> Stream:
    return list(synthetic_expert_tensors(FP8, E, H, INTER, seed=seed))


def _served(seed: int = 0, **options: object) -> MegaMoEExperts:
    experts = _experts(**options)  # type: ignore[arg-type]
    experts.load_weights(_stream(seed))
    experts.finalize()
    return experts


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(16, H, generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, E, (16, 2), generator=gen)
    return x, torch.rand(16, 2, generator=gen), ids


def _state(experts: MegaMoEExperts) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in experts.kernel_params.items()}


def _nan(stream: Stream, name: str) -> Stream:
    return [(n, torch.full_like(t, float("nan")) if n == name else t) for n, t in stream]


def test_the_default_budget_is_a_sixteenth_of_the_kernel_bytes() -> None:
    experts = _experts(budget=None)
    kernel = sum(p.nbytes for p in experts.kernel_params.values())
    assert experts.reload_staging_bytes == int(RELOAD_STAGING_SHARE * kernel) == kernel // 16


def test_a_full_reload_never_stages_more_than_the_budget_and_lands_exactly() -> None:
    experts, new = _served(0), _stream(1)
    pointers = {n: p.data_ptr() for n, p in experts.kernel_params.items()}
    peak = 0
    for name, tensor in new:  # one tensor per call, as a chunked weight sync does
        experts.load_weights([(name, tensor)])
        peak = max(peak, experts.pending_bytes)
        assert experts.pending_bytes <= BUDGET
    assert peak > 0
    with pytest.raises(RuntimeError, match=r"forward\(\) before finalize\(\)"):
        experts(*_inputs())  # part of the update is in place: nothing is served half-new
    experts.finalize()
    fresh = _served(1)
    for name, value in _state(fresh).items():
        assert_bitwise_equal(experts.kernel_params[name].data, value, name)
    assert {n: p.data_ptr() for n, p in experts.kernel_params.items()} == pointers
    assert torch.equal(experts(*_inputs()), fresh(*_inputs()))


def test_a_reload_within_the_budget_that_fails_keeps_the_previous_weights() -> None:
    experts = _served(0)
    before, out = _state(experts), experts(*_inputs())
    subset = [(n, t) for n, t in _stream(1) if n.startswith(("2.", "3."))][:4]  # 2 shards
    subset.append(("5.up_proj.weight_scale_inv", torch.full((2, 2), float("nan"))))
    with pytest.raises(NonFiniteError):
        experts.load_weights(subset)
    experts.finalize()
    assert torch.equal(experts(*_inputs()), out)
    for name, value in before.items():
        assert_bitwise_equal(experts.kernel_params[name].data, value, name)


def test_a_reload_failing_after_an_in_place_write_serves_nothing_until_repaired() -> None:
    experts = _served(0)
    new = _stream(1)
    bad = "6.down_proj.weight_scale_inv"  # well past the first in-place write
    with pytest.raises(NonFiniteError, match=r"expert 6 down_proj\.weight_scale_inv"):
        experts.load_weights(_nan(new, bad))
    written = experts.unrepaired_shards
    assert written and len(written) < 3 * E
    with pytest.raises(RuntimeError, match=r"forward\(\) before finalize\(\)"):
        experts(*_inputs())
    with pytest.raises(MissingExpertsError, match=r"a reload that failed had written \d+ shard"):
        experts.finalize()  # a bare finalize() commits nothing half-new
    with pytest.raises(RuntimeError, match=r"forward\(\) before finalize\(\)"):
        experts(*_inputs())
    experts.load_weights(new)  # the whole update again
    experts.finalize()
    assert not experts.unrepaired_shards
    assert torch.equal(experts(*_inputs()), _served(1)(*_inputs()))


def test_a_repair_attempt_that_is_dropped_repairs_nothing() -> None:
    """A partial repair that finalize() refuses and the caller then drops leaves its shards
    unrepaired: the failed reload's bits there are never served beside the old weights."""
    experts = _served(0)
    old, new = _stream(0), _stream(1)
    with pytest.raises(NonFiniteError):
        experts.load_weights(_nan(new, "6.down_proj.weight_scale_inv"))
    written = experts.unrepaired_shards
    assert (0, "w1") in written
    experts.load_weights([(n, t) for n, t in old if n.startswith("0.")])  # repair expert 0
    with pytest.raises(MissingExpertsError, match=r"had written \d+ shard"):
        experts.finalize()  # the other shards are still the failed reload's
    assert experts.unrepaired_shards == written, "a refused finalize() repaired nothing"
    experts.discard_pending()  # the engine drops that attempt
    assert experts.unrepaired_shards == written
    experts.load_weights([(n, t) for n, t in old if not n.startswith("0.")])
    with pytest.raises(MissingExpertsError, match=r"expert slot 0 .*gate_proj"):
        experts.finalize()  # expert 0 still holds the failed reload's bits
    experts.load_weights([(n, t) for n, t in old if n.startswith("0.")])
    experts.finalize()
    assert torch.equal(experts(*_inputs()), _served(0)(*_inputs()))


def test_nothing_unchecked_is_written_in_place() -> None:
    """A bad tensor whose check is still pending (on a GPU: until the load call ends) is
    read back before the first in-place write, so the previous weights keep serving."""
    experts = _served(0, deferred=True)
    out = experts(*_inputs())
    new = _nan(_stream(1), "0.gate_proj.weight_scale_inv")  # the first shard of the update
    with pytest.raises(NonFiniteError, match=r"expert 0 gate_proj\.weight_scale_inv"):
        experts.load_weights(new)  # one call: the budget fills long before it ends
    assert not experts.unrepaired_shards
    experts.finalize()
    assert torch.equal(experts(*_inputs()), out)


def test_a_zero_budget_writes_every_reloaded_shard_in_place() -> None:
    experts = _served(0, budget=0)
    experts.load_weights(_stream(1)[:2])  # one shard: weight and scale
    assert experts.pending_bytes == 0
    experts.finalize()
    with pytest.raises(ValueError, match=r"reload_staging_bytes=-1 must be >= 0"):
        _experts(budget=-1)
