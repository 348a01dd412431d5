"""The shared expert on the H200: block-FP8 weights on DeepGEMM's FP8 GEMM vs the bf16 copy.

For each shared-expert width (Qwen4Exp I=1536, GLM-5.3-Flash I=2048 with its SwiGLU clamp)
and token count, one run measures ``SwiGLUMLP`` built from the same block-FP8 weights two
ways (CUDA-event medians after warm-up):

- ``bf16``: ``gemm="bf16"``, the weights dequantized to bf16 at load, three ``F.linear``;
- ``fp8``: ``gemm="deep_gemm"``, the E4M3 weights and 128x128 block scales as loaded, the
  input and SwiGLU output cast to E4M3 (1x128 scales), two ``fp8_gemm_nt`` calls (gate and
  up in one);

each eager, replayed from a CUDA graph (the GPU time of the eager kernels, no launch
overhead) and compiled (``torch.compile(fullgraph=True, dynamic=True)``: inductor fuses the
casts and the SwiGLU), with the fp8 / bf16 ratios and the weights' resident MiB. Beside
them ``torch act``: the bf16 MLP with its SwiGLU as torch operations (clamp, silu,
multiply) instead of the one Triton launch it takes on CUDA
(``megamoe.core.kernels.swiglu_triton``), eager and graphed, and the bf16 / torch act
ratios; and ``half SMs graphed``: the bf16 MLP's graph captured with its GEMMs sized for
half the SMs (``megamoe.core.modules.gemm_sm_target.GemmSmTarget``, which the blocks' auxiliary
stream applies up to ``SMALL_GEMM_ROWS`` tokens; here at every size), over the plain bf16
graph. Weights are random block-FP8 made on the GPU.

    python benchmarks/bench_shared_expert.py                      # H=4096, 1..4096 tokens
    python benchmarks/bench_shared_expert.py --tokens 1,128 --json shared.json
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from memory import distinct_storage_bytes

from harness import cuda_graph_replay, cuda_median_ms, format_table, write_json
from megamoe.core.modules.gemm_sm_target import GemmSmTarget
from megamoe.core.modules.shared_expert import SwiGLUMLP
from megamoe.core.numerics import quant
from megamoe.core.numerics.formats import WeightFormat

GLM_SWIGLU_LIMIT = 10.0  # GLM-5.3-Flash's clamp (megamoe.glm5next.config)
COLUMNS = (
    ("model", "<5", "model"),
    ("I", ">5.0f", "intermediate"),
    ("tokens", ">6.0f", "tokens"),
    ("bf16 eager", ">10.1f", "bf16_eager_us"),
    ("fp8 eager", ">9.1f", "fp8_eager_us"),
    ("fp8/bf16", ">8.2f", "eager_ratio"),
    ("bf16 graphed", ">12.1f", "bf16_graphed_us"),
    ("fp8 graphed", ">11.1f", "fp8_graphed_us"),
    ("fp8/bf16 graphed", ">16.2f", "graphed_ratio"),
    ("bf16 compiled", ">13.1f", "bf16_compiled_us"),
    ("fp8 compiled", ">12.1f", "fp8_compiled_us"),
    ("fp8/bf16 compiled", ">17.2f", "compiled_ratio"),
    ("torch act eager", ">15.1f", "torch_act_eager_us"),
    ("torch act graphed", ">17.1f", "torch_act_graphed_us"),
    ("bf16/torch act", ">14.2f", "act_eager_ratio"),
    ("bf16/torch act graphed", ">22.2f", "act_graphed_ratio"),
    ("half SMs graphed", ">16.1f", "half_sms_graphed_us"),
    ("half SMs/bf16 graphed", ">21.2f", "half_sms_ratio"),
    ("bf16 MiB", ">8.1f", "bf16_mib"),
    ("fp8 MiB", ">7.1f", "fp8_mib"),
)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--qwen-intermediate", type=int, default=1536)
    p.add_argument("--glm-intermediate", type=int, default=2048)
    p.add_argument("--tokens", default="1,16,64,128,256,512,1024,2048,4096")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json", default="bench_shared_expert.json")
    return p.parse_args(argv)


def tensors(hidden: int, inter: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Random block-FP8 projections of one shared expert, on the GPU."""
    gen = torch.Generator(device="cuda").manual_seed(inter)
    for proj, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                        ("down_proj", (hidden, inter))):  # fmt: skip
        dense = torch.randn(shape, device="cuda", generator=gen) * 0.03
        values, scale = quant.quantize_fp8_block(dense, name=proj)
        yield f"{proj}.weight", values
        yield f"{proj}.weight_scale_inv", scale


def build(
    weights: list[tuple[str, torch.Tensor]], hidden: int, inter: int, limit: float | None, gemm: str
) -> SwiGLUMLP:
    mlp = SwiGLUMLP(
        hidden, inter, WeightFormat.FP8_BLOCK, device="cuda", swiglu_limit=limit, gemm=gemm
    )
    mlp.load_weights(weights)
    mlp.check_loaded()
    mlp.commit()
    return mlp


def measure(
    mlp: SwiGLUMLP, compiled: Callable[[torch.Tensor], torch.Tensor] | None, x: torch.Tensor,
    args: argparse.Namespace,
) -> tuple[float, float, float | None]:  # fmt: skip
    """Microseconds of ``mlp(x)`` eager, replayed from a CUDA graph, and compiled (if given)."""
    with torch.no_grad():
        eager = cuda_median_ms(lambda: mlp(x), args.warmup, args.iters)
        replay = cuda_median_ms(cuda_graph_replay(lambda: mlp(x)), args.warmup, args.iters)
        if compiled is None:
            return 1e3 * eager, 1e3 * replay, None
        fused = cuda_median_ms(lambda: compiled(x), args.warmup, args.iters)
        return 1e3 * eager, 1e3 * replay, 1e3 * fused


def rows(
    model: str, inter: int, limit: float | None, args: argparse.Namespace
) -> Iterator[dict[str, Any]]:
    """One table row per token count for one shared-expert width."""
    weights = list(tensors(args.hidden, inter))
    mlps = {gemm: build(weights, args.hidden, inter, limit, gemm) for gemm in ("bf16", "deep_gemm")}
    mib = {g: distinct_storage_bytes(m.parameters()) / 2**20 for g, m in mlps.items()}
    torch_act = build(weights, args.hidden, inter, limit, "bf16")
    torch_act._swiglu_rows = None  # the baseline: the torch expression the kernel replaces
    # One graph per path for every token count (inductor fuses the casts and the SwiGLU).
    compiled = {g: torch.compile(m, fullgraph=True, dynamic=True) for g, m in mlps.items()}
    half_sms = GemmSmTarget("cuda")

    for count in (int(t) for t in args.tokens.split(",")):
        gen = torch.Generator(device="cuda").manual_seed(count)
        x = torch.randn(count, args.hidden, device="cuda", generator=gen).bfloat16()
        row: dict[str, Any] = {"model": model, "intermediate": float(inter), "tokens": float(count)}
        for gemm, key in (("bf16", "bf16"), ("deep_gemm", "fp8")):
            times = measure(mlps[gemm], compiled[gemm], x, args)
            row[f"{key}_eager_us"], row[f"{key}_graphed_us"], row[f"{key}_compiled_us"] = times
        row["eager_ratio"] = row["fp8_eager_us"] / row["bf16_eager_us"]
        row["graphed_ratio"] = row["fp8_graphed_us"] / row["bf16_graphed_us"]
        row["compiled_ratio"] = row["fp8_compiled_us"] / row["bf16_compiled_us"]
        row["torch_act_eager_us"], row["torch_act_graphed_us"], _ = measure(
            torch_act, None, x, args
        )
        row["act_eager_ratio"] = row["bf16_eager_us"] / row["torch_act_eager_us"]
        row["act_graphed_ratio"] = row["bf16_graphed_us"] / row["torch_act_graphed_us"]
        bf16 = mlps["bf16"]
        with torch.no_grad():  # rows=0: under the target whatever the token count
            half = cuda_graph_replay(lambda: half_sms.run(0, lambda: bf16(x)))  # noqa: B023
            row["half_sms_graphed_us"] = 1e3 * cuda_median_ms(half, args.warmup, args.iters)
        row["half_sms_ratio"] = row["half_sms_graphed_us"] / row["bf16_graphed_us"]
        row["bf16_mib"], row["fp8_mib"] = mib["bf16"], mib["deep_gemm"]
        print(f"{model} I={inter} {count} tokens: done", flush=True)
        yield row


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_shared_expert: needs a CUDA device (an SM90 GPU with DeepGEMM)")
    table = [
        *rows("qwen", args.qwen_intermediate, None, args),
        *rows("glm", args.glm_intermediate, GLM_SWIGLU_LIMIT, args),
    ]
    print(f"\nshared expert, H={args.hidden}: CUDA-event medians in us over {args.iters} runs")
    print(
        format_table(
            [(t, f) for t, f, _ in COLUMNS], ([r[k] for _, _, k in COLUMNS] for r in table)
        )
    )
    write_json(args.json, {"hidden": args.hidden, "rows": table})


if __name__ == "__main__":
    main()
