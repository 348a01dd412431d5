"""The small-batch experts kernels on CPU, in Triton's interpreter rounding as the GPU does.

The same kernels the H200 runs (``megamoe.core.kernels.experts_small_batch``), on a
layer small enough for the interpreter (16 experts, top-4, H = I = 256), against the torch
reference backend that emulates the Hopper kernel's rounding (``emulate_kernel=True``, its
oracle on the GPU too): every launch sequence the tile rule can pick (scan, grouped by one
program, grouped by counting programs and a place launch; decode grid, persistent
programs), with and without the SwiGLU clamp, unused slots and other ranks' experts.
``conftest.py`` says what the interpreter cannot show.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
import torch
import triton
import triton.language as tl
from bitcheck import assert_bitwise_equal, relative_error
from tile_forcing import WEIGHT_ROWS_WIDE, force_tiles, variant

from megamoe.core.backends.deepgemm_layout import L1_ROW_ORDER
from megamoe.core.backends.small_batch import LayerWork
from megamoe.core.loading.pairing import SHARD_GATE, SHARD_UP
from megamoe.core.modules.experts import MegaMoEExperts
from megamoe.core.numerics.formats import WeightFormat
from megamoe.core.testing import synthetic_expert_tensors

# Triton 3.6's interpreter reads one-element arrays with int() (numpy < 2.4 only warns).
pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"
)
FMT = WeightFormat.FP8_BLOCK
EXPERTS, TOP_K, HIDDEN, INTER = 16, 4, 256, 256
MAX_TOKENS = 640
# Only the GEMMs' summation order differs from the emulating reference (measured here: 0 at
# 1-40 tokens, 2.9e-5 at 520); the float reference is 3.6e-2 to 6.6e-2 away.
EMULATED_TOL = 2e-4
FLOAT_DISTANCE = 1e-2  # the float reference must be at least this far: the test can tell


def reference(limit: float | None, emulate: bool) -> MegaMoEExperts:
    """The torch reference backend on CPU over the synthetic block-FP8 experts."""
    experts = MegaMoEExperts(
        num_experts=EXPERTS, num_local_experts=EXPERTS, experts_start_idx=0,
        num_logical_experts=EXPERTS, top_k=TOP_K, hidden_size=HIDDEN, intermediate_size=INTER,
        weight_format=FMT, checkpoint_format=FMT, max_num_tokens=MAX_TOKENS, device="cpu",
        prefix="interpreted.experts", swiglu_limit=limit, backend="reference",
        emulate_kernel=emulate,
    )  # fmt: skip
    experts.load_weights(synthetic_expert_tensors(FMT, EXPERTS, HIDDEN, INTER, seed=3))
    experts.finalize()
    return experts


def kernel_weights(kernels: ModuleType, experts: MegaMoEExperts, first: int = 0) -> Any:
    """The reference's experts from ``first`` on, as the kernels read them (w13 in L1 order)."""
    params = {name: p.data[first:] for name, p in experts.kernel_params.items()}
    canonical = params["w13_weight"]
    w13 = torch.empty_like(canonical)
    for shard, rows in ((SHARD_GATE, 0), (SHARD_UP, INTER)):
        L1_ROW_ORDER.write(w13, shard, canonical.narrow(1, rows, INTER))
    return kernels.ExpertWeights(
        w13, params["w13_weight_scale"].contiguous(), params["w2_weight"].contiguous(),
        params["w2_weight_scale"].contiguous(),
    )  # fmt: skip


def kernel_call(kernels: ModuleType, limit: float | None, first: int = 0) -> Any:
    return kernels.SmallBatchExperts(
        num_experts=EXPERTS - first, first_expert=first, top_k=TOP_K, hidden=HIDDEN,
        intermediate=INTER, swiglu_limit=limit, max_tokens=MAX_TOKENS,
        device=torch.device("cpu"),
    )  # fmt: skip


def routing(
    tokens: int, seed: int, mode: str = "uniform"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens of varied magnitude; distinct ids, ~10% unused (-1) and one token with every
    slot unused, or with every token's first slot on expert 3; softmax weights."""
    gen = torch.Generator().manual_seed(seed)
    gain = torch.exp2(torch.rand(tokens, 1, generator=gen) * 4 - 2)
    x = (torch.randn(tokens, HIDDEN, generator=gen) * gain).to(torch.bfloat16)
    ids = torch.rand(tokens, EXPERTS, generator=gen).argsort(-1)[:, :TOP_K]
    ids = ids.masked_fill(torch.rand(tokens, TOP_K, generator=gen) < 0.1, -1)
    if mode == "one":
        ids[:, 0] = 3
    if tokens > 1:
        ids[tokens // 2] = -1
    weights = torch.softmax(torch.randn(tokens, TOP_K, generator=gen), -1).masked_fill(ids < 0, 0)
    return x, weights, ids.to(torch.int32)


@pytest.fixture(scope="module")
def references() -> dict[tuple[float | None, bool], MegaMoEExperts]:
    return {(limit, emulate): reference(limit, emulate) for limit in (None, 10.0)
            for emulate in (True, False)}  # fmt: skip


@pytest.fixture(scope="module")
def calls(gpu_like_interpreter: ModuleType) -> dict[float | None, Any]:
    return {limit: kernel_call(gpu_like_interpreter, limit) for limit in (None, 10.0)}


@triton.jit
def _round_kernel(x_ptr: tl.tensor, fp8_ptr: tl.tensor, bf16_ptr: tl.tensor) -> None:
    x = tl.load(x_ptr + tl.arange(0, 8))
    tl.store(fp8_ptr + tl.arange(0, 8), x.to(tl.float8e4nv))
    tl.store(bf16_ptr + tl.arange(0, 8), x.to(tl.bfloat16))


def test_the_interpreter_rounds_as_the_gpu() -> None:
    """The fixture's conversions: 124 to 128 (the carry into the exponent), 100 to 96 (a tie
    to even), 1 + 2^-8 to bfloat16 1 (a tie) and 1 + 3 * 2^-9 up; as torch and the GPU."""
    x = torch.tensor([124.0, 100.0, 104.0, -0.3, 1 + 2**-8, 1 + 3 * 2**-9, 1e-3, 448.0])
    fp8 = torch.empty(8, dtype=torch.float8_e4m3fn)
    bf16 = torch.empty(8, dtype=torch.bfloat16)
    _round_kernel[(1,)](x, fp8, bf16)
    assert fp8[:2].float().tolist() == [128.0, 96.0]
    assert_bitwise_equal(fp8, x.to(torch.float8_e4m3fn), "float32 to float8e4nv")
    assert_bitwise_equal(bf16, x.to(torch.bfloat16), "float32 to bfloat16")


@pytest.mark.parametrize(
    ("tokens", "limit", "mode"),
    [(1, None, "uniform"), (3, 10.0, "uniform"), (12, None, "uniform"), (40, 10.0, "uniform"),
     (40, None, "one"), (520, 10.0, "uniform")],
)  # fmt: skip
def test_the_kernels_match_the_emulating_reference(
    gpu_like_interpreter: ModuleType,
    references: dict[tuple[float | None, bool], MegaMoEExperts],
    calls: dict[float | None, Any],
    tokens: int,
    limit: float | None,
    mode: str,
) -> None:
    """1-12 tokens scan the ids (16 pairs or fewer, cast by the route launch), 40 group the
    pairs in one program, 520 take counting programs, a place launch and the persistent
    programs; a token with every slot unused gives zeros."""
    kernels = gpu_like_interpreter
    x, weights, ids = routing(tokens, seed=tokens, mode=mode)
    call = calls[limit]
    got = call.forward(kernel_weights(kernels, references[(limit, True)]), x, None, weights, ids)
    emulated = references[(limit, True)](x, weights, ids)
    error = relative_error(got, emulated)
    assert error <= EMULATED_TOL, f"{tokens} tokens: {error:.2e} from the emulating reference"
    float_error = relative_error(references[(limit, False)](x, weights, ids), emulated)
    assert float_error >= FLOAT_DISTANCE, f"the float reference is only {float_error:.2e} away"
    if tokens > 1:
        assert not got[tokens // 2].any(), "a token with every slot unused must give zeros"


def test_fp8_tokens_skip_the_route_launch_and_give_the_same_bits(
    gpu_like_interpreter: ModuleType,
    references: dict[tuple[float | None, bool], MegaMoEExperts],
    calls: dict[float | None, Any],
) -> None:
    """Tokens already cast by the dispatch rule (as the blocks' router writes them: FP8 E4M3,
    a float32 scale per 128 columns, amax / 448) run with no route launch at all; the bf16
    tokens' cast by the route launch is the same rule, bit for bit."""
    x, weights, ids = routing(5, seed=11)
    experts = kernel_weights(gpu_like_interpreter, references[(None, True)])
    groups = x.float().unflatten(-1, (HIDDEN // 128, 128))
    scale = groups.abs().amax(-1).clamp(min=gpu_like_interpreter.TOKEN_AMAX_FLOOR) / 448.0
    x_fp8 = (groups * (1.0 / scale)[..., None]).to(torch.float8_e4m3fn).flatten(1)
    call = calls[None]
    assert_bitwise_equal(
        call.forward(experts, x_fp8, scale, weights, ids),
        call.forward(experts, x, None, weights, ids),
        "FP8 tokens vs bf16 tokens cast by the route launch",
    )


@pytest.mark.parametrize("mode", ["uniform", "one"])
def test_every_tile_shape_gives_the_same_bits(
    monkeypatch: pytest.MonkeyPatch,
    gpu_like_interpreter: ModuleType,
    references: dict[tuple[float | None, bool], MegaMoEExperts],
    mode: str,
) -> None:
    """The four tile shapes, forced at 128 tokens (every first slot on expert 3 gives it 128
    pairs: 2 tiles of 64, 4 of 32, 8 of 16), the persistent ones claiming their items; then
    on 4 SMs the persistent programs again, each claiming or taking in turn many items, and
    the decode grid with l2 waiting per expert (l1's programs no longer run at once); a
    quarter of the experts are another rank's (ids 0-3), skipped; the per-expert counts are
    zero after every call, and every claimed item was claimed once (the counters end at the
    items plus one failed claim per program). The 64-token tiles with the weights' rows as
    the dots' rows (``WIDE_TILES`` until the fourteenth session: two programs per SM, the
    shape ``h200.sh`` times beside the production one), and 64-token tiles with the tokens'
    in the decode grid, give the same bits."""
    kernels = gpu_like_interpreter
    first = EXPERTS // 4
    taking = variant(kernels, "BATCH_TILES", claim=False)
    orientations = {
        "WIDE_TILES with weight rows, 2 programs per SM": variant(
            kernels, "WIDE_TILES", **WEIGHT_ROWS_WIDE
        ),
        "64-token decode grid with token rows": variant(
            kernels, "MIDSIZE_TILES", block_m=64, token_rows=True
        ),
    }  # fmt: skip
    experts = kernel_weights(kernels, references[(10.0, True)], first)
    call = kernel_call(kernels, 10.0, first)
    x, weights, ids = routing(128, seed=7, mode=mode)
    if mode == "one":
        ids[:, 0] = first + 3
    local = (ids >= first).logical_and(ids < EXPERTS)
    expected = call.forward(experts, x, None, weights, ids.masked_fill(~local, -1))
    results = {}
    claims = []
    for name in ("DECODE_TILES", "MIDSIZE_TILES", "BATCH_TILES", "WIDE_TILES"):
        force_tiles(monkeypatch, kernels, name)
        results[name] = call.forward(experts, x, None, weights, ids)
        if getattr(kernels, name).claim:
            claims.append(claim_counters(kernels, call, ids.numel(), getattr(kernels, name), 132))
    sms = call._sms
    monkeypatch.setattr(call, "_sms", 4)
    force_tiles(monkeypatch, kernels, "BATCH_TILES")
    results["BATCH_TILES claiming on 4 SMs"] = call.forward(experts, x, None, weights, ids)
    claims.append(claim_counters(kernels, call, ids.numel(), kernels.BATCH_TILES, 4))
    force_tiles(monkeypatch, kernels, taking)
    results["BATCH_TILES taking in turn, 8 l1 and 12 l2 programs"] = call.forward(
        experts, x, None, weights, ids
    )
    force_tiles(monkeypatch, kernels, "DECODE_TILES")
    results["DECODE_TILES waiting per expert"] = call.forward(experts, x, None, weights, ids)
    monkeypatch.setattr(call, "_sms", sms)
    for name, tiles in orientations.items():
        force_tiles(monkeypatch, kernels, tiles)
        results[name] = call.forward(experts, x, None, weights, ids)
    for name, got in results.items():
        assert_bitwise_equal(got, expected, f"{mode}: {name}")
    assert int(call._l1_done.count_nonzero()) == 0
    for counted, expected_claims in claims:
        assert counted == expected_claims


def claim_counters(
    kernels: ModuleType, call: Any, pairs: int, tiles: Any, sms: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    """The route table's l1 and l2 claim counters after a call, and what they should hold:
    each launch's items, plus one failed claim per program of its grid."""
    at = 3 * call.num_experts + 1 + 2 * pairs
    expert_tiles = int(call._table[at])
    counted = (int(call._table[at + kernels.L1_CLAIMS]), int(call._table[at + kernels.L2_CLAIMS]))
    most = kernels.most_expert_tiles(pairs, call.num_experts, tiles.block_m)
    l1_columns, l2_columns = INTER // kernels.BLOCK_N1, HIDDEN // tiles.block_n2
    l1_programs = min(most * l1_columns, sms * tiles.l1_per_sm)
    l2_programs = min(most * l2_columns, sms * tiles.l2_per_sm)
    expected = (
        expert_tiles * l1_columns + l1_programs, expert_tiles * l2_columns + l2_programs
    )  # fmt: skip
    return counted, expected


def test_the_route_table_groups_the_pairs_by_expert(
    gpu_like_interpreter: ModuleType,
    references: dict[tuple[float | None, bool], MegaMoEExperts],
    calls: dict[float | None, Any],
) -> None:
    """At 600 tokens (2400 pairs: three counting programs) the table holds each expert's
    count, their offsets, the active experts in order, each expert's pairs (in any order)
    and the persistent programs' expert tiles of 64 pairs, and the claim counters."""
    kernels = gpu_like_interpreter
    tokens, call = 600, calls[None]
    x, weights, ids = routing(tokens, seed=5)
    assert call.tiles(tokens) is kernels.WIDE_TILES
    call.forward(kernel_weights(kernels, references[(None, True)]), x, None, weights, ids)
    pairs, table = ids.numel(), call._table
    flat = ids.flatten().long()
    counts = torch.bincount(flat[flat >= 0], minlength=EXPERTS).int()
    offsets = counts.cumsum(0).int() - counts
    active = counts.nonzero().flatten().int()
    assert torch.equal(table[:EXPERTS], counts)
    assert torch.equal(table[EXPERTS : 2 * EXPERTS], offsets)
    assert int(table[3 * EXPERTS]) == active.numel()
    assert torch.equal(table[2 * EXPERTS : 2 * EXPERTS + active.numel()], active)
    grouped = table[3 * EXPERTS + 1 + pairs :][:pairs]
    for expert in range(EXPERTS):
        held = grouped[offsets[expert] : offsets[expert] + counts[expert]].sort().values
        assert torch.equal(held, (flat == expert).nonzero().flatten().int()), f"expert {expert}"
    tiles = table[3 * EXPERTS + 1 + 2 * pairs :]
    block_m = kernels.WIDE_TILES.block_m
    expected = [e * kernels.TILE_LIMIT + t for e in range(EXPERTS)
                for t in range(-(-int(counts[e]) // block_m))]  # fmt: skip
    assert int(tiles[0]) == len(expected)
    counted, expected_claims = claim_counters(kernels, call, pairs, kernels.WIDE_TILES, call._sms)
    assert counted == expected_claims  # each item claimed once, one failed claim per program
    assert tiles[kernels.TILES_HEADER : kernels.TILES_HEADER + len(expected)].tolist() == expected


QWEN4EXP_EXPERT = 3 * 2048 * 512  # bytes of one block-FP8 expert: 3.1 MB
GLM53FLASH_EXPERT = 3 * 4096 * 2048  # 25 MB
DEEPSEEKV3_EXPERT = 3 * 7168 * 2048  # 44 MB
LARGE_EXPERT = 8 << 20  # from here an expert takes the 64-token tiles past 26 pairs


@pytest.mark.parametrize(
    ("experts", "top_k", "expert_bytes", "tokens", "expected"),
    [
        (512, 10, QWEN4EXP_EXPERT, 511, "DECODE_TILES"),
        (512, 10, QWEN4EXP_EXPERT, 512, "MIDSIZE_TILES"),
        (512, 10, QWEN4EXP_EXPERT, 1228, "MIDSIZE_TILES"),
        (512, 10, QWEN4EXP_EXPERT, 1229, "BATCH_TILES"),
        (512, 10, QWEN4EXP_EXPERT, 1638, "BATCH_TILES"),
        (512, 10, QWEN4EXP_EXPERT, 1639, "WIDE_TILES"),
        (288, 8, GLM53FLASH_EXPERT, 864, "MIDSIZE_TILES"),
        (288, 8, GLM53FLASH_EXPERT, 865, "BATCH_TILES"),
        (288, 8, GLM53FLASH_EXPERT, 936, "BATCH_TILES"),
        (288, 8, GLM53FLASH_EXPERT, 937, "WIDE_TILES"),
        (256, 8, DEEPSEEKV3_EXPERT, 832, "BATCH_TILES"),
        (256, 8, DEEPSEEKV3_EXPERT, 1024, "WIDE_TILES"),
        (288, 8, LARGE_EXPERT - 1, 1152, "BATCH_TILES"),
        (288, 8, LARGE_EXPERT, 1152, "WIDE_TILES"),
        (64, 10, QWEN4EXP_EXPERT, 512, "WIDE_TILES"),
        (256, 10, QWEN4EXP_EXPERT, 512, "MIDSIZE_TILES"),
        (160, 10, QWEN4EXP_EXPERT, 512, "BATCH_TILES"),
    ],
)  # fmt: skip
def test_the_tiles_follow_the_tokens_the_pairs_and_the_expert_size(
    gpu_like_interpreter: ModuleType,
    experts: int,
    top_k: int,
    expert_bytes: int,
    tokens: int,
    expected: str,
) -> None:
    """Below 512 tokens the decode tiles; then the decode grid of 32-token tiles while the
    local experts hold at most 24 pairs each on average (Qwen4-Exp's 512 x top-10 to 1228
    tokens, GLM-5.3-Flash's 288 x top-8 to 864), persistent programs past it, on 32-token
    tiles to 32 pairs per expert for experts under 8 MiB (Qwen4-Exp to 1638 tokens) and to
    26 for larger ones (GLM-5.3-Flash to 936 tokens, DeepSeek-V3's shape to 832), and
    64-token ones past that."""
    kernels = gpu_like_interpreter
    assert kernels.LARGE_EXPERT_BYTES == LARGE_EXPERT
    assert kernels.tiles_for(tokens, top_k, experts, expert_bytes) is getattr(kernels, expected)


def test_int64_ids_and_an_empty_call(
    gpu_like_interpreter: ModuleType,
    references: dict[tuple[float | None, bool], MegaMoEExperts],
    calls: dict[float | None, Any],
) -> None:
    """The dispatch buffer's int64 ids give the int32 ids' bits (each dtype its own compiled
    variant on the GPU), in the scan and the grouped launches; no tokens, an empty output."""
    experts = kernel_weights(gpu_like_interpreter, references[(10.0, True)])
    call = calls[10.0]
    for tokens in (3, 24):
        x, weights, ids = routing(tokens, seed=23)
        assert_bitwise_equal(
            call.forward(experts, x, None, weights, ids.long()),
            call.forward(experts, x, None, weights, ids),
            f"{tokens} tokens: int64 ids vs int32",
        )
    empty = call.forward(experts, x[:0], None, weights[:0], ids[:0])
    assert empty.shape == (0, HIDDEN) and empty.dtype == torch.bfloat16


def test_bad_shapes_and_weights_are_refused_by_name(
    gpu_like_interpreter: ModuleType,
    references: dict[tuple[float | None, bool], MegaMoEExperts],
    calls: dict[float | None, Any],
) -> None:
    kernels = gpu_like_interpreter
    with pytest.raises(ValueError, match="hidden 200 and intermediate 256 must be multiples"):
        kernels.SmallBatchExperts(
            num_experts=EXPERTS, first_expert=0, top_k=TOP_K, hidden=200, intermediate=INTER,
            swiglu_limit=None, max_tokens=8, device=torch.device("cpu"),
        )  # fmt: skip
    with pytest.raises(ValueError, match="max_tokens 3000000; at most 32768 and 1048576"):
        kernels.SmallBatchExperts(
            num_experts=EXPERTS, first_expert=0, top_k=TOP_K, hidden=HIDDEN, intermediate=INTER,
            swiglu_limit=None, max_tokens=3_000_000, device=torch.device("cpu"),
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"Tiles: block_m=8; at least 16 \(the least rows"):
        kernels.Tiles(
            block_m=8, block_n2=64, warps=4, stages=2, l2_step=1, pdl=False, persistent=True,
            spread=True,
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"token_rows with block_m=32; .* in 64s: use a block_m"):
        variant(kernels, "BATCH_TILES", token_rows=True)
    with pytest.raises(ValueError, match=r"max_registers=300; 0 \(the compiler's choice\) or 24"):
        variant(kernels, "WIDE_TILES", max_registers=300)
    w13 = kernel_weights(kernels, references[(None, True)]).w13
    with pytest.raises(ValueError, match="small-batch experts: w13 "):
        kernels.ExpertWeights(w13.transpose(1, 2), None, w13, None)  # type: ignore[arg-type]
    x, weights, ids = routing(MAX_TOKENS + 1, seed=1)
    experts = kernel_weights(kernels, references[(None, True)])
    with pytest.raises(ValueError, match=f"{MAX_TOKENS + 1} tokens exceed the {MAX_TOKENS}"):
        calls[None].forward(experts, x, None, weights, ids)


@pytest.mark.parametrize(
    ("layer", "tokens"),
    [(LayerWork(512, 512, 10, 2048, 512), 256), (LayerWork(512, 512, 10, 2048, 512), 2048),
     (LayerWork(288, 288, 8, 4096, 2048), 2048)],
    ids=["qwen4exp-256", "qwen4exp-2048", "glm53flash-2048"],
)  # fmt: skip
def test_the_scratch_is_what_the_layer_work_predicts(
    gpu_like_interpreter: ModuleType, layer: LayerWork, tokens: int
) -> None:
    """``megamoe inspect`` and the docs state the scratch from ``LayerWork`` alone: the
    allocation holds those activations and under 1% more (its index tables)."""
    small = gpu_like_interpreter.SmallBatchExperts(
        num_experts=layer.num_local_experts, first_expert=0, top_k=layer.top_k,
        hidden=layer.hidden, intermediate=layer.intermediate, swiglu_limit=None,
        max_tokens=tokens, device=torch.device("cpu"),
    )  # fmt: skip
    activations = layer.scratch_bytes_per_token * tokens
    assert activations <= small.scratch_bytes <= 1.01 * activations
