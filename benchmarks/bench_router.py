"""The routers on a GPU: the torch path, the one-launch Triton router and the bare matmul.

For each router shape and token count, CUDA-event medians after warm-up, eager (host
launch time included, as an engine's eager prefill sees it):

- ``one op``: a one-element ``add_``, timed the same way: the floor of any eager launch
  on this machine;
- ``matmul``: the float32 logits alone (the torch path starts with it: GLM's
  ``x.float() @ W^T`` on its float32 weight, Qwen's bf16 ``torch.mm(out_dtype=float32)``);
- ``torch``: the whole router on the torch path;
- ``triton``: the whole router as the blocks build it on CUDA
  (``megamoe.core.kernels.router_triton``, with its scratch; without the kernel's
  dispatch buffer, so the routing comes back in fresh tensors): under
  ``eager_matmul_tokens`` (64 for E >= 256, else 1025) one launch computing the logits
  and the selection, from there cuBLAS's logits and the selection's launch;
- ``dispatch``: ``triton`` as the DeepGEMM blocks call it, with the experts' dispatch
  buffer: the launch also writes the kernel's FP8 activations, scales and routing there
  (replacing DeepGEMM's pre-dispatch launch) and allocates nothing;
- ``kernel``: the Triton selection alone, on given logits;
- ``graphed``: a CUDA graph of ``triton``, replayed (no host time), beside graphs of the
  matmul alone (``mm graphed``) and of the torch path (``torch graphed``): GPU time;
- ``fp32 graphed`` (float32 weights): ``graphed`` without the weight's bf16 parts, the
  large calls' float32 GEMM of widened activations that they replace.

The issue's target is the router <= 30 us from 1 to 1024 tokens (checked on ``triton``
and on ``dispatch``). Shapes: GLM-5.3-Flash (sigmoid, E=288, top-8, no group limit,
H=4096), DeepSeek-V3 (sigmoid, E=256, top-8, 4 of 8 groups, H=7168), Qwen4-Exp (softmax,
E=512, top-10, H=2048) and ``bench_block.py``'s Qwen4Exp and GLM routers (E=64, top-8,
H=4096; GLM's weight float32). Under 256 experts an eager call keeps the one launch up to
1024 tokens while ``graphed`` takes cuBLAS's logits from 256
(``router_triton.EAGER_MATMUL_TOKENS``).

    python3 benchmarks/bench_router.py
    python3 benchmarks/bench_router.py --tokens 1,1024 --routers glm5.3-flash --json r.json
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from harness import cuda_graph_replay, cuda_median_ms, format_table, write_json
from megamoe.core.kernels import one_launch_router, router_scratch
from megamoe.core.numerics.dispatch import DISPATCH_GROUP, DispatchBuffer
from megamoe.core.numerics.router_logits import router_logits
from megamoe.glm5next.config import Glm5NextConfig
from megamoe.glm5next.router import Glm5NextRouter, route_logits
from megamoe.qwen4exp.block import softmax_topk

# name: (scoring, E, top_k, n_group, topk_group, hidden)
ROUTERS = {
    "glm5.3-flash": ("sigmoid", 288, 8, 1, 1, 4096),
    "deepseek-v3": ("sigmoid", 256, 8, 8, 4, 7168),
    "qwen4-exp": ("softmax", 512, 10, 1, 1, 2048),
    "bench-block": ("softmax", 64, 8, 1, 1, 4096),  # bench_block.py's Qwen4Exp router
    "bench-block-glm": ("sigmoid", 64, 8, 1, 1, 4096),  # and its GLM one (float32 weight)
}
TARGET_US = 30.0
MAX_TOKENS = 4096  # the routers' tickets and scratch, as a block of max_num_tokens=4096
COLUMNS = (
    ("router", "<12", "router"),
    ("tokens", ">6.0f", "tokens"),
    ("one op", ">7.1f", "one_op_us"),
    ("matmul", ">7.1f", "matmul_us"),
    ("torch", ">7.1f", "torch_us"),
    ("triton", ">7.1f", "triton_us"),
    ("dispatch", ">8.1f", "dispatch_us"),
    ("kernel", ">7.1f", "kernel_us"),
    ("graphed", ">8.1f", "graphed_us"),
    ("mm graphed", ">10.1f", "matmul_graphed_us"),
    ("torch graphed", ">13.1f", "torch_graphed_us"),
    ("fp32 graphed", ">12.1f", "fp32_graphed_us"),
    ("torch/triton", ">12.1f", "speedup"),
)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="1,16,128,1024,4096")
    p.add_argument("--routers", default=",".join(ROUTERS))
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--json", default="bench_router.json")
    return p.parse_args(argv)


@dataclass
class Router:
    """One router's paths as callables of the hidden states (and of given logits)."""

    hidden: int
    matmul: Callable[[torch.Tensor], torch.Tensor]
    torch_path: Callable[[torch.Tensor], object]
    one_launch: Callable[[torch.Tensor], object]
    dispatched: Callable[[torch.Tensor], object]
    select: Callable[[torch.Tensor], object]
    without_planes: Callable[[torch.Tensor], object] | None = None


def dispatch_buffer(hidden: int, top_k: int) -> DispatchBuffer:
    """A Hopper MegaMoE kernel's input buffer for calls of up to ``MAX_TOKENS`` tokens."""
    rows = MAX_TOKENS
    return DispatchBuffer(
        torch.empty(rows, hidden, dtype=torch.float8_e4m3fn, device="cuda"),
        torch.empty(rows, hidden // DISPATCH_GROUP, device="cuda"),
        torch.empty(rows, top_k, dtype=torch.int64, device="cuda"),
        torch.empty(rows, top_k, device="cuda"),
    )


def build(name: str) -> Router:
    """A router of shape ``name`` on the GPU with random weights (and bias)."""
    score, num_experts, top_k, n_group, topk_group, hidden = ROUTERS[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    if score == "softmax":  # Qwen4-Exp: bf16 weight, renormalized softmax top-k
        weight = torch.empty(num_experts, hidden, device="cuda").normal_(0.0, 0.02, generator=gen)
        weight = weight.bfloat16()
        kernel, tickets = one_launch_router(
            "softmax", MAX_TOKENS, "cuda", num_experts=num_experts, top_k=top_k, norm_topk_prob=True
        )
        assert kernel is not None and tickets is not None
        scratch = router_scratch(kernel, MAX_TOKENS, hidden, "cuda")  # as Qwen4Exp's block keeps it
        dispatch = dispatch_buffer(hidden, top_k)
        return Router(
            hidden,
            lambda x: router_logits(x, weight),
            lambda x: softmax_topk(router_logits(x, weight), top_k, True),
            lambda x: kernel.route(x, weight, tickets, scratch=scratch),
            lambda x: kernel.route(x, weight, tickets, dispatch=dispatch, scratch=scratch),
            kernel.select,
        )
    config = Glm5NextConfig.from_dict(
        {
            "model_type": "glm5_next_text",
            "hidden_size": hidden,
            "n_routed_experts": num_experts,
            "num_experts_per_tok": top_k,
            "n_group": n_group,
            "topk_group": topk_group,
        }
    )
    router = Glm5NextRouter(config, device="cuda", max_num_tokens=MAX_TOKENS)
    with torch.no_grad():
        router.weight.normal_(0.0, 0.02, generator=gen)
        router.e_score_correction_bias.uniform_(0.0, 1e-3, generator=gen)
    route, bias, kernel = router.routing, router.e_score_correction_bias, router.kernel
    assert kernel is not None
    dispatch = dispatch_buffer(hidden, top_k)
    return Router(
        hidden,
        lambda x: router_logits(x, router.weight),
        lambda x: route_logits(router_logits(x, router.weight), bias, use_triton=False, **route),
        router,
        lambda x: router(x, dispatch),
        lambda logits: route_logits(logits, bias, use_triton=True, **route),
        lambda x: kernel.route(x, router.weight, router.tickets, bias),
    )


def measure(name: str, router: Router, count: int, args: argparse.Namespace) -> dict:
    """One table row: the router's paths and parts at ``count`` tokens."""
    gen = torch.Generator(device="cuda").manual_seed(count)
    x = torch.randn(count, router.hidden, device="cuda", generator=gen).bfloat16()
    logits = router.matmul(x)

    def time(fn: Callable[[], object]) -> float:
        return 1e3 * cuda_median_ms(fn, args.warmup, args.iters)

    scratch = torch.zeros(1, device="cuda")
    with torch.no_grad():
        row: dict[str, Any] = {
            "router": name,
            "tokens": float(count),
            "one_op_us": time(lambda: scratch.add_(1.0)),
            "matmul_us": time(lambda: router.matmul(x)),
            "torch_us": time(lambda: router.torch_path(x)),
            "triton_us": time(lambda: router.one_launch(x)),
            "dispatch_us": time(lambda: router.dispatched(x)),
            "kernel_us": time(lambda: router.select(logits)),
            "graphed_us": time(cuda_graph_replay(lambda: router.one_launch(x))),
            "matmul_graphed_us": time(cuda_graph_replay(lambda: router.matmul(x))),
            "torch_graphed_us": time(cuda_graph_replay(lambda: router.torch_path(x))),
        }
        if router.without_planes is not None:
            fp32_path = router.without_planes
            row["fp32_graphed_us"] = time(cuda_graph_replay(lambda: fp32_path(x)))
    row["speedup"] = row["torch_us"] / row["triton_us"]
    return row


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    torch.cuda.set_device(0)
    counts = [int(t) for t in args.tokens.split(",")]
    rows = []
    for name in args.routers.split(","):
        router = build(name)
        rows.extend(measure(name, router, count, args) for count in counts)
    cells = [[r.get(key) for _, _, key in COLUMNS] for r in rows]
    print(format_table([(title, spec) for title, spec, _ in COLUMNS], cells))
    for column in ("triton", "dispatch"):
        over = [
            f"{r['router']} at {r['tokens']:.0f} tokens ({r[column + '_us']:.1f} us)"
            for r in rows
            if r["tokens"] <= 1024 and r[column + "_us"] > TARGET_US
        ]
        verdict = "; ".join(over) or "met"
        print(f"target {column} <= {TARGET_US:.0f} us up to 1024 tokens: {verdict}")
    write_json(args.json, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
