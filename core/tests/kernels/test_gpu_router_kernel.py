"""The one-launch router kernel (``megamoe.core.kernels.router_triton``) on a CUDA device.

Oracles are written here from the rules, in float64 where the rule is arithmetic:

- logits: ``x @ W^T`` in float64 from the same bf16 input and (bf16 or float32) weight;
  the kernel sums in float32 in its own order, so it may differ by float32 rounding of a
  sum of H products: ``LOGIT_TOL`` relative to each row's largest |logit|-scale term;
- selection on the kernel's own logits (so a near-tie the GEMM's rounding moves cannot
  flip the comparison): ids exactly, weights within ``WEIGHT_TOL`` of float64.

Also: token counts that leave partial blocks or change the tiling (1, 15, 16, 17, 64,
255, 300, 1024; from ``matmul_tokens`` the logits are torch's GEMM's bits, or with a
float32 weight's bf16 parts the sums of one bf16 GEMM's three products), calls under 16
tokens against whole blocks, E not a multiple of the expert tile, a float32 weight's
parts given to the kernel against split in its registers (the same bits), repeated calls
(the tickets come back to zero), direct launches equal to the JIT's and keyed per router,
CUDA-graph replay and ``torch.compile(fullgraph=True)`` equal to eager, and no host sync
in a call.
"""

from __future__ import annotations

import pytest
import torch
from bitcheck import assert_bitwise_equal
from gpu_marks import COMPILED_GPU_MARKS
from sync_check import assert_no_host_sync

pytestmark = COMPILED_GPU_MARKS

LOGIT_TOL = 1e-5  # |kernel - float64| / sum_h |x_h w_h|, float32 sums of H products
WEIGHT_TOL = 2e-6  # absolute, weights in [0, 1] (x routed_scaling_factor): a few float32 ulp
TOKENS = (1, 15, 16, 17, 64, 255, 300, 1024)
HIDDEN = 1024
# name: (score, E, top_k, norm, weight dtype)
ROUTERS = {
    "qwen-softmax-norm": ("softmax", 64, 8, True, torch.bfloat16),
    "softmax-no-norm-E72": ("softmax", 72, 6, False, torch.bfloat16),
    "qwen4exp-E512": ("softmax", 512, 10, True, torch.bfloat16),
    "glm-sigmoid-E288": ("sigmoid", 288, 8, True, torch.float32),
    "sigmoid-no-norm-E64": ("sigmoid", 64, 4, False, torch.float32),
}
SCALE = 2.5  # routed_scaling_factor of the sigmoid routers


@pytest.fixture(scope="module")
def kernels():
    from megamoe.core.kernels import one_launch_router, router_triton

    return one_launch_router, router_triton


def _router(kernels, name: str, max_tokens: int = 1024):
    one_launch_router, _ = kernels
    score, experts, top_k, norm, dtype = ROUTERS[name]
    extra = {"routed_scaling_factor": SCALE} if score == "sigmoid" else {}
    router, tickets = one_launch_router(
        score, max_tokens, "cuda", num_experts=experts, top_k=top_k, norm_topk_prob=norm, **extra
    )
    gen = torch.Generator().manual_seed(experts)
    weight = (torch.randn(experts, HIDDEN, generator=gen) * 0.05).to(dtype).cuda()
    bias = (torch.randn(experts, generator=gen) * 0.05).cuda() if score == "sigmoid" else None
    return router, tickets, weight, bias


def _oracle(name: str, logits: torch.Tensor, bias: torch.Tensor | None):
    """Ids and float64 weights from the rule, on the given float32 logits."""
    score, _, top_k, norm, _ = ROUTERS[name]
    lg = logits.double()
    if score == "softmax":
        ids = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :top_k]
        chosen = lg.gather(1, ids)
        top = lg.max(dim=-1, keepdim=True).values
        exps = torch.exp(chosen - top)
        total = exps.sum(-1, keepdim=True) if norm else torch.exp(lg - top).sum(-1, keepdim=True)
        return ids, exps / total
    scores = torch.sigmoid(logits)  # torch's float32 sigmoid: the kernel matches its bits
    ids = torch.sort(scores + bias, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = scores.gather(1, ids).double()
    if norm:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return ids, weights * SCALE


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("name", list(ROUTERS))
def test_logits_and_selection_follow_the_rule(kernels, name: str, tokens: int) -> None:
    router, tickets, weight, bias = _router(kernels, name)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens)).bfloat16()
    x = x.cuda()
    weights, ids, logits = router.route(x, weight, tickets, bias)
    exact = x.double() @ weight.double().t()
    scale = x.double().abs() @ weight.double().abs().t()
    err = float(((logits.double() - exact).abs() / scale).max())
    print(f"{name}, {tokens} tokens: logits vs float64 {err:.2e}")
    assert err <= LOGIT_TOL
    want_ids, want_w = _oracle(name, logits, bias)
    assert_bitwise_equal(ids, want_ids.to(torch.int32), f"{name} ids")
    torch.testing.assert_close(weights.double(), want_w, rtol=0, atol=WEIGHT_TOL)
    assert int(tickets.count_nonzero()) == 0, "a call left a ticket set"


@pytest.mark.parametrize("name", ["qwen4exp-E512", "glm-sigmoid-E288"])
def test_selection_alone_equals_the_fused_call(kernels, name: str) -> None:
    router, tickets, weight, bias = _router(kernels, name)
    x = torch.randn(300, HIDDEN, device="cuda").bfloat16()
    weights, ids, logits = router.route(x, weight, tickets, bias)
    alone_w, alone_ids = router.select(logits, bias)
    assert_bitwise_equal(alone_ids, ids, "ids")
    assert_bitwise_equal(alone_w, weights, "weights")


@pytest.mark.parametrize("name", ["qwen4exp-E512", "glm-sigmoid-E288"])
def test_small_calls_choose_as_whole_blocks_do(kernels, name: str) -> None:
    """Under 16 tokens the selection runs a few rows at a time and the hidden size is split
    more finely than for 32 tokens: the logits agree within float32 summation, the ids
    exactly, the weights within a few ulp; and the selection of given logits is the
    same bits in both tilings."""
    router, tickets, weight, bias = _router(kernels, name)
    x = torch.randn(32, HIDDEN, device="cuda").bfloat16()
    weights, ids, logits = router.route(x, weight, tickets, bias)
    few_w, few_ids, few_logits = router.route(x[:7], weight, tickets, bias)
    scale = x[:7].double().abs() @ weight.double().abs().t()
    assert float(((few_logits.double() - logits[:7].double()).abs() / scale).max()) <= LOGIT_TOL
    assert_bitwise_equal(few_ids, ids[:7], "ids")
    torch.testing.assert_close(few_w, weights[:7], rtol=0, atol=WEIGHT_TOL)
    alone_w, alone_ids = router.select(logits[:7].contiguous(), bias)
    whole_w, whole_ids = router.select(logits, bias)
    assert_bitwise_equal(alone_ids, whole_ids[:7], "ids of given logits")
    torch.testing.assert_close(alone_w, whole_w[:7], rtol=0, atol=WEIGHT_TOL)


@pytest.mark.parametrize("tokens", [1, 4, 17, 63])
def test_given_weight_parts_equal_the_registers_split(kernels, tokens: int) -> None:
    """Below ``matmul_tokens`` (64 for E=288) the kernel reads a float32 weight's bf16 parts
    when given them, instead of splitting each weight tile in registers: the same three
    products in the same order, so the same bits (one block's last tile selecting alone at
    1 and 4 tokens, a block's waiting tiles from 17)."""
    from megamoe.core.numerics.router_logits import weight_planes

    router, tickets, weight, bias = _router(kernels, "glm-sigmoid-E288")
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens)).bfloat16()
    x = x.cuda()
    split = router.route(x, weight, tickets, bias)
    given = router.route(x, weight, tickets, bias, weight_planes(weight))
    for a, b, what in zip(split, given, ("weights", "ids", "logits"), strict=True):
        assert_bitwise_equal(b, a, f"{what}, {tokens} tokens")


def test_repeated_calls_and_zero_tokens(kernels) -> None:
    router, tickets, weight, bias = _router(kernels, "glm-sigmoid-E288")
    x = torch.randn(77, HIDDEN, device="cuda").bfloat16()
    first = router.route(x, weight, tickets, bias)
    for _ in range(5):
        again = router.route(x, weight, tickets, bias)
        for a, b in zip(first, again, strict=True):
            assert_bitwise_equal(a, b, "a repeated call")
    weights, ids, logits = router.route(x[:0], weight, tickets, bias)
    assert weights.shape == ids.shape == (0, 8) and logits.shape == (0, 288)


def test_more_tokens_than_the_tickets_serve_is_refused(kernels) -> None:
    router, tickets, weight, bias = _router(kernels, "qwen-softmax-norm", max_tokens=32)
    router.route(torch.randn(32, HIDDEN, device="cuda").bfloat16(), weight, tickets, bias)
    with pytest.raises(ValueError, match=r"33 tokens exceed the 32 .*larger max_num_tokens"):
        router.route(torch.randn(33, HIDDEN, device="cuda").bfloat16(), weight, tickets, bias)


def test_other_dtypes_are_refused_by_name(kernels) -> None:
    router, tickets, weight, bias = _router(kernels, "qwen-softmax-norm")
    x = torch.randn(4, HIDDEN, device="cuda")
    with pytest.raises(ValueError, match=r"activations are torch.float32 .*expected bf16"):
        router.route(x, weight, tickets, bias)
    with pytest.raises(ValueError, match=r"the weight torch.float16; expected"):
        router.route(x.bfloat16(), weight.half(), tickets, bias)


def test_uncovered_router_has_no_kernel(kernels) -> None:
    one_launch_router, router_triton = kernels
    assert one_launch_router("softmax", 64, "cuda", num_experts=640, top_k=8,
                             norm_topk_prob=True) == (None, None)  # fmt: skip
    with pytest.raises(ValueError, match=r"E=640, top_k=8, n_group=1 exceed the kernel's E <= 512"):
        router_triton.TritonRouter(router_triton.SCORE_SOFTMAX, 640, 8, True)


def test_cuda_graph_replay_and_compile_equal_eager(kernels) -> None:
    router, tickets, weight, bias = _router(kernels, "glm-sigmoid-E288")
    static_x = torch.randn(128, HIDDEN, device="cuda").bfloat16()
    router.route(static_x, weight, tickets, bias)  # compile the kernel before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = router.route(static_x, weight, tickets, bias)
    for seed in (1, 2):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        static_x.copy_(torch.randn(static_x.shape, device="cuda", generator=gen))
        graph.replay()
        eager = router.route(static_x, weight, tickets, bias)
        for a, b in zip(static, eager, strict=True):
            assert_bitwise_equal(a, b, f"replay, seed {seed}")

    def call(x: torch.Tensor):
        return router.route(x, weight, tickets, bias)

    torch._dynamo.reset()
    compiled = torch.compile(call, fullgraph=True)  # a graph break raises
    for tokens in (1, 16, 300):
        x = torch.randn(tokens, HIDDEN, device="cuda").bfloat16()
        for a, b in zip(compiled(x), call(x), strict=True):
            assert_bitwise_equal(a, b, f"compiled, {tokens} tokens")


@pytest.mark.parametrize("tokens", [1, 40, 300])
def test_direct_launches_equal_the_jits(kernels, tokens: int) -> None:
    """After a variant's first call the kernel is launched without Triton's JIT
    (``kernels.launch.KernelLaunch``); with a launch hook installed (as profilers do) every
    call goes through the JIT: the same bits, and the hook sees it."""
    from triton import knobs

    router, tickets, weight, bias = _router(kernels, "glm-sigmoid-E288")
    x = torch.randn(tokens, HIDDEN, device="cuda").bfloat16()
    router.route(x, weight, tickets, bias)  # the JIT's launch, compiling the variant
    direct = router.route(x, weight, tickets, bias)
    seen: list[object] = []
    installed = knobs.runtime.launch_enter_hook
    knobs.runtime.launch_enter_hook = seen.append
    try:
        jit = router.route(x, weight, tickets, bias)
    finally:
        knobs.runtime.launch_enter_hook = installed
    assert seen, "with a launch hook the call did not go through Triton's JIT"
    for a, b in zip(direct, jit, strict=True):
        assert_bitwise_equal(a, b, f"direct launch, {tokens} tokens")


def test_routers_of_other_settings_keep_their_own_kernels(kernels) -> None:
    """Direct launches are keyed by every constant: calls of two routers of one hidden size
    and token count, interleaved, each give what that router gives alone."""
    names = ("qwen-softmax-norm", "sigmoid-no-norm-E64")
    routers = [_router(kernels, name) for name in names]
    x = torch.randn(9, HIDDEN, device="cuda").bfloat16()
    alone = [router.route(x, weight, tickets, bias) for router, tickets, weight, bias in routers]
    for _ in range(2):
        for (router, tickets, weight, bias), first, name in zip(routers, alone, names, strict=True):
            for a, b in zip(router.route(x, weight, tickets, bias), first, strict=True):
                assert_bitwise_equal(a, b, f"{name} after the other router")


@pytest.mark.parametrize("name", ["qwen4exp-E512", "glm-sigmoid-E288", "qwen-softmax-norm"])
def test_large_calls_take_torchs_gemm_for_the_logits(kernels, name: str) -> None:
    """From ``eager_matmul_tokens`` on (64 for routers of 256 experts or more, else 1025),
    an eager call's logits are torch's GEMM's bits (bf16 weight: a float32 output; float32
    weight: widened activations) and the selection is the kernel's."""
    router, tickets, weight, bias = _router(kernels, name, max_tokens=1100)
    large = weight.shape[0] >= 256
    assert router.matmul_tokens == (64 if large else 256)
    assert router.eager_matmul_tokens == (64 if large else 1025)
    x = torch.randn(router.eager_matmul_tokens, HIDDEN, device="cuda").bfloat16()
    weights, ids, logits = router.route(x, weight, tickets, bias)
    if weight.dtype == torch.bfloat16:
        want = torch.mm(x, weight.t(), out_dtype=torch.float32)
    else:
        want = torch.mm(x.float(), weight.t())
    assert_bitwise_equal(logits, want, "logits")
    alone_w, alone_ids = router.select(want, bias)
    assert_bitwise_equal(ids, alone_ids, "ids")
    assert_bitwise_equal(weights, alone_w, "weights")


@pytest.mark.parametrize("tokens", [256, 300, 1024])
def test_large_calls_with_weight_planes_add_three_bf16_products(kernels, tokens: int) -> None:
    """Given a float32 weight's bf16 parts, the logits are one bf16 GEMM's (T, 3E) products
    added in order (hi, mid, lo) bit for bit, within ``LOGIT_TOL`` of float64, and the
    selection is the kernel's on them."""
    from megamoe.core.numerics.router_logits import weight_planes

    router, tickets, weight, bias = _router(kernels, "glm-sigmoid-E288")
    planes = weight_planes(weight)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens)).bfloat16()
    x = x.cuda()
    weights, ids, logits = router.route(x, weight, tickets, bias, planes)
    stacked = torch.mm(x, planes.t(), out_dtype=torch.float32)
    e = weight.shape[0]
    want = stacked[:, :e] + stacked[:, e : 2 * e] + stacked[:, 2 * e :]
    assert_bitwise_equal(logits, want, "logits")
    exact = x.double() @ weight.double().t()
    scale = x.double().abs() @ weight.double().abs().t()
    err = float(((logits.double() - exact).abs() / scale).max())
    print(f"{tokens} tokens, weight planes: logits vs float64 {err:.2e}")
    assert err <= LOGIT_TOL
    alone_w, alone_ids = router.select(want, bias)
    assert_bitwise_equal(ids, alone_ids, "ids")
    assert_bitwise_equal(weights, alone_w, "weights")
    with pytest.raises(ValueError, match=r"weight planes \(864, 1024\); expected \(864, 512\)"):
        router.route(x[:, :512].contiguous(), weight[:, :512].contiguous(), tickets, bias, planes)


def _captured(call):
    """``call()``'s outputs from one replay of a CUDA graph of it, warmed up eagerly only
    (as engines warm up before they capture: a variant the capture takes first is compiled
    inside it)."""
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = call()
    graph.replay()
    return outputs


@pytest.mark.parametrize("tokens", [256, 1024])
@pytest.mark.parametrize("name", ["qwen-softmax-norm", "sigmoid-no-norm-E64"])
def test_eager_calls_keep_one_launch_where_graphs_take_cublas(
    kernels, monkeypatch, name: str, tokens: int
) -> None:
    """Under 256 experts, from ``matmul_tokens`` to 1024 tokens: an eager call is the one
    launch (its logits land in the scratch, within ``LOGIT_TOL`` of float64, and its
    selection is the kernel's on them); the same call in a CUDA-graph capture takes
    cuBLAS's logits (torch's GEMM's bits) and selects on them. The two routings differ
    only where the eager logits tie at the top-k cut to float32 summation."""
    from megamoe.core.kernels import router_scratch

    router, tickets, weight, bias = _router(kernels, name)
    assert router.matmul_tokens <= tokens < router.eager_matmul_tokens
    scratch = router_scratch(router, 1024, HIDDEN, "cuda")
    gen = torch.Generator().manual_seed(tokens + 7)
    x = torch.randn(tokens, HIDDEN, generator=gen).bfloat16().cuda()

    def call():
        return router.route(x, weight, tickets, bias, scratch=scratch)

    graphed = [t.clone() for t in _captured(call)]
    gemms = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda *a, **k: gemms.append(a) or real_mm(*a, **k))
    eager = call()
    monkeypatch.undo()
    # One launch: no torch GEMM (a bf16 weight's cuBLAS logits would land in the scratch
    # too), and the logits in the scratch (a float32 weight's would be fresh).
    assert not gemms and eager[2].data_ptr() == scratch.data_ptr(), "eager took cuBLAS"
    if weight.dtype == torch.bfloat16:
        cublas = torch.mm(x, weight.t(), out_dtype=torch.float32)
    else:
        cublas = torch.mm(x.float(), weight.t())
    assert_bitwise_equal(graphed[2], cublas, "graphed logits")
    for what, (weights, ids, logits) in (("eager", eager), ("graphed", graphed)):
        alone_w, alone_ids = router.select(logits.contiguous(), bias)
        assert_bitwise_equal(ids, alone_ids, f"{what} ids")
        assert_bitwise_equal(weights, alone_w, f"{what} weights")
    scale = x.double().abs() @ weight.double().abs().t()
    exact = x.double() @ weight.double().t()
    assert float(((eager[2].double() - exact).abs() / scale).max()) <= LOGIT_TOL
    # Rows routed differently: their eager keys at the cut are within both paths' error.
    keys = eager[2].double()
    if bias is not None:
        keys = torch.sigmoid(eager[2]).double() + bias.double()
    differ = (eager[1].sort(1).values != graphed[1].sort(1).values).any(1)
    top = keys.sort(1, descending=True).values
    k = router.top_k
    gap = (top[:, k - 1] - top[:, k]).abs()
    tol = 2 * LOGIT_TOL * scale.max(1).values
    print(f"{name}, {tokens} tokens: {int(differ.sum())} rows routed differently eager/graphed")
    assert bool((gap[differ] <= tol[differ]).all()), "rows differ away from a tie"


def test_a_call_makes_no_host_sync(kernels) -> None:
    router, tickets, weight, bias = _router(kernels, "qwen4exp-E512")
    x = torch.randn(64, HIDDEN, device="cuda").bfloat16()
    assert_no_host_sync(lambda: router.route(x, weight, tickets, bias))


@pytest.mark.parametrize("name", list(ROUTERS))
def test_a_scratch_gives_the_fresh_tensors_bits(kernels, name: str) -> None:
    """With a ``scratch`` the one launch writes its logits and partial sums there instead of
    fresh tensors: the same weights, ids and logits bit for bit at every tiling (few tokens:
    many hidden-size splits; a partial block; the larger tiles; from ``matmul_tokens``,
    where the scratch is not used), the logits a view of it, whose size
    (``scratch_floats``) covers every call size the one launch serves (eagerly up to
    1024 tokens under 256 experts)."""
    from megamoe.core.kernels import router_scratch
    from megamoe.core.kernels.router_triton import (
        WEIGHT_BF16,
        WEIGHT_FP32,
        WEIGHT_PLANES,
        _scratch_end,
    )

    router, tickets, weight, bias = _router(kernels, name)
    scratch = router_scratch(router, 1024, HIDDEN, "cuda")
    assert scratch is not None
    for tokens in range(1, min(router.eager_matmul_tokens, 1025)):
        for kind in (WEIGHT_BF16, WEIGHT_FP32, WEIGHT_PLANES):
            splits = router._plan(tokens, HIDDEN, kind, 0, False).splits
            assert _scratch_end(tokens * weight.shape[0], splits) <= scratch.numel(), tokens
    for tokens in (1, 7, 17, 64, 200, router.matmul_tokens, 300, 1024):
        x = torch.randn(tokens, HIDDEN, device="cuda").bfloat16()
        fresh = router.route(x, weight, tickets, bias)
        scratch.fill_(float("nan"))  # nothing of an earlier call may leak into this one
        kept = router.route(x, weight, tickets, bias, scratch=scratch)
        for field, a, b in zip(("weights", "ids", "logits"), kept, fresh, strict=True):
            assert_bitwise_equal(a, b, f"{name}, {tokens} tokens, {field} with a scratch")
        if tokens < router.eager_matmul_tokens:
            assert kept[2].data_ptr() == scratch.data_ptr(), "the logits are not the scratch's"


def test_a_scratch_too_small_is_refused(kernels) -> None:
    router, tickets, weight, bias = _router(kernels, "glm-sigmoid-E288")
    x = torch.randn(1, HIDDEN, device="cuda").bfloat16()
    small = torch.empty(288, device="cuda")  # the logits fit; the partial sums do not
    with pytest.raises(ValueError, match=r"scratch of 288 torch.float32 entries; a call of 1"):
        router.route(x, weight, tickets, bias, scratch=small)


@pytest.mark.parametrize("name", ["qwen-softmax-norm", "glm-sigmoid-E288"])
def test_kept_scratch_views_follow_each_call(kernels, monkeypatch, name: str) -> None:
    """An eager call keeps its scratch views per call size (``TritonRouter._keep_views``):
    calls of sizes coming back in any order give the fresh tensors' bits and logits of
    their own shape in the scratch; a full cache starts over and stays right; a new scratch
    replaces the old one's views."""
    from megamoe.core.kernels import router_scratch, router_triton

    router, tickets, weight, bias = _router(kernels, name)
    scratch = router_scratch(router, 1024, HIDDEN, "cuda")
    monkeypatch.setattr(router_triton, "KEPT_VIEWS", 3)
    sizes = [1, 17, 1, 40, 17, 5, 1, 40]
    for tokens in sizes:
        x = torch.randn(tokens, HIDDEN, device="cuda").bfloat16()
        fresh = router.route(x, weight, tickets, bias)
        kept = router.route(x, weight, tickets, bias, scratch=scratch)
        for field, a, b in zip(("weights", "ids", "logits"), kept, fresh, strict=True):
            assert_bitwise_equal(a, b, f"{name}, {tokens} tokens, {field} with kept views")
        assert kept[2].shape == (tokens, weight.shape[0])
        assert kept[2].data_ptr() == scratch.data_ptr()
        assert len(router._views[torch.Tensor][1]) <= 3
    other = router_scratch(router, 1024, HIDDEN, "cuda")  # the module moved: a new scratch
    x = torch.randn(17, HIDDEN, device="cuda").bfloat16()
    kept = router.route(x, weight, tickets, bias, scratch=other)
    assert kept[2].data_ptr() == other.data_ptr(), "views of the old scratch handed out"
    assert router._views[torch.Tensor][0] is other, "the old scratch is still kept alive"


@pytest.mark.parametrize("name", ["qwen4exp-E512", "glm-sigmoid-E288"])
def test_a_cublas_call_writes_into_the_scratch_where_it_fits(kernels, name: str) -> None:
    """From ``matmul_tokens`` a call with a scratch writes cuBLAS's products and the logits
    there where they fit (``TritonRouter._matmul_workspace``; a float32 weight with its bf16
    parts: the (T, E) logits, then the (T, 3E) products) and takes fresh tensors past that:
    either way the weights, ids and logits are the fresh call's bits."""
    from megamoe.core.kernels import router_scratch
    from megamoe.core.numerics.router_logits import weight_planes

    router, tickets, weight, bias = _router(kernels, name)
    planes = weight_planes(weight) if weight.dtype == torch.float32 else None
    scratch = router_scratch(router, 1024, HIDDEN, "cuda")
    experts = weight.shape[0]
    per_token = experts * (1 if planes is None else 4)  # products, then logits with parts
    fitting = scratch.numel() // per_token
    assert fitting >= router.matmul_tokens + 8, "the test's scratch fits no cuBLAS call"
    for tokens in (router.matmul_tokens, fitting - 4, fitting + 4, 1024):
        x = torch.randn(tokens, HIDDEN, device="cuda").bfloat16()
        fresh = router.route(x, weight, tickets, bias, planes)
        scratch.fill_(float("nan"))
        kept = router.route(x, weight, tickets, bias, planes, scratch=scratch)
        for field, a, b in zip(("weights", "ids", "logits"), kept, fresh, strict=True):
            assert_bitwise_equal(a, b, f"{name}, {tokens} tokens, {field} with a scratch")
        inside = scratch.data_ptr() <= kept[2].data_ptr() < scratch.data_ptr() + scratch.nbytes
        assert inside == (tokens < fitting), f"{name}, {tokens} tokens: logits in the scratch"
