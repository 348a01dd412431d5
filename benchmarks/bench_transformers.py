"""Qwen4-Exp and GLM-5.3-Flash in transformers: prefill and decode per experts implementation.

For each model in ``--models``: the release's layer sizes (transformers 5.24.0's config
defaults: Qwen4-Exp H=2048, 512 experts, top-10, I=512; GLM-5.3-Flash H=4096, 288
experts, top-8, I=2048, SwiGLU clamp 10) with ``--layers`` decoder layers, every one MoE
(the last one full attention, the others linear), random weights written as BF16. Each
``--weights`` loads that checkpoint once:

- ``bf16``: as written; megamoe quantizes the experts to block-FP8 (128x128) as it takes
  them over, transformers' implementations run them in BF16;
- ``fp8``: the experts quantized to block-FP8 by transformers while loading
  (``FineGrainedFP8Config``, every other linear left in BF16), as the GLM-5.3-Flash release
  stores them; megamoe runs them as stored. transformers' own FP8 experts run through its
  finegrained-fp8 Triton kernel, which the ``kernels`` package fetches from the Hugging
  Face Hub: where that cannot be reached their rows say so.

One loaded model runs each implementation in turn: ``eager``, ``grouped_mm``,
transformers' ``deepgemm``, then ``megamoe`` (last: it takes the experts' weights over;
``prepare`` builds every layer for ``--prefill`` tokens per call).

- prefill: one forward of 1 x ``--prefill`` tokens (a fresh cache each time);
- decode: one token per step after that prefill (the cache grows), ``--decode-steps``;
- experts: the part of each inside the experts modules (CUDA events around every call);
- setup: switching the implementation (megamoe: building every layer's experts);
- resident: memory allocated before the prefill (weights, megamoe's buffer); peak: the
  most allocated during one prefill.

CUDA-event medians after warm-up; without a CUDA device the script says so and exits 0.
An implementation that cannot run here is reported as
such (transformers' ``deepgemm`` loads its kernel from the Hugging Face Hub through the
``kernels`` package). Needs a CUDA device, transformers 5.24.0, accelerate and, for
megamoe's kernel, sgl-deep-gemm; at 2 layers GLM-5.3-Flash takes about 35 GiB of GPU
memory while its BF16 weights are written, and as much ``--workdir`` space (Qwen4-Exp 10).

    python benchmarks/bench_transformers.py                      # both models, 2 layers
    python benchmarks/bench_transformers.py --models qwen4_exp --weights fp8 --json t.json
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers.utils.quantization_config import FineGrainedFP8Config

import megamoe.transformers
from harness import format_table, write_json
from megamoe.transformers.loaded_experts import is_experts_module

IMPLEMENTATIONS = ("eager", "grouped_mm", "deepgemm", megamoe.transformers.IMPLEMENTATION)
WEIGHTS = ("bf16", "fp8")
# Block-FP8 for the routed experts only: every other module matches the pattern and is kept.
FP8_EXPERTS = FineGrainedFP8Config(
    weight_block_size=[128, 128], modules_to_not_convert=[r"(?!.*\.mlp\.experts$).*"]
)
GIB = 2**30
COLUMNS = (
    ("model", "<13"),
    ("weights", "<7"),
    ("experts", "<10"),
    ("setup s", ">7.1f"),
    ("prefill ms", ">10.1f"),
    ("experts ms", ">10.1f"),
    ("decode ms", ">9.2f"),
    ("experts ms ", ">11.2f"),
    ("resident GiB", ">12.2f"),
    ("peak GiB", ">8.2f"),
    ("note", "<"),
)
KEYS = (
    "model",
    "weights",
    "implementation",
    "setup_s",
    "prefill_ms",
    "prefill_experts_ms",
    "decode_ms",
    "decode_experts_ms",
    "resident_gib",
    "prefill_peak_gib",
    "note",
)


def _attention_layers(layers: int) -> list[str]:
    """Linear attention, then one full-attention layer (the models' own 3:1 pattern, cut)."""
    return ["linear_attention"] * (layers - 1) + ["indexed_attention"]


def build_config(model: str, layers: int) -> tuple[type, Any]:
    """The model class and its config at the release's sizes, ``layers`` MoE layers."""
    if model == "qwen4_exp":
        config = transformers.Qwen4ExpTextConfig(
            num_hidden_layers=layers,
            layer_types=_attention_layers(layers),
            # QSA indexer of the full-attention layer (the config has no default).
            indexer_n_heads=16,
            indexer_kv_heads=1,
            indexer_head_dim=256,  # at least the rotary dimension (head_dim 256)
            indexer_budget=2048,
            indexer_compress_ratio=4,
        )
        return transformers.Qwen4ExpForCausalLM, config
    if model == "glm5_next":
        text = dict(
            num_hidden_layers=layers,
            layer_types=_attention_layers(layers),
            indexer_types=["full"] * layers,
            mlp_layer_types=["sparse"] * layers,
        )
        config = transformers.Glm5NextConfig(text_config=text, vision_config=dict(depth=1))
        return transformers.Glm5NextForConditionalGeneration, config
    raise ValueError(f"--models: unknown model {model!r}; expected qwen4_exp or glm5_next")


def write_checkpoint(model: str, layers: int, path: Path) -> type:
    """Random BF16 weights (transformers' own init, on the GPU) saved to ``path``."""
    cls, config = build_config(model, layers)
    with torch.device("cuda"):
        built = cls._from_config(config, dtype=torch.bfloat16)
    built.save_pretrained(path)
    del built
    gc.collect()
    torch.cuda.empty_cache()
    return cls


class ExpertsTimer:
    """CUDA events around every call of the model's experts modules."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.hooks = []
        for module in model.modules():
            if is_experts_module(module):
                self.hooks.append(module.register_forward_pre_hook(self._start))
                self.hooks.append(module.register_forward_hook(self._end))

    def _start(self, *_: object) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.pairs.append((event, event))

    def _end(self, *_: object) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.pairs[-1] = (self.pairs[-1][0], event)

    def take_ms(self) -> float:
        """Milliseconds inside the experts since the last call (synchronizes)."""
        torch.cuda.synchronize()
        total = sum(start.elapsed_time(end) for start, end in self.pairs)
        self.pairs.clear()
        return total

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()


def timed(fn: Callable[..., Any], **kwargs: Any) -> tuple[Any, float]:
    """``fn(**kwargs)`` and its milliseconds (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn(**kwargs)
    end.record()
    end.synchronize()
    return out, start.elapsed_time(end)


def measure(model: torch.nn.Module, args: argparse.Namespace) -> dict[str, float]:
    """Prefill and decode medians, their experts share, resident and peak memory."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (1, args.prefill), generator=gen, device="cuda")
    timer = ExpertsTimer(model)
    result: dict[str, float] = {"resident_gib": torch.cuda.memory_allocated() / GIB}
    prefill, prefill_experts, peaks = [], [], []
    with torch.inference_mode():
        for rep in range(args.warmup + args.reps):
            torch.cuda.reset_peak_memory_stats()
            out, ms = timed(model, input_ids=ids, use_cache=True, logits_to_keep=1)
            experts_ms = timer.take_ms()
            if rep >= args.warmup:
                prefill.append(ms)
                prefill_experts.append(experts_ms)
                peaks.append(torch.cuda.max_memory_allocated() / GIB)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        decode, decode_experts = [], []
        for step in range(args.warmup + args.decode_steps):
            out, ms = timed(model, input_ids=token, cache=cache, use_cache=True, logits_to_keep=1)
            experts_ms = timer.take_ms()
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            if step >= args.warmup:
                decode.append(ms)
                decode_experts.append(experts_ms)
    timer.remove()
    result |= {
        "prefill_ms": statistics.median(prefill),
        "prefill_experts_ms": statistics.median(prefill_experts),
        "decode_ms": statistics.median(decode),
        "decode_experts_ms": statistics.median(decode_experts),
        "prefill_peak_gib": max(peaks),
    }
    return result


def run_model(model_name: str, args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    """Every implementation on each ``--weights`` load of one model; one row each."""
    path = workdir / model_name
    started = time.perf_counter()
    cls = write_checkpoint(model_name, args.layers, path)
    print(f"{model_name}: written in {time.perf_counter() - started:.0f} s")
    rows = []
    for weights in args.weights:
        quantization = {"fp8": {"quantization_config": FP8_EXPERTS}}
        started = time.perf_counter()
        model = cls.from_pretrained(
            path,
            dtype=torch.bfloat16,
            device_map="cuda",
            experts_implementation="eager",
            **quantization.get(weights, {}),
        ).eval()
        print(f"{model_name}: loaded as {weights} in {time.perf_counter() - started:.0f} s")
        for implementation in args.implementations:
            row = {"model": model_name, "weights": weights, "implementation": implementation}
            rows.append(row | run_implementation(model, implementation, args))
            print(format_table(COLUMNS, [[rows[-1].get(k) for k in KEYS]]).splitlines()[-1])
        del model
        gc.collect()
        torch.cuda.empty_cache()
    shutil.rmtree(path)
    return rows


def run_implementation(
    model: torch.nn.Module, implementation: str, args: argparse.Namespace
) -> dict[str, Any]:
    """Switch ``model`` to ``implementation`` and measure it, or say why it cannot run."""
    gc.collect()
    torch.cuda.empty_cache()
    try:
        started = time.perf_counter()
        if implementation == megamoe.transformers.IMPLEMENTATION:
            megamoe.transformers.prepare(model, max_num_tokens=args.prefill)
            torch.cuda.synchronize()
        else:
            model.set_experts_implementation(implementation)
        return {"setup_s": time.perf_counter() - started} | measure(model, args)
    except Exception as exc:  # one implementation failing must not hide the others
        return {"note": f"not run: {type(exc).__name__}: {str(exc).splitlines()[0][:140]}"}


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="qwen4_exp,glm5_next")
    p.add_argument("--layers", type=int, default=2, help="decoder layers, all MoE (>= 2)")
    p.add_argument("--prefill", type=int, default=2048, help="prompt tokens (batch 1)")
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--implementations", default=",".join(IMPLEMENTATIONS))
    p.add_argument("--weights", default="bf16,fp8", help="how the experts are loaded: bf16, fp8")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temp dir)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.models = args.models.split(",")
    args.implementations = args.implementations.split(",")
    args.weights = args.weights.split(",")
    if unknown := set(args.weights) - set(WEIGHTS):
        p.error(f"--weights: unknown {sorted(unknown)}; expected some of {', '.join(WEIGHTS)}")
    if megamoe.transformers.IMPLEMENTATION in args.implementations[:-1]:
        p.error("--implementations: megamoe takes the experts' weights over, so it must be last")
    if args.layers < 2:
        p.error(f"--layers {args.layers}: the benchmark chains at least 2 MoE layers")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    if not torch.cuda.is_available():
        print("bench_transformers.py: skipped: torch sees no CUDA device (it measures a GPU)")
        return
    shm = Path("/dev/shm")
    base = args.workdir or (str(shm) if shm.is_dir() else None)
    rows = []
    print(
        f"{torch.cuda.get_device_name()}, transformers {transformers.__version__}, prefill "
        f"1x{args.prefill}, {args.decode_steps} decode steps, {args.layers} layers"
    )
    print(format_table(COLUMNS, []))
    with tempfile.TemporaryDirectory(dir=base) as workdir:
        for model_name in args.models:
            rows += run_model(model_name, args, Path(workdir))
    print()
    print(format_table(COLUMNS, [[row.get(k) for k in KEYS] for row in rows]))
    if args.json:
        write_json(args.json, {"args": {k: v for k, v in vars(args).items()}, "rows": rows})


if __name__ == "__main__":
    main()
