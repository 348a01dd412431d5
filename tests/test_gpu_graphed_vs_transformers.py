"""Both blocks captured in a CUDA graph, as an engine runs them, against transformers 5.24.0.

A tiny Qwen4-Exp and GLM-5.3-Flash (GLM clamping SwiGLU at 1.5) written by transformers as
block-FP8 checkpoints at sizes the Hopper kernel runs; each first MoE layer built on the
kernel with its defaults (the shared expert on the auxiliary stream inside graphs, its
GEMMs on half the SMs up to ``gemm_sm_target.SMALL_GEMM_ROWS`` tokens; the router kernel
writing the kernel's inputs). One replay of a graph of ``block(x)`` at 1, 17 and 64 tokens
(and eager calls at 300 and 1024 tokens, where the router stays one launch) against:

- transformers' own MoE module in float64 (``transformers_oracle.reference_moe``): the
  routing the graph's router wrote (the dispatch buffer's ids) is transformers' choice on
  every token whose selection margin keeps it from ties (transformers rounds Qwen's
  logits to bf16, megamoe sums them in float32), and on those tokens the output is within
  ``FLOAT_TOL`` (the kernel's FP8 activations: 0.04-0.07 measured in docs/gpu.md);
- the same block eager (serial schedule): within ``GRAPHED_TOL`` (the graph's shared
  GEMMs and the combine may sum in another order).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from gpu_marks import skip_unless_block_fp8_kernel
from graph_check import replayed_output
from oracle_check import MIN_MARGIN

from megamoe.core.checkpoint.reader import CheckpointReader
from megamoe.core.modules.parallel import ParallelSettings, single_rank_group
from megamoe.glm5next import ADAPTER as GLM5NEXT
from megamoe.qwen4exp import ADAPTER as QWEN4EXP

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

FLOAT_TOL = 0.08  # relative Frobenius error against transformers' float64 module
GRAPHED_TOL = 1e-3  # relative Frobenius error of a replay against the eager forward
TOKEN_COUNTS = (1, 17, 64)
EAGER_TOKEN_COUNTS = (300, 1024)  # where eager routers under 256 experts changed path
SWIGLU_LIMIT = 1.5
ADAPTERS = {"qwen4_exp": QWEN4EXP, "glm5_next": GLM5NEXT}  # from source: no entry points


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double().cpu()
    return float((actual.double().cpu() - expected).norm() / expected.norm())


def _tiny_block(tmp_path: Path, family: str, max_tokens: int):
    """A tiny transformers model of ``family`` saved as block-FP8, and its first MoE layer
    built on the kernel with its defaults: ``(model, layer, block)``."""
    pytest.importorskip("transformers", minversion="5.24.0")
    from transformers_oracle import KERNEL_SIZES, build_tiny_model, save_checkpoint

    skip_unless_block_fp8_kernel()
    limit = {"swiglu_limit": SWIGLU_LIMIT} if family == "glm5_next" else {}
    tiny = build_tiny_model(family, seed=13, **limit, **KERNEL_SIZES[family])
    path = save_checkpoint(tiny, tmp_path / family, fp8_block=True)
    adapter = ADAPTERS[family]
    reader = CheckpointReader(path, adapter)
    layer = reader.layers[0]
    parallel = ParallelSettings(ep_group=single_rank_group("cuda"))
    block = adapter.build_block(
        reader.config, layer, parallel=parallel, device="cuda", max_num_tokens=max_tokens
    )
    block.load_from_checkpoint(reader)
    assert block.experts.backend.name == "deepgemm"
    return tiny, layer, block


def _against_transformers(tiny, layer, block, x: torch.Tensor, out: torch.Tensor) -> str:
    """Check ``out`` = ``block(x)`` (whose router filled the kernel's inputs) against
    transformers' module: the same routing on every token away from ties, the output within
    ``FLOAT_TOL`` there. Returns what was measured, for the log."""
    from transformers_oracle import reference_moe

    dispatch = block.experts.dispatch_buffer(x)
    assert dispatch is not None, "the router kernel did not fill the kernel's inputs"
    count = x.shape[0]
    ids = dispatch.topk_ids[:count].sort(dim=-1).values.cpu()
    oracle = reference_moe(tiny, layer.prefix, x.cpu())
    away = oracle.margin > MIN_MARGIN
    mismatched = int(((ids != oracle.topk_ids).any(dim=-1) & away).sum())
    error = _relative(out[away.cuda()], oracle.output[away]) if bool(away.any()) else 0.0
    assert mismatched == 0
    assert error <= FLOAT_TOL
    return f"{count} tokens ({int(away.sum())} away from ties): vs transformers {error:.4f}"


@pytest.mark.parametrize("family", ["qwen4_exp", "glm5_next"])
def test_a_graphed_block_matches_transformers(tmp_path: Path, family: str) -> None:
    tiny, layer, block = _tiny_block(tmp_path, family, max(TOKEN_COUNTS))
    assert block.aux_stream.stream is not None  # type: ignore[attr-defined]
    hidden = block.experts.hidden_size
    for count in TOKEN_COUNTS:
        gen = torch.Generator().manual_seed(count)
        x = torch.randn(count, hidden, generator=gen).bfloat16().cuda()
        with torch.no_grad():
            eager = block(x)
            graphed = replayed_output(partial(block, x))
        measured = _against_transformers(tiny, layer, block, x, graphed)
        vs_eager = _relative(graphed, eager)
        print(f"[graphed {family}] {measured}, vs eager {vs_eager:.2e}")
        assert vs_eager <= GRAPHED_TOL


@pytest.mark.parametrize("family", ["qwen4_exp", "glm5_next"])
def test_an_eager_block_past_256_tokens_matches_transformers(tmp_path: Path, family: str) -> None:
    """Eagerly a router under 256 experts stays one launch up to 1024 tokens (graphs take
    cuBLAS's logits from 256): its routing and the block's output against transformers. The
    experts take the small-batch path at both counts (the tiny layer's crossover lies past
    65536 tokens on an H200 and an H100), on its batch tiles at 1024 (persistent programs,
    the grouping spread)."""
    tiny, layer, block = _tiny_block(tmp_path, family, max(EAGER_TOKEN_COUNTS))
    for count in EAGER_TOKEN_COUNTS:
        assert block.experts.backend.path_for(block.experts, count) == "small_batch"
    router = getattr(block, "router_kernel", None) or block.gate.kernel  # type: ignore[attr-defined]
    assert router.matmul_tokens <= min(EAGER_TOKEN_COUNTS)
    assert max(EAGER_TOKEN_COUNTS) < router.eager_matmul_tokens
    for count in EAGER_TOKEN_COUNTS:
        gen = torch.Generator().manual_seed(count)
        x = torch.randn(count, block.experts.hidden_size, generator=gen).bfloat16().cuda()
        with torch.no_grad():
            out = block(x)
        print(f"[eager {family}] {_against_transformers(tiny, layer, block, x, out)}")
