"""Forward time of one MoE layer: DeepGEMM MegaMoE vs the reference backend and torch baselines.

Each row sits beside its roofline floor for that token count: the bytes of the experts the
batch activates over the measured HBM copy bandwidth, or the FLOPs over the peak tensor
throughput, whichever is larger. Times are medians of CUDA-event timings after warm-up.

    python benchmarks/bench_forward.py                       # E=64, top-8, H=4096, I=1536
    python benchmarks/bench_forward.py --tokens 256 --json out.json

Backends: ``deepgemm`` (the Hopper fp8_mega_moe kernel through MegaMoEExperts; block-FP8
weights), ``reference`` (megamoe's torch reference backend), ``naive`` (a per-expert torch
loop on bf16 weights) and ``grouped`` (``torch._grouped_mm`` on bf16 weights, when torch
has it).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.nn.functional as F
from bitcheck import relative_error

from harness import (
    add_shape_args,
    copy_bytes_per_s,
    cuda_median_ms,
    format_table,
    one_rank_experts,
    write_json,
)
from megamoe.core.modules.experts import MegaMoEExperts
from megamoe.core.numerics import quant
from megamoe.core.numerics.formats import WeightFormat

FMT = WeightFormat.FP8_BLOCK
BACKENDS = ("deepgemm", "reference", "naive", "grouped")


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(p, experts=64)
    p.add_argument("--tokens", default="1,16,128,256,1024,4096")
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--peak-tflops-fp8", type=float, default=1979.0, help="H200 dense FP8")
    p.add_argument("--peak-tflops-bf16", type=float, default=989.0, help="H200 dense BF16")
    p.add_argument("--json", default="bench_forward.json")
    return p.parse_args(argv)


def checkpoint(e: int, h: int, i: int) -> dict[str, torch.Tensor]:
    """Block-FP8 experts with magnitudes that differ per expert, projection and block."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    for proj, (rows, cols), gain in (
        ("gate_proj", (i, h), 1.0),
        ("up_proj", (i, h), 1.7),
        ("down_proj", (h, i), 0.6),
    ):
        blocks = torch.exp2(
            torch.rand(e, rows // 128, cols // 128, device="cuda", generator=gen) * 4 - 2
        )
        gains = 0.03 * gain * blocks.repeat_interleave(128, 1).repeat_interleave(128, 2)
        dense = torch.randn(e, rows, cols, device="cuda", generator=gen) * gains
        values, scale = quant.quantize_fp8_block(dense, name=proj)
        del dense, gains
        for expert in range(e):
            tensors[f"{expert}.{proj}.weight"] = values[expert]
            tensors[f"{expert}.{proj}.weight_scale_inv"] = scale[expert]
    return tensors


def routing(tokens: int, e: int, k: int, h: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, h, device="cuda", generator=gen).to(torch.bfloat16)
    scores = torch.randn(tokens, e, device="cuda", generator=gen)
    top, ids = scores.topk(k, dim=-1)
    return x, torch.softmax(top, -1), ids.to(torch.int32)


def dense_bf16(layer: MegaMoEExperts) -> tuple[torch.Tensor, torch.Tensor]:
    params = layer.kernel_params
    w13 = quant.dequantize(params["w13_weight"].data, params["w13_weight_scale"].data, FMT)
    w2 = quant.dequantize(params["w2_weight"].data, params["w2_weight_scale"].data, FMT)
    return w13.to(torch.bfloat16), w2.to(torch.bfloat16)


def naive(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """Per-expert torch loop: gather the expert's tokens, two bf16 GEMMs, scatter-add."""
    i = w2.shape[-1]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w13.shape[0]):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        h = x[tok] @ w13[e].T
        act = F.silu(h[:, :i]) * h[:, i:] * weights[tok, slot, None].to(torch.bfloat16)
        out.index_add_(0, tok, (act @ w2[e].T).float())
    return out.to(torch.bfloat16)


def grouped(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """Sort (token, slot) pairs by expert, then two ``torch._grouped_mm`` calls."""
    k, i = ids.shape[1], w2.shape[-1]
    flat = ids.reshape(-1).long()
    order = flat.argsort()
    offsets = torch.bincount(flat, minlength=w13.shape[0]).cumsum(0).to(torch.int32)
    token = order // k
    h = torch._grouped_mm(x[token], w13.transpose(-2, -1), offs=offsets)
    act = F.silu(h[:, :i]) * h[:, i:]
    y = torch._grouped_mm(act, w2.transpose(-2, -1), offs=offsets).float()
    y = y * weights.reshape(-1)[order, None]
    return torch.zeros(x.shape, device=x.device).index_add_(0, token, y).to(torch.bfloat16)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    e, k, h, i = args.experts, args.top_k, args.hidden, args.intermediate
    token_counts = [int(t) for t in args.tokens.split(",")]
    wanted = args.backends.split(",")
    bandwidth = copy_bytes_per_s(2 << 30, warmup=2, reps=10)  # a 1 GiB copy
    tensors = checkpoint(e, h, i)
    layers: dict[str, MegaMoEExperts] = {}
    for backend in ("deepgemm", "reference"):
        if backend in wanted:
            layer = one_rank_experts((e, h, i), k, FMT, FMT, backend, max(token_counts))
            layer.load_weights(tensors.items())
            layer.finalize()
            layers[backend] = layer
    any_layer = next(iter(layers.values()), None)
    if any_layer is None:
        raise SystemExit("--backends must include deepgemm or reference (they hold the weights)")
    w13, w2 = dense_bf16(any_layer) if {"naive", "grouped"} & set(wanted) else (None, None)
    del tensors
    has_grouped = hasattr(torch, "_grouped_mm")
    fp8_expert_bytes = 3 * h * i + 4 * (3 * (h // 128) * (i // 128))
    rows = []
    for tokens in token_counts:
        x, weights, ids = routing(tokens, e, k, h)
        active = int(torch.unique(ids).numel())
        flops = 2 * tokens * k * 3 * h * i
        runs: dict[str, Callable[[], torch.Tensor]] = {
            backend: partial(layer, x, weights, ids) for backend, layer in layers.items()
        }
        if w13 is not None and w2 is not None:
            if "naive" in wanted:
                runs["naive"] = partial(naive, x, weights, ids, w13, w2)
            if "grouped" in wanted and has_grouped:
                runs["grouped"] = partial(grouped, x, weights, ids, w13, w2)
        baseline = runs["naive"]() if "naive" in runs else None
        for name, fn in runs.items():
            slow = name in ("reference", "naive")
            reps = max(3, args.iters // 4) if slow else args.iters
            us = 1e3 * cuda_median_ms(fn, args.warmup, reps)
            fp8 = name == "deepgemm"
            weight_bytes = active * (fp8_expert_bytes if fp8 else 2 * 3 * h * i)
            peak = (args.peak_tflops_fp8 if fp8 else args.peak_tflops_bf16) * 1e12
            floor_us = max(weight_bytes / bandwidth, flops / peak) * 1e6
            agreement = None if baseline is None else relative_error(fn(), baseline)
            rows.append(
                dict(
                    tokens=tokens,
                    backend=name,
                    median_us=us,
                    floor_us=floor_us,
                    active_experts=active,
                    weight_bytes=weight_bytes,
                    flops=flops,
                    rel_vs_naive=agreement,
                )
            )
    print(f"E={e} top-{k} H={h} I={i}; HBM copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    columns = (
        ("tokens", ">6"),
        ("backend", ">10"),
        ("median us", ">11.1f"),
        ("floor us", ">9.1f"),
        ("% of floor", ">10.1f"),
        ("rel vs naive", ">12.3g"),
    )
    cells = [
        (
            r["tokens"],
            r["backend"],
            r["median_us"],
            r["floor_us"],
            100 * r["floor_us"] / r["median_us"],
            r["rel_vs_naive"],
        )
        for r in rows
    ]
    print(format_table(columns, cells))
    config = dict(
        experts=e,
        top_k=k,
        hidden=h,
        intermediate=i,
        bandwidth_bytes_per_s=bandwidth,
        peak_tflops_fp8=args.peak_tflops_fp8,
        peak_tflops_bf16=args.peak_tflops_bf16,
        grouped_mm=has_grouped,
    )
    write_json(args.json, {"config": config, "rows": rows})


if __name__ == "__main__":
    main()
