#!/usr/bin/env bash
# Everything the GPU issues measure, in one pass on an H200 (about 6 minutes before the last
# four benchmarks were added; those have not run together yet):
# the gpu-marked tests, then each benchmark's table (printed) and JSON (into $1).
#   bash benchmarks/h200.sh OUTDIR
# Needs, in the machine's own python3 (its curated torch/CUDA): torch with CUDA, pytest,
# pytest-xdist (the tests run -n 8), nox, and DeepGEMM's MegaMoE (pip install
# sgl-deep-gemm); checked first, naming the pip command for whatever is missing.
set -uo pipefail
out=${1:?usage: bash benchmarks/h200.sh OUTDIR}
missing=$(python3 - <<'PY'
import importlib.util
need = {"torch": "torch", "pytest": "pytest", "xdist": "pytest-xdist", "nox": "nox",
        "deep_gemm": "sgl-deep-gemm"}
print(" ".join(pip for module, pip in need.items() if importlib.util.find_spec(module) is None))
PY
)
if [ -n "$missing" ]; then
  echo "benchmarks/h200.sh: python3 lacks $missing: python3 -m pip install $missing" >&2
  exit 2
fi
if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "benchmarks/h200.sh: python3's torch sees no CUDA device (this script measures a GPU)" >&2
  exit 2
fi
mkdir -p "$out"
root=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$root/core/src:$root/qwen4exp/src:$root/glm5next/src:$root/testing:${PYTHONPATH:-}"
export PYTHONUNBUFFERED=1
status=0
run() { echo "### $*"; "$@" || status=1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
# The nox session the README names; xdist by file keeps each DeepGEMM test file in one process.
run python3 -m nox -s gpu_tests -- -q -p no:cacheprovider -p no:benchmark -n 8 --dist loadfile \
  -rA --junitxml="$out/gpu_tests.xml"
run python3 benchmarks/bench_requant.py --torch-reps 2 --json "$out/requant.json"
run python3 benchmarks/bench_forward.py --tokens 1,16,128,256,1024,4096 --json "$out/forward.json"
run python3 benchmarks/bench_block.py --tokens 1,16,128,256,1024,4096 --json "$out/block.json"
run python3 benchmarks/bench_decode.py --json "$out/decode.json" --plot "$out/decode.png"
# The path rule's check on a shape it was not fitted to (two 11.3 GB copies): refit this
# card's models to both runs with benchmarks/fit_path_cost.py decode.json decode_deepseekv3.json
run python3 benchmarks/bench_decode.py --models deepseekv3 --layers 2 --blocks "" \
  --tokens 1,4,16,64,256,1024,2048,4096,8192 --json "$out/decode_deepseekv3.json"
# The same blocks at the real models' sizes (one layer, one rank): GLM-5.3-Flash, Qwen4-Exp.
run python3 benchmarks/bench_block.py --adapters glm5next --experts 288 --top-k 8 --hidden 4096 \
  --intermediate 2048 --shared-intermediate 2048 --tokens 1,16,64,256 --iters 15 --no-compile \
  --json "$out/block_glm5next_real.json"
run python3 benchmarks/bench_block.py --adapters qwen4exp --experts 512 --top-k 10 --hidden 2048 \
  --intermediate 512 --shared-intermediate 512 --tokens 1,16,64,256 --iters 15 --no-compile \
  --json "$out/block_qwen4exp_real.json"
run python3 benchmarks/bench_glm_requant.py --devices cuda --chunks 1,8 --json "$out/glm_requant.json"
run python3 benchmarks/bench_load.py --reps 2 --json "$out/load.json"
run python3 benchmarks/bench_router.py --json "$out/router.json"
run python3 benchmarks/bench_combine.py --json "$out/combine.json"
run python3 benchmarks/bench_shared_expert.py --json "$out/shared_expert.json"
run python3 benchmarks/bench_ep.py --model deepgemm-ref --json "$out/ep-1.json"  # one rank
run python3 benchmarks/bench_transformers.py --json "$out/transformers.json"
# The small-batch path's host time per call, its launches taken out (the H200 machine's CPU).
run python3 benchmarks/bench_host.py --json "$out/host.json"
# The small-batch path's tile shapes side by side past decode (docs/gpu.md, fourteenth
# session): the production ones, WIDE_TILES with the weights' rows as the dots' rows (as it
# was until then: two programs an SM), then the timing probes on WIDE_TILES (wrong outputs):
# no block scales, weights from L2.
weight_rows=$(python3 -c "from tile_forcing import weight_rows_spec; print(weight_rows_spec())")
run python3 benchmarks/bench_tiles.py --tiles "WIDE_TILES $weight_rows BATCH_TILES MIDSIZE_TILES" \
  --probes "unscaled weights_in_l2" --json "$out/tiles.json"
# The tile rule's thresholds on this card (sixteenth session, measured on an H100): 21-32
# pairs per expert on GLM-5.3-Flash's and the DeepSeek-V3-shaped layers' large experts
run python3 benchmarks/bench_tiles.py --models glm53flash --tokens 768,864,1008,1152 \
  --tiles "MIDSIZE_TILES BATCH_TILES WIDE_TILES" --json "$out/tiles_glm_thresholds.json"
run python3 benchmarks/bench_tiles.py --models deepseekv3 --tokens 768,896,1024 \
  --tiles "MIDSIZE_TILES BATCH_TILES WIDE_TILES" --json "$out/tiles_deepseekv3_thresholds.json"
exit $status
