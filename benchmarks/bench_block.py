"""Both MoE blocks on the Hopper kernel: eager, compiled and CUDA-graphed, beside the bare kernel.

For each adapter (Qwen4Exp: softmax router, sigmoid-gated shared expert; GLM-5.3-Flash:
grouped sigmoid router, SwiGLU clamp, shared expert) and each token count, one run
measures (CUDA-event medians after warm-up; every column takes one sample per round,
``--iters`` rounds, so that the host's drift during the run reaches them alike; the
graph replays among themselves):

- ``bare``: DeepGEMM's ``mega_moe_pre_dispatch_sm90`` + ``fp8_mega_moe`` on the same
  weights and routing, called directly (no megamoe code in between);
- the block's parts alone: ``router``, ``shared`` expert, ``experts`` module; beside the
  router ``one mm``, a single eager ``torch.mm`` of the activations with a bf16 (E, H)
  matrix: the least any router launches, so ``router/one mm`` is how far the router's
  eager call is from one launch of torch on the same host;
- the block as built by default (``use_aux_stream="graphs"``): ``eager`` (the shared
  expert issued after the MegaMoE launch on the same stream; each call timed alone and
  synced), ``eager b2b`` (calls queued back to back with no sync between them, as an
  engine's eager prefill queues layer after layer; ``b+s b2b`` queues the bare kernel and
  the shared expert the same way; ``eager host`` and ``b+s host`` are the host time per
  call of each, ``harness.host_sample``) and ``graphed`` (a CUDA graph of it, replayed: the shared
  expert beside the router on the auxiliary stream); the other schedules of the same block
  (its ``aux_stream`` swapped): ``aux`` (eager on the auxiliary stream,
  ``use_aux_stream=True``) and ``serial graphed`` (graphed on one stream,
  ``use_aux_stream=False``); ``compiled`` (``torch.compile(fullgraph=True)``, dynamic token
  count, where the shared expert always runs inline);

and the ratios the engine-speed issue targets: eager / (bare + shared expert), the same
back to back (eager b2b / b+s b2b), and the graphed blocks over a CUDA graph of just the
bare kernel and the shared expert: each replay synced (``graphed``, which also counts the
graph's launch latency) and replays queued back to back (``graphed b2b``: the GPU time per
replay, as an engine's graph of many layers sees it, launched once per step). Beside them
``all-SM graphed`` (``b2b`` too): the block's graph captured with the auxiliary stream's
shared-expert GEMMs left to cuBLAS's default SM count (no ``AuxStream.sm_target``);
``serial graphed b2b``; ``router graphed b2b``: the router's GPU time per call. Weights are
random block-FP8 made on the GPU (no checkpoint).

    python benchmarks/bench_block.py                   # E=64, top-8, H=4096, I=1536, shared 1536
    python benchmarks/bench_block.py --tokens 1,128 --adapters glm5next --json block.json
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from harness import (
    add_shape_args,
    back_to_back_sample,
    bare_megamoe,
    cuda_graph_replay,
    format_table,
    host_sample,
    interleaved_us,
    synced_sample,
    write_json,
)
from megamoe.core.adapters import MoEBlock, SyntheticSizes
from megamoe.core.backends.symm_buffer import resolve_group
from megamoe.core.modules.parallel import ParallelSettings
from megamoe.core.modules.shared_expert import AuxStream
from megamoe.core.numerics import quant
from megamoe.core.numerics.formats import WeightFormat
from megamoe.glm5next import ADAPTER as GLM
from megamoe.qwen4exp import ADAPTER as QWEN

SHARED = {"qwen4exp": "shared_expert", "glm5next": "shared_experts"}
COLUMNS = (
    ("adapter", "<9", "adapter"),
    ("tokens", ">6.0f", "tokens"),
    ("bare", ">7.1f", "bare_us"),
    ("router", ">7.1f", "router_us"),
    ("one mm", ">7.1f", "one_mm_us"),
    ("router/one mm", ">13.2f", "router_mm_ratio"),
    ("shared", ">7.1f", "shared_us"),
    ("experts", ">8.1f", "experts_us"),
    ("eager", ">7.1f", "eager_us"),
    ("eager b2b", ">9.1f", "eager_b2b_us"),
    ("b+s b2b", ">7.1f", "bare_shared_b2b_us"),
    ("eager host", ">10.1f", "eager_host_us"),
    ("b+s host", ">8.1f", "bare_shared_host_us"),
    ("aux", ">7.1f", "aux_us"),
    ("compiled", ">8.1f", "compiled_us"),
    ("graphed", ">8.1f", "graphed_us"),
    ("serial graphed", ">14.1f", "serial_graphed_us"),
    ("b+s graphed", ">11.1f", "bare_shared_graphed_us"),
    ("eager/(b+s)", ">11.2f", "eager_ratio"),
    ("eager b2b/(b+s) b2b", ">19.2f", "eager_b2b_ratio"),
    ("graphed/(b+s) graphed", ">21.2f", "graphed_ratio"),
    ("serial graphed/(b+s) graphed", ">28.2f", "serial_graphed_ratio"),
    ("graphed b2b", ">11.1f", "graphed_b2b_us"),
    ("b+s graphed b2b", ">15.1f", "bare_shared_graphed_b2b_us"),
    ("graphed b2b/(b+s)", ">17.2f", "graphed_b2b_ratio"),
    ("all-SM graphed", ">14.1f", "all_sm_graphed_us"),
    ("all-SM graphed b2b", ">18.1f", "all_sm_graphed_b2b_us"),
    ("all-SM b2b/(b+s)", ">16.2f", "all_sm_graphed_b2b_ratio"),
    ("serial graphed b2b", ">18.1f", "serial_graphed_b2b_us"),
    ("router graphed b2b", ">18.1f", "router_graphed_b2b_us"),
)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(p, experts=64)
    p.add_argument("--shared-intermediate", type=int, default=1536)
    p.add_argument("--tokens", default="1,16,128,256,1024,4096")
    p.add_argument("--adapters", default="qwen4exp,glm5next")
    p.add_argument(
        "--iters", type=int, default=30, help="rounds, and calls per back-to-back or host sample"
    )
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--no-compile", action="store_true", help="skip the compiled block")
    p.add_argument("--json", default="bench_block.json")
    return p.parse_args(argv)


def config(adapter: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The adapter's synthetic block-FP8 config at the benchmark's sizes."""
    sizes = SyntheticSizes(
        num_layers=2, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_experts=args.experts, top_k=args.top_k,
        shared_intermediate_size=args.shared_intermediate,
    )  # fmt: skip
    return adapter.synthetic_config(WeightFormat.FP8_BLOCK, sizes)


def _fp8(
    rows: int, cols: int, gen: torch.Generator, name: str
) -> Iterator[tuple[str, torch.Tensor]]:
    dense = torch.randn(rows, cols, device="cuda", generator=gen) * 0.03
    values, scale = quant.quantize_fp8_block(dense, name=name)
    yield f"{name}.weight", values
    yield f"{name}.weight_scale_inv", scale


def tensors(name: str, args: argparse.Namespace) -> Iterator[tuple[str, torch.Tensor]]:
    """Random router, shared expert and routed experts (names relative to the block)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    h, i, s, e = args.hidden, args.intermediate, args.shared_intermediate, args.experts
    yield "gate.weight", (torch.randn(e, h, device="cuda", generator=gen) * 0.02).bfloat16()
    if name == "qwen4exp":
        yield (
            "shared_expert_gate.weight",
            (torch.randn(1, h, device="cuda", generator=gen) * 0.02).bfloat16(),
        )
    else:
        yield "gate.e_score_correction_bias", torch.rand(e, device="cuda", generator=gen) * 1e-3
    for proj, shape in (("gate_proj", (s, h)), ("up_proj", (s, h)), ("down_proj", (h, s))):
        yield from _fp8(*shape, gen, f"{SHARED[name]}.{proj}")
    for expert in range(e):
        for proj, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            yield from _fp8(*shape, gen, f"experts.{expert}.{proj}")


def parts(block: MoEBlock, name: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The block's router and shared expert as callables of the hidden states."""
    if name == "qwen4exp":
        return block.route, block.shared_output  # type: ignore[attr-defined]
    return block.gate, block.shared_experts  # type: ignore[attr-defined]


def measure(
    name: str,
    block: MoEBlock,
    compiled: Callable[[torch.Tensor], torch.Tensor] | None,
    count: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One table row: the block and its parts at ``count`` tokens, sampled round by round.

    Every column takes one sample per round (``harness.interleaved_us``), so the host's
    drift during the run reaches the block and its baselines alike; the graph replays are
    sampled among themselves, after the eager calls.
    """
    gen = torch.Generator(device="cuda").manual_seed(count)
    x = torch.randn(count, args.hidden, device="cuda", generator=gen).bfloat16()
    router, shared = parts(block, name)
    weights, ids = router(x)
    bare = bare_megamoe(block.experts)
    default = block.aux_stream  # type: ignore[attr-defined]
    logits_weight = torch.randn(args.experts, args.hidden, device="cuda", generator=gen).bfloat16()

    def with_schedule(use_aux_stream: bool) -> Callable[[], torch.Tensor]:
        """The block called with its shared expert scheduled by ``use_aux_stream``."""
        schedule = AuxStream(x.device, enabled=use_aux_stream)

        def call() -> torch.Tensor:
            block.aux_stream = schedule  # type: ignore[attr-defined]
            try:
                return block(x)
            finally:
                block.aux_stream = default  # type: ignore[attr-defined]

        return call

    def all_sms() -> torch.Tensor:
        """The block with its auxiliary stream's shared GEMMs on cuBLAS's default SM count."""
        target = block.aux_stream.sm_target  # type: ignore[attr-defined]
        carveout, target.carveout = target.carveout, None
        try:
            return block(x)
        finally:
            target.carveout = carveout

    def bare_and_shared() -> tuple[torch.Tensor, torch.Tensor]:
        return bare(x, weights, ids), shared(x)

    with torch.no_grad():
        eager: dict[str, Callable[[], float]] = {
            "bare_us": synced_sample(lambda: bare(x, weights, ids)),
            "router_us": synced_sample(lambda: router(x)),
            "one_mm_us": synced_sample(lambda: torch.mm(x, logits_weight.t())),
            "shared_us": synced_sample(lambda: shared(x)),
            "experts_us": synced_sample(lambda: block.experts(x, weights, ids)),
            "eager_us": synced_sample(lambda: block(x)),
            "eager_b2b_us": back_to_back_sample(lambda: block(x), args.iters),
            "bare_shared_b2b_us": back_to_back_sample(bare_and_shared, args.iters),
            "eager_host_us": host_sample(lambda: block(x), args.iters),
            "bare_shared_host_us": host_sample(bare_and_shared, args.iters),
            "aux_us": synced_sample(with_schedule(True)),
        }
        if compiled is not None:
            eager["compiled_us"] = synced_sample(lambda: compiled(x))
        block_graph = cuda_graph_replay(lambda: block(x))
        serial_graph = cuda_graph_replay(with_schedule(False))
        bare_shared_graph = cuda_graph_replay(lambda: (shared(x), bare(x, weights, ids))[1])
        all_sm_graph = cuda_graph_replay(all_sms)
        graphed = {
            "graphed_us": synced_sample(block_graph),
            "serial_graphed_us": synced_sample(serial_graph),
            "bare_shared_graphed_us": synced_sample(bare_shared_graph),
            "all_sm_graphed_us": synced_sample(all_sm_graph),
            "graphed_b2b_us": back_to_back_sample(block_graph, args.iters),
            "serial_graphed_b2b_us": back_to_back_sample(serial_graph, args.iters),
            "bare_shared_graphed_b2b_us": back_to_back_sample(bare_shared_graph, args.iters),
            "all_sm_graphed_b2b_us": back_to_back_sample(all_sm_graph, args.iters),
            "router_graphed_b2b_us": back_to_back_sample(
                cuda_graph_replay(lambda: router(x)), args.iters
            ),
        }
        row: dict[str, Any] = {"adapter": name, "tokens": float(count)}
        row.update(interleaved_us(eager, args.warmup, args.iters))
        row.update(interleaved_us(graphed, args.warmup, args.iters))
    row["router_mm_ratio"] = row["router_us"] / row["one_mm_us"]
    row["eager_ratio"] = row["eager_us"] / (row["bare_us"] + row["shared_us"])
    row["eager_b2b_ratio"] = row["eager_b2b_us"] / row["bare_shared_b2b_us"]
    row["graphed_ratio"] = row["graphed_us"] / row["bare_shared_graphed_us"]
    row["serial_graphed_ratio"] = row["serial_graphed_us"] / row["bare_shared_graphed_us"]
    row["graphed_b2b_ratio"] = row["graphed_b2b_us"] / row["bare_shared_graphed_b2b_us"]
    row["all_sm_graphed_b2b_ratio"] = (
        row["all_sm_graphed_b2b_us"] / row["bare_shared_graphed_b2b_us"]
    )
    return row


def build(
    adapter: Any,
    cfg: dict[str, Any],
    tensors_: list[tuple[str, torch.Tensor]],
    *,
    tokens: int,
) -> MoEBlock:
    device = torch.device("cuda", 0)
    layer = next(m for m in adapter.moe_layers(cfg) if not m.is_mtp)
    block = adapter.block_class(
        cfg, prefix=layer.prefix, parallel=ParallelSettings(ep_group=resolve_group(None, device)),
        backend="deepgemm", device=device, max_num_tokens=tokens,
    )  # fmt: skip
    block.load_weights(tensors_)
    block.finalize()
    return block


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    torch.cuda.set_device(0)
    counts = [int(t) for t in args.tokens.split(",")]
    adapters = {a.name: a for a in (QWEN, GLM)}  # imported: a source checkout has no entry points
    rows = []
    for name in args.adapters.split(","):
        adapter, cfg = adapters[name], config(adapters[name], args)
        weights = list(tensors(name, args))
        block = build(adapter, cfg, weights, tokens=max(counts))
        del weights
        print(f"{name}: E={args.experts} top-{args.top_k} H={args.hidden} I={args.intermediate} "
              f"shared I={args.shared_intermediate}, {block.experts.weight_format.value}, "
              f"backend {block.experts.backend.name}", flush=True)  # fmt: skip
        torch._dynamo.reset()
        compiled = None if args.no_compile else torch.compile(block, fullgraph=True, dynamic=True)
        for count in counts:
            rows.append(measure(name, block, compiled, count, args))
        del block, compiled
        torch.cuda.empty_cache()
    cells = [[r.get(key) for _, _, key in COLUMNS] for r in rows]
    print(format_table([(title, spec) for title, spec, _ in COLUMNS], cells))
    write_json(args.json, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
