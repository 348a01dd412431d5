"""Qwen4Exp MoE block time with and without the auxiliary stream for the shared expert.

The shared expert (SwiGLU MLP times sigmoid gate) runs on an auxiliary CUDA stream beside
the router and joins before the MegaMoE launch. This measures the whole block both ways,
plus its parts alone (router, shared expert, routed experts), and reports the overlap:
time saved by the aux stream over the most it can save, min(router, shared expert).
Times are medians of CUDA-event timings after warm-up.

    python benchmarks/bench_qwen4exp_block.py                  # E=64, top-8, H=4096, I=1536
    python benchmarks/bench_qwen4exp_block.py --tokens 256 --json out.json

Weights are random block-FP8 (the Hopper kernel's format) made on the GPU: no checkpoint.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator, Sequence

import torch

from harness import add_shape_args, cuda_median_ms, format_table, write_json
from megamoe.core import quant
from megamoe.core.backends.symm_buffer import resolve_group
from megamoe.core.parallel import ParallelSettings
from megamoe.core.shared_expert import AuxStream
from megamoe.qwen4exp import Qwen4ExpMegaMoeBlock

PREFIX = "model.layers.0.mlp"
# The table: (title, format, key of a measure() row).
COLUMNS = (
    ("tokens", ">9.0f", "tokens"),
    ("aux us", ">9.1f", "block_aux_us"),
    ("serial us", ">9.1f", "block_serial_us"),
    ("saved us", ">9.1f", "saved_us"),
    ("overlap", ">9.2f", "overlap"),
    ("router", ">9.1f", "router_us"),
    ("shared", ">9.1f", "shared_us"),
    ("experts", ">9.1f", "experts_us"),
)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(p, experts=64)
    # Qwen MoE models give the shared expert about four routed experts' width.
    p.add_argument("--shared-intermediate", type=int, default=6144)
    p.add_argument("--tokens", default="256,1024")
    p.add_argument("--backend", default="auto", help="auto, deepgemm or reference")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json", default="bench_qwen4exp_block.json")
    return p.parse_args(argv)


def config(args: argparse.Namespace) -> dict[str, object]:
    return {
        "model_type": "qwen4_exp",
        "hidden_size": args.hidden,
        "num_experts": args.experts,
        "num_experts_per_tok": args.top_k,
        "moe_intermediate_size": args.intermediate,
        "shared_expert_intermediate_size": args.shared_intermediate,
        "num_hidden_layers": 1,
        "norm_topk_prob": True,
        "quantization_config": {
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": [f"{PREFIX}.gate", f"{PREFIX}.shared_expert_gate"],
        },
    }


def fp8(
    rows: int, cols: int, gen: torch.Generator, name: str
) -> Iterator[tuple[str, torch.Tensor]]:
    dense = torch.randn(rows, cols, device="cuda", generator=gen) * 0.03
    values, scale = quant.quantize_fp8_block(dense, name=name)
    yield f"{name}.weight", values
    yield f"{name}.weight_scale_inv", scale


def tensors(args: argparse.Namespace) -> Iterator[tuple[str, torch.Tensor]]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    h, i, s = args.hidden, args.intermediate, args.shared_intermediate
    yield (
        "gate.weight",
        (torch.randn(args.experts, h, device="cuda", generator=gen) * 0.02).bfloat16(),
    )
    yield (
        "shared_expert_gate.weight",
        (torch.randn(1, h, device="cuda", generator=gen) * 0.02).bfloat16(),
    )
    for proj, shape in (("gate_proj", (s, h)), ("up_proj", (s, h)), ("down_proj", (h, s))):
        yield from fp8(*shape, gen, f"shared_expert.{proj}")
    for e in range(args.experts):
        for proj, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            yield from fp8(*shape, gen, f"experts.{e}.{proj}")


def measure(block: Qwen4ExpMegaMoeBlock, count: int, args: argparse.Namespace) -> dict[str, float]:
    """Block time with and without the aux stream, and its parts alone, for ``count`` tokens."""
    device = block.device
    aux, serial = AuxStream(device, enabled=True), AuxStream(device, enabled=False)
    gen = torch.Generator(device=device).manual_seed(count)
    x = torch.randn(count, args.hidden, device=device, generator=gen).bfloat16()
    weights, ids = block.route(x)

    def run_block(stream: AuxStream) -> torch.Tensor:
        block.aux_stream = stream
        return block(x)

    def time(fn: Callable[[], object]) -> float:
        return 1e3 * cuda_median_ms(fn, args.warmup, args.iters)

    row = {
        "tokens": float(count),
        "block_aux_us": time(lambda: run_block(aux)),
        "block_serial_us": time(lambda: run_block(serial)),
        "router_us": time(lambda: block.route(x)),
        "shared_us": time(lambda: block.shared_output(x)),
        "experts_us": time(lambda: block.experts(x, weights, ids)),
    }
    block.aux_stream = aux
    saved = row["block_serial_us"] - row["block_aux_us"]
    ideal = min(row["router_us"], row["shared_us"])
    row["saved_us"], row["overlap"] = saved, saved / ideal if ideal > 0 else 0.0
    return row


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    counts = [int(t) for t in args.tokens.split(",")]
    block = Qwen4ExpMegaMoeBlock(
        config(args),
        prefix=PREFIX,
        parallel=ParallelSettings(ep_group=resolve_group(None, device)),  # type: ignore[arg-type]
        backend=args.backend,
        device=device,
        max_num_tokens=max(counts),
    )
    block.load_weights(tensors(args))
    block.finalize()
    experts = block.experts
    print(
        f"E={args.experts} top-{args.top_k} H={args.hidden} I={args.intermediate} "
        f"shared I={args.shared_intermediate}; run format {experts.weight_format.value}, "
        f"backend {experts.backend.name}"
    )
    rows = [measure(block, count, args) for count in counts]
    cells = [[r[key] for _, _, key in COLUMNS] for r in rows]
    print(format_table([(title, spec) for title, spec, _ in COLUMNS], cells))
    write_json(args.json, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
