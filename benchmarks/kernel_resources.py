"""What the small-batch kernels hold on one Hopper SM, compiled for sm90 on any machine.

Triton compiles ahead of time without a GPU (its wheel ships ``ptxas`` and ``cuobjdump``):
for each tile shape (``megamoe.core.kernels.experts_small_batch``: the three the tile rule
picks, or ``--tiles`` variants written ``NAME:field=value,...`` over one of them) and each
real layer (Qwen4-Exp, GLM-5.3-Flash), l1 and l2 as the experts path launches them at that
shape (grouped pairs, the tiles' warps and stages), with

- ``regs``: registers per thread (255 is the most a thread can have);
- ``stack``: bytes of stack per thread, where registers spill (0: none);
- ``smem``: shared memory per program, bytes;
- ``fit``: programs one SM holds at once, the least of what its 65536 registers (allocated
  per warp in steps of 256), its 228 KB of shared memory (1 KB reserved per program) and
  its 64 warps allow;
- ``launched``: programs per SM the persistent tiles start (``Tiles.l1_per_sm``,
  ``Tiles.l2_per_sm``), where more than ``fit`` start only as others end;
- ``in_flight``: the most tensor-core dot groups the kernel leaves running at a wait
  (``wgmma.wait_group N`` in its PTX). 0: each step's dot is waited for before the next
  is issued, so a program's tensor-core work and its other work take turns (what a block
  scale applied to each step's dot makes Triton's pipeliner do); 1: the next dot runs
  while this one's result is used.

    python benchmarks/kernel_resources.py --json resources.json
    python benchmarks/kernel_resources.py --tiles BATCH_TILES:block_m=64,stages=4
    python benchmarks/kernel_resources.py --tiles BATCH_TILES:l2_per_sm=4
    python benchmarks/kernel_resources.py --probe unscaled --tiles WIDE_TILES

``--probe`` compiles the kernels with a timing probe's edits (``PROBE_EDITS``; the probes
``bench_tiles.py --probes`` times, whose outputs are wrong by design).

Run it without ``TRITON_INTERPRET`` (the interpreter compiles nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from bench_decode import LAYERS
from harness import format_table, write_json
from megamoe.core.kernels import experts_small_batch as kernels
from megamoe.core.kernels.launch import jit_options

SM90 = GPUTarget("cuda", 90, 64)
REGISTERS_PER_SM = 65536
REGISTER_STEP = 256  # registers are allocated per warp in steps of this many
SHARED_PER_SM = 233472  # 228 KB
SHARED_RESERVED = 1024  # per program
WARPS_PER_SM = 64
PRODUCTION = ("DECODE_TILES", "MIDSIZE_TILES", "BATCH_TILES", "WIDE_TILES")
COLUMNS = [
    ("layer", "<10"),
    ("tiles", "<40"),
    ("kernel", "<6"),
    ("warps", ">5d"),
    ("stages", ">6d"),
    ("regs", ">4d"),
    ("stack", ">5d"),
    ("smem", ">6d"),
    ("fit", ">3d"),
    ("launched", ">8"),
    ("in_flight", ">9d"),
]
WGMMA_WAIT = re.compile(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)")
# Timing probes (``bench_tiles.py --probes``, docstring there): the kernels' source with
# production lines replaced, outputs wrong by design. Each edit: (the production line, the
# probe's), the production line found exactly once.
PROBE_EDITS = {
    "unscaled": [
        ("acc += tl.dot(x, tl.trans(w)) * (w_scale[None, :] * x_scale[:, None])",
         "acc = tl.dot(x, tl.trans(w), acc)"),
        ("acc += tl.dot(w, tl.trans(x)) * (w_scale[:, None] * x_scale[None, :])",
         "acc = tl.dot(w, tl.trans(x), acc)"),
        ("acc += tl.dot(act, tl.trans(w)) * (act_scale[:, None] * tl.load(scales + kb // 2))",
         "acc = tl.dot(act, tl.trans(w), acc)"),
        ("acc += tl.dot(w, tl.trans(act)) * (act_scale[None, :] * tl.load(scales + kb // 2))",
         "acc = tl.dot(w, tl.trans(act), acc)"),
    ],
    "weights_in_l2": [
        ("w_row = expert * (2 * INTERMEDIATE) + tile * 128", "w_row = tile * 128"),
        ("w_row = expert * HIDDEN + tile * BLOCK_N", "w_row = tile * BLOCK_N"),
    ],
}  # fmt: skip


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiles", default=",".join(PRODUCTION).replace(",", " "),
                   help="tile shapes, space-separated: NAME or NAME:field=value,...")  # fmt: skip
    p.add_argument("--layers", default="qwen4exp,glm53flash")
    p.add_argument("--probe", default="",
                   help=f"compile with a timing probe's edits: {', '.join(PROBE_EDITS)}, or "
                   "several joined by +")  # fmt: skip
    p.add_argument("--json", default="", help="write the rows here")
    return p.parse_args(argv)


def probe_kernels(probe: str, folder: Path) -> ModuleType:
    """The small-batch kernels' module with ``probe``'s edits (``PROBE_EDITS`` names joined by +).

    Written into ``folder`` and imported from there: Triton compiles a kernel from its
    function's source file, so the edited kernels need a file of their own.

    Raises:
        SystemExit: an unknown probe, or an edit whose production line the kernels no longer
            hold once (the probe must be brought up to date with them).
    """
    source = Path(kernels.__file__).read_text()
    for name in probe.split("+"):
        if name not in PROBE_EDITS:
            raise SystemExit(f"probe {name!r}: no such probe; one of {', '.join(PROBE_EDITS)}")
        for production, edited in PROBE_EDITS[name]:
            if source.count(production) != 1:
                raise SystemExit(
                    f"probe {name}: the kernels hold {source.count(production)} of "
                    f"{production!r} (need exactly one): update PROBE_EDITS in kernel_resources.py"
                )
            source = source.replace(production, edited)
    module_name = "probe_" + probe.replace("+", "_")
    path = folder / f"{module_name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # the dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def tile_shape(spec: str) -> tuple[str, kernels.Tiles]:
    """``NAME`` or ``NAME:field=value,...``: a module tile shape, or one with fields changed."""
    name, _, changes = spec.partition(":")
    base = getattr(kernels, name, None)
    if not isinstance(base, kernels.Tiles):
        raise SystemExit(f"--tiles: {name!r} is no tile shape; one of {', '.join(PRODUCTION)}")
    fields: dict[str, Any] = {}
    for change in filter(None, changes.split(",")):
        field, _, value = change.partition("=")
        if field not in {f.name for f in dataclasses.fields(kernels.Tiles)}:
            raise SystemExit(f"--tiles {spec}: Tiles has no field {field!r}")
        fields[field] = value == "True" if value in ("True", "False") else int(value)
    return spec, dataclasses.replace(base, **fields)


def _compile(fn: Any, types: dict[str, str], constexprs: dict[str, Any], tiles: Any, stages: int):
    missing = [name for name in fn.arg_names if name not in types and name not in constexprs]
    if missing:
        raise RuntimeError(f"{fn.__name__}: no value for {', '.join(missing)}")
    signature = dict.fromkeys(fn.arg_names, "constexpr") | types
    # the JIT's specialization of the launches: every pointer 16-byte aligned
    aligned = {(fn.arg_names.index(name),): [["tt.divisibility", 16]]
               for name, kind in types.items() if kind.startswith("*")}  # fmt: skip
    options = jit_options(tiles.warps, stages, tiles.pdl, tiles.max_registers)
    source = ASTSource(fn, signature, constexprs, aligned)
    return triton.compile(source, target=SM90, options=options)


def compiled_kernels(
    tiles: kernels.Tiles, layer: str, module: ModuleType = kernels
) -> dict[str, Any]:
    """l1 and l2 for ``layer``'s shape, as the experts path launches them with ``tiles``.

    ``module``: where the kernels come from (``probe_kernels``' edited copies, say).
    """
    experts, top_k, hidden, inter, limit, _ = LAYERS[layer]
    per_expert = tiles.pdl and not tiles.persistent  # where l1 runs in more than one wave
    common = {"NUM_EXPERTS": experts, "HIDDEN": hidden, "INTERMEDIATE": inter,
              "BLOCK_M": tiles.block_m, "SCAN": False, "PAIRS": 16, "PDL": tiles.pdl,
              "PERSISTENT": tiles.persistent, "PER_EXPERT": per_expert,
              "CLAIM": tiles.claim, "TOKEN_ROWS": tiles.token_rows}  # fmt: skip
    pointers = {"ids_ptr": "*i32", "table_ptr": "*i32", "l1_done_ptr": "*i32",
                "num_pairs": "i32", "first_expert": "i32"}  # fmt: skip
    l1_types = pointers | {
        "x_ptr": "*fp8e4nv", "x_scale_ptr": "*fp32", "w13_scale_ptr": "*fp32",
        "w13_desc": f"tensordesc<fp8e4nv[{2 * kernels.BLOCK_N1}, {kernels.SCALE_BLOCK}]>",
        "weights_ptr": "*fp32", "act_ptr": "*fp8e4nv", "act_scale_ptr": "*fp32",
    }  # fmt: skip
    l1_constexprs = common | {"TOP_K": top_k, "CLAMP": limit is not None,
                              "LIMIT": 0.0 if limit is None else limit}  # fmt: skip
    l2_types = pointers | {
        "act_ptr": "*fp8e4nv", "act_scale_ptr": "*fp32", "w2_scale_ptr": "*fp32",
        "w2_desc": f"tensordesc<fp8e4nv[{tiles.block_n2}, {kernels.ACT_GROUP}]>",
        "y_ptr": "*bf16",
    }  # fmt: skip
    l2_constexprs = common | {"BLOCK_N": tiles.block_n2, "STEP": tiles.l2_step}
    return {
        "l1": _compile(module._l1_kernel, l1_types, l1_constexprs, tiles, tiles.stages),
        "l2": _compile(
            module._l2_kernel, l2_types, l2_constexprs, tiles, kernels.l2_stages(tiles, inter)
        ),
    }


def resources(compiled: Any, cuobjdump: str) -> tuple[int, int]:
    """Registers and stack bytes per thread of a compiled kernel (``cuobjdump -res-usage``)."""
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        report = subprocess.run(
            [cuobjdump, "-res-usage", str(cubin)], capture_output=True, text=True, check=True
        ).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", report)
    if found is None:
        raise RuntimeError(f"cuobjdump -res-usage printed no REG/STACK line:\n{report}")
    return int(found.group(1)), int(found.group(2))


def dots_in_flight(ptx: str) -> int:
    """The most ``wgmma`` groups left running at any ``wgmma.wait_group`` of ``ptx``.

    Raises:
        ValueError: ``ptx`` waits on no ``wgmma`` (a kernel with no Hopper tensor-core dot).
    """
    pending = [int(n) for n in WGMMA_WAIT.findall(ptx)]
    if not pending:
        raise ValueError("the PTX has no wgmma.wait_group: no Hopper tensor-core dot was emitted")
    return max(pending)


def programs_per_sm(regs: int, smem: int, warps: int) -> int:
    """Programs of ``warps`` warps one sm90 SM holds at once."""
    per_warp = -(-regs * 32 // REGISTER_STEP) * REGISTER_STEP
    by_registers = REGISTERS_PER_SM // (per_warp * warps)
    by_shared = SHARED_PER_SM // (smem + SHARED_RESERVED)
    return min(by_registers, by_shared, WARPS_PER_SM // warps)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    args = parse(argv)
    cuobjdump = str(Path(triton.__path__[0]) / "backends" / "nvidia" / "bin" / "cuobjdump")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        module = probe_kernels(args.probe, Path(folder)) if args.probe else kernels
        print(format_table(COLUMNS, []), flush=True)
        for layer in args.layers.split(","):
            for spec in args.tiles.split():
                rows += _layer_rows(layer, spec, module, cuobjdump)
    if args.json:
        write_json(args.json, rows)
    return rows


def _layer_rows(layer: str, spec: str, module: ModuleType, cuobjdump: str) -> list[dict[str, Any]]:
    """The rows of ``layer``'s l1 and l2 compiled with tile shape ``spec``, each printed."""
    name, tiles = tile_shape(spec)
    rows = []
    for kernel, compiled in compiled_kernels(tiles, layer, module).items():
        regs, stack = resources(compiled, cuobjdump)
        smem, stages = compiled.metadata.shared, compiled.metadata.num_stages
        launched = getattr(tiles, f"{kernel}_per_sm") if tiles.persistent else "-"
        rows.append({
            "layer": layer, "tiles": name, "kernel": kernel, "warps": tiles.warps,
            "stages": stages, "regs": regs, "stack": stack, "smem": smem,
            "fit": programs_per_sm(regs, smem, tiles.warps), "launched": str(launched),
            "in_flight": dots_in_flight(compiled.asm["ptx"]),
        })  # fmt: skip
        print(format_table(COLUMNS, [[rows[-1][c] for c, _ in COLUMNS]]).splitlines()[-1],
              flush=True)  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
