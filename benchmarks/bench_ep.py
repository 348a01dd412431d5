"""Expert parallel over N ranks: one MoE layer at a real model's size, time, scaling and error.

Launched by torchrun, one process per GPU (without torchrun it runs as one rank):

    python benchmarks/bench_ep.py --model glm --json ep1.json                # one H200
    torchrun --nproc-per-node 8 benchmarks/bench_ep.py --model glm --redundant 32 \\
        --baseline ep1.json --json ep8.json                                 # 8 H200s, EPLB
    torchrun --nproc-per-node 4 benchmarks/bench_ep.py --backend reference --device cpu \\
        --toy --tokens 1,8,64                                               # CPU, gloo

Every rank builds the adapter's own MoE block (``block_class``, the class
``ModelAdapter.build_block`` constructs) from a synthetic block-FP8 config at the preset's
sizes, over the whole job as its expert-parallel group (``ParallelSettings``, with
``--redundant`` EPLB replicas), on the Hopper kernel (``--backend deepgemm``, NCCL) or the
torch reference backend (``--backend reference``, gloo on ``--device cpu``; it rounds
activations as the kernel does, ``emulate_kernel=True``). Presets:

- ``glm``: GLM-5.3-Flash, E=288, top-8, H=4096, I=2048, one shared expert, SwiGLU clamp 10;
- ``qwen``: Qwen4-Exp, E=512, top-10, H=2048, I=512, shared expert 512;
- ``deepgemm-ref``: DeepGEMM's published Hopper MegaMoE shape, E=256, top-6, H=4096,
  I=2048 (the Qwen4Exp block, timing its experts module only: the kernel call with the
  routing given, as DeepGEMM times it), beside their per-rank times.

``--toy`` keeps the preset's top-k and structure at H=256, I=128, E=32, shared 128.
``--part experts`` times ``block.experts`` alone (routing from the block's router, taken
once), ``--part block`` the whole block (router, shared expert, experts).

Weights come from ``--seed`` alone, identical on every rank: the router and shared expert
from the adapter's synthetic checkpoint, the routed experts generated on the device one
expert at a time. Each rank also builds the whole layer on one rank (a one-rank group,
every expert, reference backend with ``emulate_kernel=True``) and runs it on the same
tokens; the error is ``max |out - ref| / max |ref|`` of that rank's output. With
redundant experts, a forward pre-hook on the experts sends each (token, slot) of a
replicated expert to one of its replicas (``ReplicaSpread``; inside the timed call, as an
engine's EPLB remap is).

Per token count (tokens per rank): the CUDA-event median (wall clock on the CPU), the
largest over the ranks; tokens/s per GPU; the speed per GPU against one rank (a
``--baseline`` JSON from a one-rank run; a one-rank run is its own); each rank's error.
Rank 0 prints the table and writes ``--json``; exit 1 when an error exceeds ``--tolerance``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from harness import cuda_median_ms, format_table, write_json
from megamoe.core import testing
from megamoe.core.adapters import ModelAdapter, MoEBlock, SyntheticSizes
from megamoe.core.backends import symm_buffer
from megamoe.core.checkpoint.expert_names import EXPERT_PROJS, WEIGHT
from megamoe.core.cli.verify import max_rel_error, tolerance_for
from megamoe.core.modules.parallel import ParallelSettings, single_rank_group
from megamoe.core.numerics import quant
from megamoe.core.numerics.formats import WeightFormat
from megamoe.glm5next import ADAPTER as GLM
from megamoe.qwen4exp import ADAPTER as QWEN

FMT = WeightFormat.FP8_BLOCK
ADAPTERS = {a.name: a for a in (GLM, QWEN)}  # imported: a source checkout has no entry points
PARTS = ("block", "experts")
# The kernel against the emulating reference: the accepted error of block-FP8 experts run as
# stored (megamoe.core.cli.verify; two H200s gave 0.015 per rank as a ratio of norms).
KERNEL_TOLERANCE = tolerance_for(FMT, FMT)
# The reference backend over N ranks against one rank, both emulating the kernel: each
# expert's float32 GEMMs see other rows (every rank's tokens), which may move an output by
# one bf16 ulp (2^-8 relative) here and there; a misplaced expert or weight gives ~1.
REFERENCE_TOLERANCE = 2.0**-8
TOY = {"hidden_size": 256, "intermediate_size": 128, "num_experts": 32}
TOY_SHARED = 128  # shared-expert width at --toy sizes


@dataclasses.dataclass(frozen=True)
class Preset:
    """One layer shape to measure.

    Attributes:
        adapter: the adapter whose block runs it.
        sizes: its sizes (``num_layers=1``: one MoE layer).
        swiglu_limit: the SwiGLU clamp written into the config; None keeps the adapter's.
        part: what is timed by default, ``block`` or ``experts``.
        published_us: per-rank microseconds published for this shape, by tokens per rank.
    """

    adapter: str
    sizes: SyntheticSizes
    swiglu_limit: float | None = None
    part: str = "block"
    published_us: dict[int, float] = dataclasses.field(default_factory=dict)


PRESETS = {
    "glm": Preset("glm5next", SyntheticSizes(1, 4096, 2048, 288, 8, 2048), swiglu_limit=10.0),
    "qwen": Preset("qwen4exp", SyntheticSizes(1, 2048, 512, 512, 10, 512)),
    # The shared expert is built (the block has one) but not run by --part experts.
    "deepgemm-ref": Preset(
        "qwen4exp",
        SyntheticSizes(1, 4096, 2048, 256, 6, 128),
        part="experts",
        published_us={8: 225.0, 128: 265.0, 4096: 1739.0},
    ),
}


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(PRESETS), default="glm")
    p.add_argument("--toy", action="store_true", help="H=256, I=128, E=32 (CPU, CI)")
    p.add_argument("--backend", choices=("deepgemm", "reference"), default="deepgemm")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tokens", default="1,8,128,1024,4096", help="tokens per rank")
    p.add_argument("--redundant", type=int, default=0, help="EPLB replicas (physical - E)")
    p.add_argument("--part", choices=PARTS, help="what is timed (default: the preset's)")
    p.add_argument("--baseline", help="JSON of a one-rank run of the same layer")
    p.add_argument("--tolerance", type=float, help="largest error accepted per rank")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the report here (rank 0)")
    args = p.parse_args(argv)
    args.counts = _token_counts(p, args.tokens)
    preset = PRESETS[args.model]
    args.part = args.part or preset.part
    args.world = int(os.environ.get("WORLD_SIZE", "1"))
    experts = layer_sizes(args).num_experts
    if args.redundant < 0 or (experts + args.redundant) % args.world:
        fit = max(args.redundant, 0)
        fit += -(experts + fit) % args.world
        p.error(
            f"--redundant {args.redundant}: needs R >= 0 with {experts} + R physical "
            f"experts splitting evenly over {args.world} ranks; try --redundant {fit}"
        )
    if args.backend == "deepgemm" and args.device != "cuda":
        p.error(
            "--backend deepgemm runs the Hopper kernel and needs --device cuda; on the CPU "
            "use --backend reference --device cpu"
        )
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device; use --backend reference --device cpu")
    if args.reps < 1 or args.warmup < 0:
        p.error(f"--reps {args.reps} --warmup {args.warmup}: need reps >= 1 and warmup >= 0")
    args.baseline_us = None
    if args.baseline and args.world == 1:
        p.error(f"--baseline {args.baseline}: a one-rank run is its own baseline; drop it")
    if args.baseline:
        try:
            args.baseline_us = load_baseline(args.baseline, layer_key(args))
        except (OSError, ValueError, KeyError) as exc:
            p.error(str(exc))
    return args


def _token_counts(p: argparse.ArgumentParser, text: str) -> list[int]:
    try:
        counts = [int(t) for t in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        p.error(f"--tokens {text!r}: expected positive integers separated by commas, e.g. 1,8,128")
    return counts


def layer_sizes(args: argparse.Namespace) -> SyntheticSizes:
    """The preset's sizes, or its toy version."""
    sizes = PRESETS[args.model].sizes
    if not args.toy:
        return sizes
    shared = TOY_SHARED if sizes.shared_intermediate_size else 0
    return dataclasses.replace(sizes, **TOY, shared_intermediate_size=shared)


def layer_config(args: argparse.Namespace) -> dict[str, Any]:
    """The adapter's synthetic block-FP8 ``config.json`` at the layer's sizes."""
    preset = PRESETS[args.model]
    config = ADAPTERS[preset.adapter].synthetic_config(FMT, layer_sizes(args))
    if preset.swiglu_limit is not None:
        config["text_config"]["swiglu_limit"] = preset.swiglu_limit
    return config


class ReplicaSpread:
    """A forward pre-hook on a block's experts: logical expert ids to physical replicas.

    Physical expert ``p`` holds logical expert ``p % E`` (``ParallelSettings``); logical
    ``e`` has the replicas ``e, e + E, ...`` below the physical count. Slot ``k`` of token
    ``t`` goes to replica ``(t + k) mod copies(e)``: replicated experts split their traffic
    evenly, and one table lookup per forward does it.

    Args:
        num_logical: E.
        num_physical: E plus the redundant experts.
        max_tokens: most tokens per forward.
        top_k: slots per token.
        device: where the ids live.
    """

    def __init__(
        self, num_logical: int, num_physical: int, max_tokens: int, top_k: int, device: torch.device
    ) -> None:
        copies = -(-num_physical // num_logical)
        logical = torch.arange(num_logical)
        count = (num_physical - 1 - logical) // num_logical + 1
        replica = torch.arange(copies)[:, None] % count[None, :]
        self.table = (logical[None, :] + num_logical * replica).to(device, torch.int32)
        phase = torch.arange(max_tokens)[:, None] + torch.arange(top_k)[None, :]
        self.phase = (phase % copies).to(device)

    def __call__(self, module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden_states, topk_weights, topk_ids = args
        return hidden_states, topk_weights, self.table[self.phase[: len(topk_ids)], topk_ids]


def init_distributed(device_kind: str) -> tuple[torch.device, bool]:
    """Join torchrun's job (NCCL on CUDA, gloo on the CPU), or run as one rank.

    Returns:
        The device, and whether this call initialized ``torch.distributed`` (a caller
        that had, e.g. a test calling ``main``, keeps its group).
    """
    created = not dist.is_initialized()
    if "WORLD_SIZE" not in os.environ:
        device = torch.device(device_kind, 0) if device_kind == "cuda" else torch.device("cpu")
        single_rank_group(device)
    elif device_kind == "cpu":
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    return device, created


def _seed(*parts: object) -> int:
    """A stable seed for one tensor, the same on every rank."""
    return zlib.crc32(repr(parts).encode())


def dense_tensors(
    adapter: ModelAdapter, config: dict[str, Any], prefix: str, seed: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """The layer's non-expert tensors (router, shared expert) from the synthetic checkpoint.

    The adapter yields them before the layer's routed experts, which are made on the device
    instead (``routed_tensors``): the walk stops at the first of them.
    """
    head = f"{prefix}."
    for name, tensor in adapter.synthetic_tensors(config, seed=seed):
        if name.startswith(head):
            if name.startswith(f"{head}experts."):
                return
            yield name.removeprefix(head), tensor


def routed_tensors(
    sizes: SyntheticSizes, seed: int, device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """Block-FP8 routed experts, one projection at a time, each from (seed, expert, name).

    Magnitudes differ per expert (1x to 1.75x ``testing.WEIGHT_STD``), so a misplaced
    expert shows in the error.
    """
    h, i = sizes.hidden_size, sizes.intermediate_size
    shapes = dict(zip(EXPERT_PROJS, ((i, h), (i, h), (h, i)), strict=True))
    gen = torch.Generator(device=device)
    for expert in range(sizes.num_experts):
        std = testing.WEIGHT_STD * (1.0 + 0.25 * (expert % 4))
        for proj, shape in shapes.items():
            gen.manual_seed(_seed(seed, expert, proj))
            dense = torch.randn(shape, generator=gen, device=device) * std
            name = f"experts.{expert}.{proj}"
            values, scale = quant.quantize_fp8_block(dense, name=name)
            yield f"{name}.{WEIGHT}", values
            yield f"{name}.{FMT.scale_name}", scale


def build_layers(args: argparse.Namespace, device: torch.device) -> tuple[MoEBlock, MoEBlock]:
    """This rank's block over the job, and the whole layer on this rank alone (reference)."""
    adapter = ADAPTERS[PRESETS[args.model].adapter]
    config = layer_config(args)
    layer = next(m for m in adapter.moe_layers(config) if not m.is_mtp)
    world, rank = dist.get_world_size(), dist.get_rank()
    # new_group is collective: every rank creates every one-rank group, keeps its own.
    alone = [dist.new_group([r]) for r in range(world)][rank]
    options = {"device": device, "max_num_tokens": max(args.counts)}
    parallel = ParallelSettings(ep_group=dist.group.WORLD, num_redundant_experts=args.redundant)
    ep = adapter.block_class(
        config, prefix=layer.prefix, parallel=parallel, backend=args.backend,
        emulate_kernel=args.backend == "reference", **options,
    )  # fmt: skip
    ref = adapter.block_class(
        config, prefix=layer.prefix, parallel=ParallelSettings(ep_group=alone),
        backend="reference", emulate_kernel=True, **options,
    )  # fmt: skip
    sizes = layer_sizes(args)
    dense = dense_tensors(adapter, config, layer.prefix, args.seed)
    for tensors in (dense, routed_tensors(sizes, args.seed, device)):
        for name, tensor in tensors:
            tensor = tensor.to(device)
            if ep.wants(name):
                ep.load_weights([(name, tensor)])
            ref.load_weights([(name, tensor)])
    ep.finalize()
    ref.finalize()
    if args.redundant:
        physical = sizes.num_experts + args.redundant
        spread = ReplicaSpread(sizes.num_experts, physical, max(args.counts), sizes.top_k, device)
        ep.experts.register_forward_pre_hook(spread)
    return ep, ref


def routing_of(block: MoEBlock, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (weights, logical ids) the block's router hands its experts for ``x``."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def record(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        seen.append((args[1], args[2]))

    handle = block.experts.register_forward_pre_hook(record, prepend=True)
    try:
        block(x)
    finally:
        handle.remove()
    return seen[0]


def median_us(fn: Callable[[], object], device: torch.device, warmup: int, reps: int) -> float:
    """Median microseconds of ``fn``: CUDA events on a GPU, wall clock on the CPU."""
    if device.type == "cuda":
        return 1e3 * cuda_median_ms(fn, warmup, reps)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def measure(
    args: argparse.Namespace, ep: MoEBlock, ref: MoEBlock, count: int, device: torch.device
) -> dict[str, float]:
    """This rank's time and error at ``count`` tokens (every rank calls it together)."""
    hidden = layer_sizes(args).hidden_size
    gen = torch.Generator(device=device).manual_seed(
        _seed(args.seed, "tokens", dist.get_rank(), count)
    )
    x = torch.randn(count, hidden, generator=gen, device=device).to(torch.bfloat16)
    with torch.no_grad():
        if args.part == "block":
            want = ref(x)
            run: Callable[[], torch.Tensor] = lambda: ep(x)  # noqa: E731
        else:
            weights, ids = routing_of(ep, x)
            want = ref.experts(x, weights, ids)
            run = lambda: ep.experts(x, weights, ids)  # noqa: E731
        error = max_rel_error(run(), want)
        dist.barrier()
        us = median_us(run, device, args.warmup, args.reps)
    return {"us": us, "error": error}


def layer_key(args: argparse.Namespace) -> dict[str, Any]:
    """What a one-rank baseline must share with this run (redundant experts may differ)."""
    sizes = layer_sizes(args)
    return {
        "model": args.model, "toy": args.toy, "part": args.part, "backend": args.backend,
        "device": args.device, "experts": sizes.num_experts, "top_k": sizes.top_k,
        "hidden": sizes.hidden_size, "intermediate": sizes.intermediate_size,
        "shared_intermediate": sizes.shared_intermediate_size,
        "swiglu_limit": PRESETS[args.model].swiglu_limit,
    }  # fmt: skip


def load_baseline(path: str, layer: dict[str, Any]) -> dict[int, float]:
    """Microseconds per token count of a one-rank run of the same layer.

    Raises:
        ValueError: the file is not such a run (names what differs and the command to run).
    """
    report = json.loads(Path(path).read_text())
    fix = f"make it with: python benchmarks/bench_ep.py {_layer_flags(layer)} --json {path}"
    if report.get("world_size") != 1:
        raise ValueError(
            f"--baseline {path}: a run of {report.get('world_size')} ranks, expected one; {fix}"
        )
    if report.get("layer") != layer:
        differ = sorted(k for k in layer if report.get("layer", {}).get(k) != layer[k])
        raise ValueError(
            f"--baseline {path}: another layer (differs in {', '.join(differ)}); {fix}"
        )
    return {int(row["tokens"]): float(row["us"]) for row in report["rows"]}


def _layer_flags(layer: dict[str, Any]) -> str:
    flags = f"--model {layer['model']} --backend {layer['backend']} --device {layer['device']}"
    flags += f" --part {layer['part']}"
    return flags + (" --toy" if layer["toy"] else "")


def report_rows(
    args: argparse.Namespace,
    per_rank: list[list[dict[str, float]]],
    baseline: dict[int, float] | None,
    tolerance: float,
) -> list[dict[str, Any]]:
    """One row per token count from every rank's measurements (``per_rank[rank][i]``)."""
    published = PRESETS[args.model].published_us if not args.toy else {}
    rows = []
    for i, count in enumerate(args.counts):
        times = [rank[i]["us"] for rank in per_rank]
        errors = [rank[i]["error"] for rank in per_rank]
        us = max(times)
        base = us if baseline is None and args.world == 1 else (baseline or {}).get(count)
        rows.append({
            "tokens": count,
            "us": us,
            "us_per_rank": times,
            "tokens_per_s_per_gpu": count / us * 1e6,
            "vs_one_rank": None if base is None else base / us,
            "published_us": published.get(count),
            "max_rel_error_per_rank": errors,
            "ok": all(e <= tolerance for e in errors),
        })  # fmt: skip
    return rows


def print_table(rows: list[dict[str, Any]], with_published: bool) -> None:
    columns = [
        ("tokens/rank", ">11d", "tokens"),
        ("us (max over ranks)", ">19.1f", "us"),
        ("tokens/s per GPU", ">16.0f", "tokens_per_s_per_gpu"),
        ("vs 1 rank", ">9.2f", "vs_one_rank"),
    ]
    if with_published:
        columns.append(("DeepGEMM us", ">11.0f", "published_us"))
    columns += [("result", "<6", "result"), ("max rel. error per rank", "<23", "errors")]
    cells = []
    for row in rows:
        view = dict(row)
        view["errors"] = " ".join(f"{e:.1e}" for e in row["max_rel_error_per_rank"])
        view["result"] = "ok" if row["ok"] else "FAIL"
        cells.append([view[key] for _, _, key in columns])
    print(format_table([(title, spec) for title, spec, _ in columns], cells))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    device, created = init_distributed(args.device)
    rank, sizes = dist.get_rank(), layer_sizes(args)
    tolerance = args.tolerance
    if tolerance is None:
        tolerance = KERNEL_TOLERANCE if args.backend == "deepgemm" else REFERENCE_TOLERANCE
    ep, ref = build_layers(args, device)
    mine = [measure(args, ep, ref, count, device) for count in args.counts]
    per_rank: list[Any] = [None] * args.world
    dist.all_gather_object(per_rank, mine)
    rows = report_rows(args, per_rank, args.baseline_us, tolerance)
    if rank == 0:
        experts = ep.experts
        print(
            f"{args.model}{' (toy)' if args.toy else ''}: E={sizes.num_experts}+"
            f"{args.redundant} redundant, top-{sizes.top_k}, H={sizes.hidden_size}, "
            f"I={sizes.intermediate_size}, shared {sizes.shared_intermediate_size}, "
            f"{experts.weight_format.value} on {experts.backend.name} ({device.type}); "
            f"{args.world} rank(s), {experts.num_local_experts} experts per rank; timed: "
            f"{args.part}; error vs one rank, reference emulating the kernel (tol. {tolerance:g})"
        )
        print_table(rows, with_published=any(r["published_us"] for r in rows))
        if args.json:
            write_json(args.json, {
                "layer": layer_key(args), "world_size": args.world, "redundant": args.redundant,
                "experts_per_rank": experts.num_local_experts, "tolerance": tolerance,
                "run_format": experts.weight_format.value, "rows": rows,
            })  # fmt: skip
    del ep, ref
    dist.barrier()
    if created:
        symm_buffer.clear_symm_buffers()
        dist.destroy_process_group()
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
