"""The small-batch experts path on a Hopper GPU, against the reference that emulates the kernel.

Both real layer shapes (hidden, intermediate, top-k of Qwen4-Exp and GLM-5.3-Flash; fewer
experts, so the test loads in seconds), with and without the SwiGLU clamp, block-FP8 weights
whose magnitudes differ per expert, shard and 128x128 block (``megamoe.core.testing``). The
path rounds activations as the MegaMoE kernel does, so the emulating reference backend is its
oracle: relative error <= 1e-2 (SPEC §6), and well under the float reference's distance.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch
from bitcheck import assert_bitwise_equal, relative_error
from graph_check import replayed_output
from memory import canonical_bytes, resident_bytes
from tile_forcing import WEIGHT_ROWS_WIDE, force_tiles, variant

from megamoe.core.backends.deepgemm import DeepGemmBackend
from megamoe.core.backends.small_batch import (
    KERNEL_MODULE,
    card_costs,
    crossover_tokens,
    layer_work,
)
from megamoe.core.modules.experts import MegaMoEExperts
from megamoe.core.numerics.formats import WeightFormat
from megamoe.core.testing import synthetic_expert_tensors

FMT = WeightFormat.FP8_BLOCK
EMULATED_TOL = 1e-2  # SPEC §6: emulated-kernel reference vs a kernel
EMULATED_VS_FLOAT = 0.5  # the emulation must be far closer than the float reference
# (experts, top-k, hidden, intermediate, SwiGLU clamp): the real layers' H, I and top-k.
SHAPES = {
    "qwen4exp": (64, 10, 2048, 512, None),
    "glm53flash": (32, 8, 4096, 2048, 10.0),
    "qwen4exp-clamped": (64, 10, 2048, 512, 1.5),
    "glm53flash-unclamped": (32, 8, 4096, 2048, None),
}
# every shape build() takes: those above, and eight large experts, all active from the first
# token, on which the cards' path rules differ
LAYER_SHAPES = SHAPES | {"wide8": (8, 8, 7168, 4096, None)}
MAX_TOKENS = 256
BATCH_TOKENS = 600  # from 512 tokens the kernels take their batch tiles
# the tile shapes from 512 tokens, forced: the decode grid of 32-token tiles, persistent ones,
# and the 64-token tiles with the weights' rows as the dots' rows (``WEIGHT_ROWS_WIDE``)
WEIGHT_ROWS = "WIDE_TILES with weight rows"
BATCH_TILE_SHAPES = ["MIDSIZE_TILES", "BATCH_TILES", "WIDE_TILES", WEIGHT_ROWS]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(autouse=True)
def _small_batch_available() -> None:
    reason = DeepGemmBackend.unsupported_reason(FMT, torch.device("cuda"))
    if reason is not None:
        pytest.skip(f"DeepGEMM cannot run {FMT.value} here: {reason}")


def build(
    shape: str, path: str, seed: int = 0, max_tokens: int = MAX_TOKENS, **options: object
) -> MegaMoEExperts:
    experts_count, top_k, hidden, inter, limit = LAYER_SHAPES[shape]
    experts = MegaMoEExperts(
        num_experts=experts_count, num_local_experts=experts_count, experts_start_idx=0,
        num_logical_experts=experts_count, top_k=top_k, hidden_size=hidden,
        intermediate_size=inter, weight_format=FMT, checkpoint_format=FMT,
        max_num_tokens=max_tokens, device="cuda", prefix=f"{shape}.experts",
        swiglu_limit=limit, experts_path=path, **options,  # type: ignore[arg-type]
    )  # fmt: skip
    tensors = synthetic_expert_tensors(FMT, experts_count, hidden, inter, seed=seed)
    experts.load_weights(tensors)
    experts.finalize()
    return experts


@pytest.fixture(scope="module")
def layers() -> dict[tuple[str, str], MegaMoEExperts]:
    return {}


def layer(cache: dict[tuple[str, str], MegaMoEExperts], shape: str, path: str) -> MegaMoEExperts:
    if (shape, path) not in cache:
        if path == "reference":
            cache[(shape, path)] = build(shape, "auto", backend="reference", emulate_kernel=True)
        elif path == "float":
            cache[(shape, path)] = build(shape, "auto", backend="reference")
        else:
            cache[(shape, path)] = build(shape, path, backend="deepgemm")
    return cache[(shape, path)]


def routing(
    shape: str, tokens: int, seed: int, mode: str = "uniform"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens of varied magnitude; distinct ids with ~10% unused (-1), or every expert hit,
    or every token on expert 0 alone; softmax weights (0 where unused)."""
    experts_count, top_k, hidden, _, _ = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    gain = torch.exp2(torch.rand(tokens, 1, generator=gen) * 4 - 2)
    x = (torch.randn(tokens, hidden, generator=gen) * gain).to(torch.bfloat16)
    ids = torch.rand(tokens, experts_count, generator=gen).argsort(-1)[:, :top_k]
    if mode == "uniform":
        ids = ids.masked_fill(torch.rand(tokens, top_k, generator=gen) < 0.1, -1)
    elif mode == "every":
        ids[:, 0] = torch.arange(tokens) % experts_count
        ids[:, 1:] = -1
        ids[:, 1] = (torch.arange(tokens) + 1) % experts_count
    elif mode == "one":
        ids[:, 0] = 0
        ids[:, 1:] = -1
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), -1).masked_fill(ids < 0, 0)
    return x.cuda(), weights.float().cuda(), ids.to(torch.int32).cuda()


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize(
    ("tokens", "mode"),
    [(1, "uniform"), (2, "uniform"), (3, "uniform"), (16, "uniform"), (64, "every"),
     (64, "one"), (MAX_TOKENS, "uniform")],
)  # fmt: skip
def test_small_batch_matches_the_emulating_reference(
    layers: dict[tuple[str, str], MegaMoEExperts], shape: str, tokens: int, mode: str
) -> None:
    small = layer(layers, shape, "small_batch")
    assert small.backend.path_for(small, tokens) == "small_batch"
    x, weights, ids = routing(shape, tokens, seed=tokens, mode=mode)
    got = small(x, weights, ids)
    emulated = layer(layers, shape, "reference")(x, weights, ids)
    exact = layer(layers, shape, "float")(x, weights, ids)
    error, float_error = relative_error(got, emulated), relative_error(got, exact)
    print(f"[gpu-small-batch] {shape} {tokens} {mode}: {error:.3g} (float {float_error:.3g})")
    assert error <= EMULATED_TOL
    assert error <= EMULATED_VS_FLOAT * float_error


@pytest.mark.parametrize("shape", ["qwen4exp", "glm53flash"])
def test_the_dispatch_buffers_fp8_tokens_give_the_bf16_calls_bits(
    layers: dict[tuple[str, str], MegaMoEExperts], shape: str
) -> None:
    small = layer(layers, shape, "small_batch")
    x, weights, ids = routing(shape, 5, seed=3)
    bf16_call = small(x, weights, ids)
    rows = small.dispatch_buffer(x)
    assert rows is not None
    groups = x.float().unflatten(-1, (-1, 128))  # the dispatch rule, as the router writes it
    amax = groups.abs().amax(-1, keepdim=True).clamp(min=1e-10)
    scale = amax / torch.full_like(amax, 448.0)
    rows.x[:5] = (groups * (1.0 / scale)).to(torch.float8_e4m3fn).flatten(-2)
    rows.x_scale[:5] = scale.squeeze(-1)
    rows.topk_ids[:5], rows.topk_weights[:5] = ids.long(), weights
    dispatched = small(x, weights, ids, dispatched=True)
    assert_bitwise_equal(dispatched, bf16_call, "the dispatch buffer's FP8 tokens vs bf16 ones")


@pytest.mark.parametrize("shape", ["qwen4exp", "glm53flash"])
@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_a_graph_replay_gives_the_eager_bits(
    layers: dict[tuple[str, str], MegaMoEExperts], shape: str, tokens: int
) -> None:
    small = layer(layers, shape, "small_batch")
    x, weights, ids = routing(shape, tokens, seed=11)
    eager = small(x, weights, ids)
    assert_bitwise_equal(replayed_output(lambda: small(x, weights, ids)), eager, "replay")


def test_a_reload_in_place_is_what_the_next_replay_reads() -> None:
    small = build("qwen4exp", "small_batch", seed=1, backend="deepgemm")
    x, weights, ids = routing("qwen4exp", 4, seed=5)
    graph = torch.cuda.CUDAGraph()
    small(x, weights, ids)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out = small(x, weights, ids)
    graph.replay()
    before = out.clone()
    experts_count, _, hidden, inter, _ = SHAPES["qwen4exp"]
    small.load_weights(synthetic_expert_tensors(FMT, experts_count, hidden, inter, seed=2))
    small.finalize()
    graph.replay()
    fresh = build("qwen4exp", "small_batch", seed=2, backend="deepgemm")
    assert not torch.equal(out, before)
    assert_bitwise_equal(out, fresh(x, weights, ids), "replay after a reload")


@pytest.mark.parametrize("shape", ["qwen4exp", "glm53flash"])
def test_the_path_keeps_one_resident_copy(
    layers: dict[tuple[str, str], MegaMoEExperts], shape: str
) -> None:
    small = layer(layers, shape, "small_batch")
    small(*routing(shape, 3, seed=0))
    assert resident_bytes(small) == canonical_bytes(small)


@pytest.mark.parametrize("shape", ["qwen4exp", "glm53flash"])
def test_forced_megamoe_and_auto_above_the_crossover_take_the_kernel(
    layers: dict[tuple[str, str], MegaMoEExperts], shape: str
) -> None:
    kernel = layer(layers, shape, "megamoe")
    assert kernel.backend.path_for(kernel, 1) == "megamoe"
    small = layer(layers, shape, "small_batch")
    x, weights, ids = routing(shape, 16, seed=21)
    error = relative_error(kernel(x, weights, ids), small(x, weights, ids))
    assert error <= 2 * EMULATED_TOL  # two paths, each within the kernel's bound


def test_small_batch_max_tokens_hands_larger_calls_to_megamoe(
    layers: dict[tuple[str, str], MegaMoEExperts],
) -> None:
    capped = build("qwen4exp", "auto", backend="deepgemm", small_batch_max_tokens=8)
    reference = layer(layers, "qwen4exp", "reference")
    for tokens, path in ((8, "small_batch"), (9, "megamoe")):
        assert capped.backend.path_for(capped, tokens) == path
        x, weights, ids = routing("qwen4exp", tokens, seed=40 + tokens)
        error = relative_error(capped(x, weights, ids), reference(x, weights, ids))
        assert error <= EMULATED_TOL, (tokens, path, error)


def test_auto_follows_the_rule_measured_on_this_card() -> None:
    """The layer asks the rule of the card it runs on (its device's name, ``CARD_COSTS``): a
    layer of eight large experts hands calls past 416 tokens to MegaMoE on an H200, past 513
    on an H100."""
    auto = build("wide8", "auto", max_tokens=1024)
    card = torch.cuda.get_device_name()
    limit = crossover_tokens(layer_work(auto), 1024, card)
    assert limit == {"H200": 416, "H100": 513}[card_costs(card)[0]], card
    assert auto.backend.path_for(auto, limit) == "small_batch"
    if limit < 1024:
        assert auto.backend.path_for(auto, limit + 1) == "megamoe"


@pytest.fixture(scope="module")
def batch_layers() -> dict[tuple[str, str], MegaMoEExperts]:
    return {}


def batch_layer(
    cache: dict[tuple[str, str], MegaMoEExperts], shape: str, backend: str
) -> MegaMoEExperts:
    if (shape, backend) not in cache:
        path, options = ("auto", {"emulate_kernel": True}) if backend == "reference" else (
            "small_batch", {}
        )  # fmt: skip
        cache[(shape, backend)] = build(
            shape, path, max_tokens=BATCH_TOKENS, backend=backend, **options
        )
    return cache[(shape, backend)]


def batch_tiles(name: str) -> tuple[Any, Any]:
    """The kernels' module and the tile shape ``name`` of ``BATCH_TILE_SHAPES`` to force."""
    kernels = importlib.import_module(KERNEL_MODULE)
    if name == WEIGHT_ROWS:
        return kernels, variant(kernels, "WIDE_TILES", **WEIGHT_ROWS_WIDE)
    return kernels, name


@pytest.mark.parametrize("tiles", BATCH_TILE_SHAPES)
@pytest.mark.parametrize("shape", ["qwen4exp", "glm53flash"])
@pytest.mark.parametrize("mode", ["uniform", "one"])
def test_the_batch_tiles_match_the_emulating_reference(
    monkeypatch: pytest.MonkeyPatch,
    batch_layers: dict[tuple[str, str], MegaMoEExperts],
    shape: str,
    mode: str,
    tiles: str,
) -> None:
    """From 512 tokens: 32- or 64-token expert tiles, 128-column l2 tiles (their own TMA
    descriptor), in the decode grid (a program loops over its expert's tiles) or claimed by
    persistent programs; every token on one expert gives that expert 19 tiles of 32."""
    force_tiles(monkeypatch, *batch_tiles(tiles))
    small = batch_layer(batch_layers, shape, "deepgemm")
    assert small.backend.path_for(small, BATCH_TOKENS) == "small_batch"
    x, weights, ids = routing(shape, BATCH_TOKENS, seed=9, mode=mode)
    error = relative_error(
        small(x, weights, ids), batch_layer(batch_layers, shape, "reference")(x, weights, ids)
    )
    print(f"[gpu-small-batch] {shape} {BATCH_TOKENS} {mode}: {error:.3g}")
    assert error <= EMULATED_TOL


@pytest.mark.parametrize("tiles", BATCH_TILE_SHAPES)
def test_a_batch_graph_replay_gives_the_eager_bits(
    monkeypatch: pytest.MonkeyPatch,
    batch_layers: dict[tuple[str, str], MegaMoEExperts],
    tiles: str,
) -> None:
    force_tiles(monkeypatch, *batch_tiles(tiles))
    small = batch_layer(batch_layers, "qwen4exp", "deepgemm")
    x, weights, ids = routing("qwen4exp", BATCH_TOKENS, seed=13)
    eager = small(x, weights, ids)
    assert_bitwise_equal(replayed_output(lambda: small(x, weights, ids)), eager, "replay")


def kernel_call(shape: str, first: int, max_tokens: int) -> tuple[Any, Any]:
    """The kernels' own objects for ``shape`` (the experts from ``first`` on local), random
    block-FP8 weights: ``(ExpertWeights, SmallBatchExperts)``."""
    kernels = importlib.import_module(KERNEL_MODULE)
    experts_count, top_k, hidden, inter, limit = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(5)
    local = experts_count - first
    w13 = torch.randn(local, 2 * inter, hidden, device="cuda", generator=gen)
    w2 = torch.randn(local, hidden, inter, device="cuda", generator=gen)
    scales = [
        torch.rand(local, rows // 128, cols // 128, device="cuda", generator=gen) / 64 + 1e-3
        for rows, cols in ((2 * inter, hidden), (hidden, inter))
    ]
    weights = kernels.ExpertWeights(
        w13.to(torch.float8_e4m3fn), scales[0], w2.to(torch.float8_e4m3fn), scales[1]
    )
    call = kernels.SmallBatchExperts(
        num_experts=local, first_expert=first, top_k=top_k, hidden=hidden, intermediate=inter,
        swiglu_limit=limit, max_tokens=max_tokens, device=torch.device("cuda"),
    )  # fmt: skip
    return weights, call


@pytest.mark.parametrize("mode", ["uniform", "one"])
def test_every_tile_shape_and_grouping_gives_the_same_bits(
    monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """From 512 tokens counting programs and a place launch group the pairs (12 blocks here,
    more than a place program sums per step) for the persistent programs and for the decode
    grid of 32-token tiles; the persistent programs claim their items (their atomic claims
    racing) in tiles of 64 (the tokens as the dots' rows) and 32 tokens, or take them in
    turn; the decode tiles are grouped by one program: all give the same bits, and so do
    64-token tiles with the weights' rows as the dots' rows (persistent) and with the tokens'
    in the decode grid. A third of the experts are another rank's."""
    kernels = importlib.import_module(KERNEL_MODULE)
    taking = variant(kernels, "WIDE_TILES", claim=False)
    orientations = (
        variant(kernels, "WIDE_TILES", **WEIGHT_ROWS_WIDE),
        variant(kernels, "MIDSIZE_TILES", block_m=64, token_rows=True),
    )
    first, tokens = SHAPES["qwen4exp"][0] // 3, 1200
    weights, call = kernel_call("qwen4exp", first, tokens)
    x, topk_weights, ids = routing("qwen4exp", tokens, seed=17, mode=mode)
    if mode == "one":
        ids[:, 0] = first + 1  # a local expert: 1200 of its pairs, 38 tiles
    assert call.tiles(tokens) is kernels.WIDE_TILES
    persistent = call.forward(weights, x, None, topk_weights, ids)
    for tiles in ("MIDSIZE_TILES", "DECODE_TILES", "BATCH_TILES", taking, *orientations):
        force_tiles(monkeypatch, kernels, tiles)
        got = call.forward(weights, x, None, topk_weights, ids)
        assert_bitwise_equal(got, persistent, f"{mode} {tiles}")
        assert int(call._l1_done.count_nonzero()) == 0


@pytest.mark.parametrize("shape", ["qwen4exp", "glm53flash"])
def test_l2_waits_for_its_experts_l1_programs_and_the_counts_start_at_zero(shape: str) -> None:
    """At decode sizes each l2 program waits for its expert's l1 programs (a count per
    expert, ``_l1_done``, that the combine zeroes), not for the whole l1 launch. Calls of
    scan and grouped sizes, bf16 and FP8 tokens, with no local expert at all, then graph
    replays: each gives the bits it gave first, and the counts are zero after every one (a
    count left over would let the next call's l2 read rows its l1 has not written yet)."""
    first = SHAPES[shape][0] // 4  # a quarter of the experts are another rank's
    weights, call = kernel_call(shape, first, MAX_TOKENS)
    done = call._l1_done  # the state this test is about
    calls = []
    for tokens, seed in ((1, 1), (5, 2), (16, 3), (200, 4)):
        x, topk_weights, ids = routing(shape, tokens, seed=seed)
        calls.append((x, None, topk_weights, ids))
        groups = x.float().unflatten(-1, (-1, 128))  # the dispatch rule's FP8 tokens
        scale = groups.abs().amax(-1, keepdim=True).clamp(min=1e-10) / 448.0
        x_fp8 = (groups * (1.0 / scale)).to(torch.float8_e4m3fn).flatten(-2)
        calls.append((x_fp8, scale.squeeze(-1).contiguous(), topk_weights, ids.long()))
    x, topk_weights, ids = routing(shape, 8, seed=5)
    calls.append((x, None, topk_weights, torch.full_like(ids, first - 1)))  # none is local
    first_bits = []
    for args in calls:
        first_bits.append(call.forward(weights, *args))
        torch.cuda.synchronize()
        assert int(done.count_nonzero()) == 0, f"counts left by a call of {len(args[3])} tokens"
    assert not first_bits[-1].any()
    for args, bits in zip(calls, first_bits, strict=True):
        replayed = replayed_output(lambda args=args: call.forward(weights, *args))
        assert_bitwise_equal(replayed, bits, f"replay of {len(args[3])} tokens")
        assert int(done.count_nonzero()) == 0
        assert_bitwise_equal(call.forward(weights, *args), bits, f"{len(args[3])} tokens again")


def test_a_call_cut_short_after_l1_leaves_no_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call whose l2 launch raises after l1 has counted (no combine left to zero the
    counts) zeroes them before the error reaches the caller: the next call gives its bits."""
    kernels = importlib.import_module(KERNEL_MODULE)
    weights, call = kernel_call("qwen4exp", 0, MAX_TOKENS)
    x, topk_weights, ids = routing("qwen4exp", 16, seed=6)  # l1: more programs than a wave
    expected = call.forward(weights, x, None, topk_weights, ids)
    counted = []

    def failing_l2(*args: object, **kwargs: object) -> None:
        torch.cuda.synchronize()
        counted.append(int(call._l1_done.count_nonzero()))
        raise RuntimeError("l2 launch failed")

    monkeypatch.setattr(kernels, "_l2", failing_l2)
    with pytest.raises(RuntimeError, match="l2 launch failed"):
        call.forward(weights, x, None, topk_weights, ids)
    monkeypatch.undo()
    assert counted and counted[0] > 0, "l1 counted nothing: the test shows nothing"
    assert int(call._l1_done.count_nonzero()) == 0
    assert_bitwise_equal(call.forward(weights, x, None, topk_weights, ids), expected, "next call")


def test_the_kernels_refuse_weights_the_tma_cannot_read() -> None:
    kernels = importlib.import_module(KERNEL_MODULE)
    w = torch.zeros(2, 256, 257, dtype=torch.float8_e4m3fn, device="cuda")
    scales = torch.ones(2, 2, 2, device="cuda")
    with pytest.raises(ValueError, match=r"w13 \(2, 256, 256\) .* contiguous, 16-byte aligned"):
        kernels.ExpertWeights(w[:, :, 1:], scales, w[:, :, :256], scales)


@pytest.mark.parametrize(
    ("experts", "max_tokens"), [(32769, 16), (8, 1024 * 1024 + 1)], ids=["experts", "tokens"]
)
def test_the_kernels_refuse_more_than_an_expert_tile_entry_holds(
    experts: int, max_tokens: int
) -> None:
    kernels = importlib.import_module(KERNEL_MODULE)
    with pytest.raises(ValueError, match=r"at most 32768 and 1048576 .* one int32"):
        kernels.SmallBatchExperts(
            num_experts=experts, first_expert=0, top_k=1, hidden=128, intermediate=128,
            swiglu_limit=None, max_tokens=max_tokens, device=torch.device("cuda"),
        )  # fmt: skip
