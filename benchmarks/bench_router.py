"""The GLM router on a GPU: the torch path, the Triton path and the bare logits matmul.

For each router shape and token count, CUDA-event medians after warm-up, eager (host
launch time included, as an engine's eager prefill sees it):

- ``matmul``: the float32 logits ``x.float() @ W^T`` alone (both paths start with it);
- ``torch``: the whole router on the torch path (``route_logits(..., use_triton=False)``);
- ``triton``: the whole router as the block calls it (``Glm5NextRouter.forward``: the
  matmul, then the Triton kernel);
- ``kernel``: the Triton selection alone, on given logits;
- ``graphed``: a CUDA graph of ``triton``, replayed (no host time), beside a graph of
  the matmul alone (``mm graphed``): the GPU time of the router and of its GEMM.

The issue's target is ``triton`` <= 30 us from 1 to 1024 tokens. Shapes: GLM-5.3-Flash
(E=288, top-8, no group limit, H=4096) and DeepSeek-V3 (E=256, top-8, 4 of 8 groups,
H=7168).

    python3 benchmarks/bench_router.py
    python3 benchmarks/bench_router.py --tokens 1,1024 --routers glm5.3-flash --json r.json
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

import torch

from harness import cuda_graph_replay, cuda_median_ms, format_table, write_json
from megamoe.glm5next.config import Glm5NextConfig
from megamoe.glm5next.router import Glm5NextRouter, route_logits, router_logits

# name: (E, top_k, n_group, topk_group, hidden)
ROUTERS = {
    "glm5.3-flash": (288, 8, 1, 1, 4096),
    "deepseek-v3": (256, 8, 8, 4, 7168),
}
TARGET_US = 30.0
COLUMNS = (
    ("router", "<12", "router"),
    ("tokens", ">6.0f", "tokens"),
    ("matmul", ">7.1f", "matmul_us"),
    ("torch", ">7.1f", "torch_us"),
    ("triton", ">7.1f", "triton_us"),
    ("kernel", ">7.1f", "kernel_us"),
    ("graphed", ">8.1f", "graphed_us"),
    ("mm graphed", ">10.1f", "matmul_graphed_us"),
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


def build(name: str) -> Glm5NextRouter:
    """A router of shape ``name`` on the GPU with random weights and bias."""
    num_experts, top_k, n_group, topk_group, hidden = ROUTERS[name]
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
    gen = torch.Generator(device="cuda").manual_seed(0)
    router = Glm5NextRouter(config, device="cuda")
    with torch.no_grad():
        router.weight.normal_(0.0, 0.02, generator=gen)
        router.e_score_correction_bias.uniform_(0.0, 1e-3, generator=gen)
    return router


def measure(name: str, router: Glm5NextRouter, count: int, args: argparse.Namespace) -> dict:
    """One table row: the router's paths and parts at ``count`` tokens."""
    cfg, route = router.config, router.routing
    gen = torch.Generator(device="cuda").manual_seed(count)
    x = torch.randn(count, cfg.hidden_size, device="cuda", generator=gen).bfloat16()
    weight, bias = router.weight, router.e_score_correction_bias
    logits = router_logits(x, weight)

    def time(fn: Callable[[], object]) -> float:
        return 1e3 * cuda_median_ms(fn, args.warmup, args.iters)

    with torch.no_grad():
        row: dict[str, Any] = {
            "router": name,
            "tokens": float(count),
            "matmul_us": time(lambda: router_logits(x, weight)),
            "torch_us": time(
                lambda: route_logits(router_logits(x, weight), bias, use_triton=False, **route)
            ),
            "triton_us": time(lambda: router(x)),
            "kernel_us": time(lambda: route_logits(logits, bias, use_triton=True, **route)),
            "graphed_us": time(cuda_graph_replay(lambda: router(x))),
            "matmul_graphed_us": time(cuda_graph_replay(lambda: router_logits(x, weight))),
        }
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
    over = [
        f"{r['router']} at {r['tokens']:.0f} tokens ({r['triton_us']:.1f} us)"
        for r in rows
        if r["tokens"] <= 1024 and r["triton_us"] > TARGET_US
    ]
    print(f"target triton <= {TARGET_US:.0f} us up to 1024 tokens: " + ("; ".join(over) or "met"))
    write_json(args.json, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
