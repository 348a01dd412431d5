"""Decode and beyond on one Hopper rank: the small-batch path, MegaMoE, DeepGEMM's GEMMs, the floor.

For each real layer (Qwen4-Exp: E=512, top-10, H=2048, I=512; GLM-5.3-Flash: E=288, top-8,
H=4096, I=2048, SwiGLU clamp 10) and each token count, one run measures on the same
block-FP8 weights and uniform random routing (CUDA-graph replays, medians; every column
takes one sample per round, ``--rounds`` rounds):

- ``small``: the small-batch path (``experts_path="small_batch"``: the experts module as an
  engine calls it), graphed and ``small eager`` (calls queued back to back, no graph);
- ``megamoe``: DeepGEMM's ``mega_moe_pre_dispatch_sm90`` + ``fp8_mega_moe`` on the same
  kernel tensors, graphed and ``megamoe eager``;
- ``masked``: the peer SGLang's low-latency decode runs per rank,
  ``m_grouped_fp8_fp4_gemm_nt_masked`` for L1 and L2 alone (no activation, no casts);
- ``contiguous``: ``m_grouped_fp8_fp4_gemm_nt_contiguous`` for L1 and L2 alone, the tokens
  sorted by expert and each expert padded to 128 rows (measured from 256 tokens);
- ``floor``: the larger of the active experts' weight bytes over the card's memory bandwidth
  and their FLOPs over its dense FP8 peak (``CARD_PEAKS``: an H200 4.8 TB/s, an H100 SXM
  3.35, both 1979 TFLOP/s; the report names the card);
- ``chosen``: the path ``experts_path="auto"`` takes at that count
  (``megamoe.core.backends.small_batch``) and its time.

Each layer is ``--layers`` copies with their own weights, called in turn inside one graph
(the time is per layer): a decode step reads every layer's weights once, so a copy never
finds its weights in the 50 MB L2 cache. ``--blocks`` adds both MoE blocks (router, shared
expert, combine) at the decode counts, graphed, with ``experts_path`` forced to each path;
``auto`` is the one the rule takes there.
``--plot`` writes time against tokens (log-log), the floor as a line.

    python benchmarks/bench_decode.py --json decode.json --plot decode.png
    python benchmarks/bench_decode.py --from-json decode.json --plot decode.png  # no GPU

``--from-json`` reports a saved run's times (layers and blocks) with the path this checkout's
rule would take on the run's card.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from harness import (
    back_to_back_sample,
    bare_megamoe,
    cuda_graph_replay,
    format_table,
    interleaved_us,
    write_json,
)
from megamoe.core.backends.small_batch import (
    LayerWork,
    crossover_tokens,
    layer_work,
    takes_small_batch,
)
from megamoe.core.backends.symm_buffer import resolve_group
from megamoe.core.modules.experts import MegaMoEExperts
from megamoe.core.modules.experts_backend import PATH_MEGAMOE, PATH_SMALL_BATCH
from megamoe.core.numerics import quant
from megamoe.core.numerics.formats import WeightFormat

FMT = WeightFormat.FP8_BLOCK
# Each card's memory bandwidth (bytes/s) and dense FP8 peak (FLOP/s), from its datasheet, by
# what its CUDA name contains (the lent machines are H200s, at times H100 SXMs in their place)
CARD_PEAKS = {"H200": (4.8e12, 1979e12), "H100 80GB HBM3": (3.35e12, 1979e12)}
SAVED_CARD = "NVIDIA H200"  # the card of saved runs that do not name theirs (before 2026-12-05)
# name: (experts, top-k, hidden, intermediate, SwiGLU clamp, shared intermediate)
LAYERS = {
    "qwen4exp": (512, 10, 2048, 512, None, 512),
    "glm53flash": (288, 8, 4096, 2048, 10.0, 2048),
    # DeepSeek-V3's MoE layer (megamoe-glm5next loads its checkpoints): the path rule's check
    # on a shape it was not fitted to (--models deepseekv3; the block rows are the two above)
    "deepseekv3": (256, 8, 7168, 2048, None, 2048),
}
DECODE_COUNTS = "1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192"
CONTIGUOUS_FROM = 256  # tokens from which the contiguous peer is measured
COLUMNS = [
    ("layer", "<10", "layer"),
    ("tokens", ">6d", "tokens"),
    ("active", ">6d", "active"),
    ("floor us", ">8.1f", "floor"),
    ("small", ">8.1f", "small"),
    ("megamoe", ">8.1f", "megamoe"),
    ("masked", ">8.1f", "masked"),
    ("contig", ">8.1f", "contiguous"),
    ("small eager", ">8.1f", "small_eager"),
    ("mega eager", ">8.1f", "megamoe_eager"),
    ("chosen", "<11", "chosen"),
    ("chosen/floor", ">6.2f", "chosen_floor"),
    ("small/floor", ">6.2f", "small_floor"),
    ("chosen/mega", ">6.2f", "chosen_megamoe"),
    ("chosen/masked", ">6.2f", "chosen_masked"),
]


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default=DECODE_COUNTS)
    p.add_argument("--models", default="qwen4exp,glm53flash")
    p.add_argument("--layers", type=int, default=4, help="weight copies per graph")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reps", type=int, default=10, help="replays per sample")
    p.add_argument("--blocks", default="1,4,16,64", help="token counts of the block rows")
    p.add_argument("--json", default="bench_decode.json")
    p.add_argument("--plot", default="", help="write the plot here (needs matplotlib)")
    p.add_argument("--from-json", default="", help="report (and plot) a saved run; no GPU")
    return p.parse_args(argv)


def fp8_projection(rows: int, cols: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random block-FP8 projection, magnitudes varying per 128x128 block."""
    gain = torch.exp2(torch.rand(rows // 128, cols // 128, device="cuda", generator=gen) * 4 - 2)
    dense = torch.randn(rows, cols, device="cuda", generator=gen) * 0.02
    dense *= gain.repeat_interleave(128, 0).repeat_interleave(128, 1)
    return quant.quantize_fp8_block(dense, name="bench")


def expert_tensors(
    experts: int, hidden: int, inter: int, seed: int
) -> Iterator[tuple[str, torch.Tensor]]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for e in range(experts):
        for proj, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                            ("down_proj", (hidden, inter))):  # fmt: skip
            values, scale = fp8_projection(*shape, gen)
            yield f"{e}.{proj}.weight", values
            yield f"{e}.{proj}.weight_scale_inv", scale


def build_layer(name: str, seed: int, max_tokens: int, path: str) -> MegaMoEExperts:
    experts, top_k, hidden, inter, limit, _ = LAYERS[name]
    layer = MegaMoEExperts(
        num_experts=experts, num_local_experts=experts, experts_start_idx=0,
        num_logical_experts=experts, top_k=top_k, hidden_size=hidden, intermediate_size=inter,
        weight_format=FMT, checkpoint_format=FMT, max_num_tokens=max_tokens,
        process_group=None, backend="deepgemm",
        device="cuda", prefix=f"{name}.experts", swiglu_limit=limit, experts_path=path,
    )  # fmt: skip
    layer.load_weights(expert_tensors(experts, hidden, inter, seed))
    layer.finalize()
    return layer


def routing(name: str, tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    experts, top_k, hidden, _, _, _ = LAYERS[name]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(tokens, hidden, device="cuda", generator=gen)).to(torch.bfloat16)
    ids = torch.rand(tokens, experts, device="cuda", generator=gen).argsort(-1)[:, :top_k]
    weights = torch.softmax(torch.randn(tokens, top_k, device="cuda", generator=gen), -1)
    return x, weights.float(), ids.to(torch.int32)


def grouped_peers(
    layers: list[MegaMoEExperts], ids: torch.Tensor, tokens: int
) -> dict[str, Callable[[], None]]:
    """The masked (and from CONTIGUOUS_FROM tokens the contiguous) grouped GEMMs, L1 + L2."""
    import deep_gemm

    first = layers[0]
    experts, hidden, inter = first.num_local_experts, first.hidden_size, first.intermediate_size
    counts = torch.bincount(ids.flatten().long(), minlength=experts).int()
    rows = max(16, -(-int(counts.max()) // 16) * 16)
    expected = max(1, int(counts.sum()) // max(1, int((counts > 0).sum())))

    def buffers(m: tuple[int, ...]) -> list[torch.Tensor]:
        return [
            torch.zeros(*m, hidden, device="cuda").to(torch.float8_e4m3fn),
            torch.ones(*m, hidden // 128, device="cuda"),
            torch.empty(*m, 2 * inter, dtype=torch.bfloat16, device="cuda"),
            torch.zeros(*m, inter, device="cuda").to(torch.float8_e4m3fn),
            torch.ones(*m, inter // 128, device="cuda"),
            torch.empty(*m, hidden, dtype=torch.bfloat16, device="cuda"),
        ]

    weights = [
        (layer.w13_weight.data, layer.w13_weight_scale.data, layer.w2_weight.data,
         layer.w2_weight_scale.data)
        for layer in layers
    ]  # fmt: skip
    a1, a1s, d1, a2, a2s, d2 = buffers((experts, rows))

    def masked() -> None:
        for w13, s13, w2, s2 in weights:
            deep_gemm.m_grouped_fp8_fp4_gemm_nt_masked((a1, a1s), (w13, s13), d1, counts, expected)
            deep_gemm.m_grouped_fp8_fp4_gemm_nt_masked((a2, a2s), (w2, s2), d2, counts, expected)

    peers = {"masked": masked}
    if tokens >= CONTIGUOUS_FROM:
        align = deep_gemm.get_mk_alignment_for_contiguous_layout()
        padded = (counts + align - 1) // align * align
        layout = torch.repeat_interleave(
            torch.arange(experts, device="cuda", dtype=torch.int32), padded.long()
        )
        c1, c1s, e1, c2, c2s, e2 = buffers((int(padded.sum()),))

        def contiguous() -> None:
            for w13, s13, w2, s2 in weights:
                deep_gemm.m_grouped_fp8_fp4_gemm_nt_contiguous((c1, c1s), (w13, s13), e1, layout)
                deep_gemm.m_grouped_fp8_fp4_gemm_nt_contiguous((c2, c2s), (w2, s2), e2, layout)

        peers["contiguous"] = contiguous
    return peers


def calls_in_turn(calls: Sequence[Callable[..., Any]], *inputs: torch.Tensor) -> Callable[[], None]:
    """One call of each of ``calls`` on ``inputs``, in turn (the layers of a decode step)."""

    def run() -> None:
        for call in calls:
            call(*inputs)

    return run


def card_peaks(card: str) -> tuple[float, float]:
    """The memory bandwidth and dense FP8 peak of the card named ``card`` (``CARD_PEAKS``)."""
    for known, peaks in CARD_PEAKS.items():
        if known in card:
            return peaks
    raise SystemExit(
        f"bench_decode: no datasheet peaks for the card {card!r} (CARD_PEAKS knows "
        f"{', '.join(CARD_PEAKS)}); add its memory bandwidth and dense FP8 peak there"
    )


def floor_us(name: str, ids: torch.Tensor) -> tuple[int, float]:
    """Active experts and the floor on this process's CUDA card (weights over bandwidth,
    FLOPs over FP8 peak)."""
    active = int(ids.unique().numel())
    return active, active_floor_us(name, active, ids.shape[0], torch.cuda.get_device_name())


def active_floor_us(name: str, active: int, tokens: int, card: str) -> float:
    """The floor of ``tokens`` tokens on ``active`` experts of layer ``name`` on ``card``."""
    _, top_k, hidden, inter, _, _ = LAYERS[name]
    weight_bytes = active * 3 * hidden * inter
    flops = 2 * tokens * top_k * 3 * hidden * inter
    bandwidth, fp8_flops = card_peaks(card)
    return 1e6 * max(weight_bytes / bandwidth, flops / fp8_flops)


def measure_layer(
    name: str, counts: list[int], args: argparse.Namespace, card: str
) -> list[dict[str, Any]]:
    max_tokens = max(counts)
    layers = [build_layer(name, 100 + i, max_tokens, "small_batch") for i in range(args.layers)]
    mega = [bare_megamoe(layer) for layer in layers]
    auto = layer_work(layers[0])
    limit = crossover_tokens(auto, max_tokens, card)
    print(f"{name}: {args.layers} layers, auto takes the small-batch path up to {limit} tokens",
          flush=True)  # fmt: skip
    rows = []
    for tokens in counts:
        x, weights, ids = routing(name, tokens, seed=tokens)
        active, floor = floor_us(name, ids)

        small = calls_in_turn(layers, x, weights, ids)
        megamoe = calls_in_turn(mega, x, weights, ids)
        graphs = {"small": small, "megamoe": megamoe} | grouped_peers(layers, ids, tokens)
        samplers = {
            key: back_to_back_sample(cuda_graph_replay(fn), args.reps) for key, fn in graphs.items()
        }
        samplers["small_eager"] = back_to_back_sample(small, args.reps)
        samplers["megamoe_eager"] = back_to_back_sample(megamoe, args.reps)
        times = interleaved_us(samplers, warmup=2, rounds=args.rounds)
        row: dict[str, Any] = {"layer": name, "tokens": tokens, "active": active, "floor": floor}
        row |= {key: value / args.layers for key, value in times.items()}
        row["limit"] = limit
        rows.append(finish_row(row))
        print(format_table(table_columns(), [[row.get(k) for _, _, k in COLUMNS]]).splitlines()[-1],
              flush=True)  # fmt: skip
    del layers, mega
    torch.cuda.empty_cache()
    return rows


def layer_of(name: str) -> LayerWork:
    """The layer ``name`` of ``LAYERS``, on one rank (every expert local)."""
    experts, top_k, hidden, inter = LAYERS[name][:4]
    return LayerWork(experts, experts, top_k, hidden, inter)


def rule_limit(name: str, max_tokens: int, card: str) -> int:
    """The most tokens this checkout's rule sends down the small-batch path for layer ``name``
    on ``card``."""
    return crossover_tokens(layer_of(name), max_tokens, card)


def path_taken(tokens: int, limit: int) -> str:
    """The path a call of ``tokens`` takes under ``limit`` (the experts module's own test)."""
    return PATH_SMALL_BATCH if takes_small_batch(tokens, limit) else PATH_MEGAMOE


def finish_row(row: dict[str, Any]) -> dict[str, Any]:
    """The chosen path (by the row's ``limit``) and the ratios."""
    chosen = path_taken(row["tokens"], row["limit"])
    chosen_us = row["small" if chosen == "small_batch" else "megamoe"]
    row |= {
        "chosen": chosen,
        "chosen_us": chosen_us,
        "chosen_floor": chosen_us / row["floor"],
        "small_floor": row["small"] / row["floor"],
        "chosen_megamoe": chosen_us / row["megamoe"],
        "chosen_masked": chosen_us / row["masked"] if row.get("masked") else None,
    }
    return row


def rechosen(row: dict[str, Any], max_tokens: int, card: str) -> dict[str, Any]:
    """A saved row with the path this checkout's rule takes and this checkout's floor (of the
    saved active experts, on the run's ``card``); its times are the saved ones."""
    floor = active_floor_us(row["layer"], row["active"], row["tokens"], card)
    limit = rule_limit(row["layer"], max_tokens, card)
    return finish_row(row | {"limit": limit, "floor": floor})


def block_chosen(row: dict[str, Any], max_tokens: int, card: str) -> dict[str, Any]:
    """A block row with ``auto``: the path this checkout's rule takes there on ``card``, and
    its time.

    ``max_tokens``: the blocks' ``max_num_tokens`` (the largest block count).
    """
    path = path_taken(row["tokens"], rule_limit(row["block"], max_tokens, card))
    return row | {"auto_path": path, "auto": row[path], "auto/megamoe": row[path] / row["megamoe"]}


def block_table(rows: list[dict[str, Any]]) -> str:
    """The block rows as a table."""
    columns = [("block", "<10"), ("tokens", ">6d"), ("small_batch", ">11.1f"),
               ("megamoe", ">8.1f"), ("auto", "<11"), ("auto us", ">8.1f"),
               ("auto/megamoe", ">6.2f")]  # fmt: skip
    keys = ("block", "tokens", "small_batch", "megamoe", "auto_path", "auto", "auto/megamoe")
    return format_table(columns, [[row[key] for key in keys] for row in rows])


def table_columns() -> list[tuple[str, str]]:
    return [(title, spec) for title, spec, _ in COLUMNS]


def measure_blocks(counts: list[int], args: argparse.Namespace, card: str) -> list[dict[str, Any]]:
    """Both blocks, graphed, on each experts path (router, shared expert, combine)."""
    import bench_block
    from megamoe.glm5next.adapter import ADAPTER as GLM
    from megamoe.qwen4exp.adapter import ADAPTER as QWEN

    rows = []
    for adapter, name in ((QWEN, "qwen4exp"), (GLM, "glm53flash")):
        experts, top_k, hidden, inter, _, shared = LAYERS[name]
        shape = argparse.Namespace(
            experts=experts, top_k=top_k, hidden=hidden, intermediate=inter,
            shared_intermediate=shared,
        )  # fmt: skip
        cfg = bench_block.config(adapter, shape)
        tensors = list(bench_block.tensors(adapter.name, shape))
        blocks = {
            path: build_block(adapter, cfg, tensors, max(counts), path)
            for path in (PATH_SMALL_BATCH, PATH_MEGAMOE)
        }
        del tensors
        for tokens in counts:
            x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
            samplers = {
                path: back_to_back_sample(cuda_graph_replay(calls_in_turn([block], x)), args.reps)
                for path, block in blocks.items()
            }
            times = interleaved_us(samplers, warmup=2, rounds=args.rounds)
            row = block_chosen({"block": name, "tokens": tokens} | times, max(counts), card)
            rows.append(row)
            print(f"block {name} {tokens:5d} tokens graphed: small_batch "
                  f"{times['small_batch']:.1f} us, megamoe {times['megamoe']:.1f} us, auto "
                  f"takes {row['auto_path']}", flush=True)  # fmt: skip
        del blocks
        torch.cuda.empty_cache()
    return rows


def build_block(
    adapter: Any, cfg: dict[str, Any], tensors: list[tuple[str, torch.Tensor]], tokens: int,
    path: str,
) -> Any:  # fmt: skip
    from megamoe.core.modules.parallel import ParallelSettings

    device = torch.device("cuda", 0)
    layer = next(m for m in adapter.moe_layers(cfg) if not m.is_mtp)
    block = adapter.block_class(
        cfg, prefix=layer.prefix, parallel=ParallelSettings(ep_group=resolve_group(None, device)),
        backend="deepgemm", device=device, max_num_tokens=tokens, experts_path=path,
    )  # fmt: skip
    block.load_weights(tensors)
    block.finalize()
    return block


def plot(rows: list[dict[str, Any]], path: str, card: str) -> None:
    """Time per layer against tokens, log-log, per model: each path and the floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({r["layer"] for r in rows})
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4.5), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        mine = [r for r in rows if r["layer"] == name]
        tokens = [r["tokens"] for r in mine]
        for key, style in (("small", "o-"), ("megamoe", "s-"), ("masked", "^--"),
                           ("contiguous", "v--")):  # fmt: skip
            points = [(r["tokens"], r[key]) for r in mine if r.get(key)]
            if points:
                ax.plot(*zip(*points, strict=True), style, label=key)
        ax.plot(tokens, [r["floor"] for r in mine], "k-", linewidth=2, label="floor")
        ax.set(xscale="log", yscale="log", xlabel="tokens per rank", ylabel="us per layer",
               title=f"{name}, one {card.removeprefix('NVIDIA ')}")  # fmt: skip
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    if args.from_json:
        report = json.loads(Path(args.from_json).read_text())
        rows, block_rows = report["rows"], report.get("blocks", [])
        max_tokens = max(row["tokens"] for row in rows)
        card = report.get("card", SAVED_CARD)
        rows = [rechosen(row, max_tokens, card) for row in rows]
        if block_rows:
            block_max = max(row["tokens"] for row in block_rows)
            block_rows = [block_chosen(row, block_max, card) for row in block_rows]
        print("chosen: this checkout's rule (backends.small_batch) on the saved times")
    else:
        torch.cuda.set_device(0)
        card = torch.cuda.get_device_name()
        print(f"card: {card}; floor at {card_peaks(card)[0] / 1e12:.2f} TB/s", flush=True)
        counts = [int(t) for t in args.tokens.split(",")]
        models = args.models.split(",")
        rows = [row for name in models for row in measure_layer(name, counts, args, card)]
        block_counts = [int(t) for t in args.blocks.split(",") if t]
        block_rows = measure_blocks(block_counts, args, card) if block_counts else []
        write_json(args.json, {"args": vars(args), "card": card, "rows": rows,
                               "blocks": block_rows})  # fmt: skip
    print(format_table(table_columns(), [[r.get(k) for _, _, k in COLUMNS] for r in rows]))
    if block_rows:
        print(block_table(block_rows))
    if args.plot:
        plot(rows, args.plot, card)


if __name__ == "__main__":
    main()
