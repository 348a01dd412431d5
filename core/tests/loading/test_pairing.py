from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megamoe.core.errors import IncompleteShardsError
from megamoe.core.loading.pairing import SHARD_IDS, ShardPairing

HALVES = ("weight", "weight_scale_inv")


def _tensor(key, half: str) -> torch.Tensor:
    expert, shard = key
    code = (-1 if expert is None else expert) * 10 + SHARD_IDS.index(shard)
    return torch.tensor([code, HALVES.index(half)])


ALL_KEYS = [(e, s) for e in (None, 0, 1, 2) for s in SHARD_IDS]


@st.composite
def _streams(draw):
    """Every half of a subset of keys, permuted and cut into calls of random sizes."""
    keys = draw(st.lists(st.sampled_from(ALL_KEYS), min_size=1, unique=True))
    items = [(k, h) for k in keys for h in HALVES]
    items = draw(st.permutations(items))
    cuts = sorted(draw(st.lists(st.integers(0, len(items)), max_size=4)))
    calls, start = [], 0
    for cut in [*cuts, len(items)]:
        calls.append(items[start:cut])
        start = cut
    return keys, calls


@given(_streams())
@settings(max_examples=200, deadline=None)
def test_any_order_and_chunking_pairs_each_shard_once(stream) -> None:
    keys, calls = stream
    pairing = ShardPairing(HALVES)
    completed = {}
    for call in calls:
        for key, half in call:
            parts = pairing.add(key, half, _tensor(key, half))
            if parts is not None:
                assert key not in completed, f"{key} handed out twice"
                completed[key] = parts
    assert set(completed) == set(keys)
    for key, parts in completed.items():
        assert set(parts) == set(HALVES)
        for half, tensor in parts.items():
            assert torch.equal(tensor, _tensor(key, half))
    assert pairing.pending == {}
    pairing.check_complete()


def test_single_half_shard_is_complete_on_arrival() -> None:
    pairing = ShardPairing(("weight",))
    parts = pairing.add((3, "w2"), "weight", torch.ones(1))
    assert parts is not None and set(parts) == {"weight"}


def test_incomplete_names_missing_keys_sorted_and_truncated() -> None:
    pairing = ShardPairing(HALVES, prefix="model.layers.1.mlp.experts")
    pairing.add((None, "w1"), "weight_scale_inv", torch.ones(1))
    pairing.add((2, "w3"), "weight", torch.ones(1))
    for e in range(10, 20):
        pairing.add((e, "w2"), "weight", torch.ones(1))
    assert pairing.pending[(None, "w1")] == ("weight",)
    with pytest.raises(IncompleteShardsError) as info:
        pairing.check_complete()
    message = str(info.value)
    assert message.startswith("model.layers.1.mlp.experts: 12 expert projection(s) lack a tensor: ")
    assert "up_proj.weight_scale_inv of local expert 2," in message
    assert "gate_proj.weight of the shared expert" in message
    assert "'w" not in message  # no internal shard ids
    assert "and 4 more" in message
    assert info.value.missing[(None, "w1")] == ("weight",)
    assert isinstance(info.value, ValueError)


def test_repeated_half_replaces_earlier_one() -> None:
    pairing = ShardPairing(HALVES)
    pairing.add((0, "w1"), "weight", torch.zeros(1))
    pairing.add((0, "w1"), "weight", torch.ones(1))
    parts = pairing.add((0, "w1"), "weight_scale_inv", torch.ones(1))
    assert parts is not None and torch.equal(parts["weight"], torch.ones(1))


def test_unknown_half_and_shard_are_errors() -> None:
    pairing = ShardPairing(HALVES, prefix="p")
    with pytest.raises(ValueError, match=r"p: tensor kind 'weight_scale' for shard \(0, 'w1'\)"):
        pairing.add((0, "w1"), "weight_scale", torch.ones(1))
    with pytest.raises(ValueError, match=r"shard id 'w4' is not one of"):
        pairing.add((0, "w4"), "weight", torch.ones(1))
    with pytest.raises(ValueError, match="distinct, non-empty"):
        ShardPairing(("weight", "weight"))


def test_clear_drops_pending() -> None:
    pairing = ShardPairing(HALVES)
    pairing.add((0, "w1"), "weight", torch.ones(1))
    pairing.clear()
    pairing.check_complete()


@given(_streams())
@settings(max_examples=100, deadline=None)
def test_held_bytes_follow_the_waiting_halves(stream) -> None:
    _, calls = stream
    pairing = ShardPairing(HALVES)
    waiting: dict[tuple[object, str], int] = {}  # (key, half) -> bytes, kept independently
    cpu = torch.device("cpu")
    for n, (key, half) in enumerate(item for call in calls for item in call):
        tensor = torch.zeros(n % 5 + 1, dtype=torch.float64)  # sizes differ per half
        if pairing.add(key, half, tensor) is None:
            waiting[(key, half)] = tensor.nbytes
        else:
            for h in HALVES:
                waiting.pop((key, h), None)
        assert pairing.held_bytes(cpu) == sum(waiting.values())
    assert pairing.held_bytes(torch.device("meta")) == 0
    pairing.clear()
    assert pairing.held_bytes(cpu) == 0


def test_held_bytes_count_a_replaced_half_once() -> None:
    pairing = ShardPairing(HALVES)
    pairing.add((0, "w1"), "weight", torch.zeros(8, dtype=torch.uint8))
    pairing.add((0, "w1"), "weight", torch.zeros(3, dtype=torch.uint8))
    assert pairing.held_bytes(torch.device("cpu")) == 3
    pairing.add((0, "w1"), "weight_scale_inv", torch.ones(1))
    assert pairing.held_bytes(torch.device("cpu")) == 0
