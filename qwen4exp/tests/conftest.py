"""Fixtures of the qwen4exp tests: a one-rank EP group, small checkpoints on disk and an
independent float64 reference of the MoE layer."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file

from megamoe.core.adapters import SyntheticSizes
from megamoe.core.modules.parallel import ParallelSettings, single_rank_group
from megamoe.core.numerics.formats import WeightFormat
from megamoe.core.testing import write_checkpoint
from megamoe.qwen4exp import ADAPTER

MAX_SHARD_BYTES = 256 * 1024  # several shard files and an index per small checkpoint

CheckpointFactory = Callable[[WeightFormat, bool, SyntheticSizes], Path]


@pytest.fixture(scope="session")
def ep_group() -> dist.ProcessGroup:
    """This process alone as the expert-parallel group (gloo, in-memory store)."""
    return single_rank_group()


@pytest.fixture(scope="session")
def parallel(ep_group: dist.ProcessGroup) -> ParallelSettings:
    return ParallelSettings(ep_group=ep_group)


@pytest.fixture(scope="session")
def qwen_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> CheckpointFactory:
    """Writes (once per session) a small Qwen4Exp checkpoint in HF layout: config.json,
    sharded safetensors and an index; experts stored as ``fmt``, fused when asked."""
    root = tmp_path_factory.mktemp("qwen4exp-checkpoints")
    written: dict[tuple[WeightFormat, bool, SyntheticSizes], Path] = {}

    def get(fmt: WeightFormat, fused: bool, sizes: SyntheticSizes) -> Path:
        key = (fmt, fused, sizes)
        if key not in written:
            config = ADAPTER.synthetic_config(fmt, sizes)
            tensors = ADAPTER.synthetic_tensors(config, seed=3, fused_experts=fused)
            path = root / f"{fmt.value}{'-fused' if fused else ''}-{len(written)}"
            written[key] = write_checkpoint(path, config, tensors, max_shard_bytes=MAX_SHARD_BYTES)
        return written[key]

    return get


# -- an independent float64 Qwen4Exp MoE layer -----------------------------------------------
# Written from the format definitions and the model's math, using no megamoe code: it reads
# the safetensors files itself and decodes FP8 / MXFP8 / MXFP4 element by element.

PROJS = ("gate_proj", "up_proj", "down_proj")
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # E2M1 codes 0..7; bit 3 is the sign
SCALE_NAMES = {
    WeightFormat.FP8_BLOCK: "weight_scale_inv",
    WeightFormat.MXFP8: "weight_scale",
    WeightFormat.MXFP4: "weight_scale",
}
Weights = tuple[torch.Tensor, torch.Tensor | None]


def decode64(weight: torch.Tensor, scale: torch.Tensor | None, fmt: WeightFormat) -> torch.Tensor:
    """Stored (weight, scale) -> float64: 128x128 float32 block scales (FP8_BLOCK), 1x32
    UE8M0 exponents 2^(e-127) (MX), E2M1 pairs with the even column in the low nibble."""
    if fmt is WeightFormat.BF16:
        return weight.double()
    if fmt is WeightFormat.MXFP4:
        codes = torch.stack([weight & 0xF, weight >> 4], dim=-1).flatten(-2).long()
        magnitude = torch.tensor(E2M1_VALUES, dtype=torch.float64)[codes & 7]
        values = torch.where(codes >= 8, -magnitude, magnitude)
    else:
        values = weight.double()
    assert scale is not None
    rows, cols = values.shape
    if fmt is WeightFormat.FP8_BLOCK:
        full = scale.double().repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)
        return values * full[:, :cols]
    return values * torch.exp2(scale.double() - 127.0).repeat_interleave(32, 1)[:, :cols]


def swiglu64(
    x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


class Float64Oracle:
    """A checkpoint's MoE layers in float64, straight from its safetensors files."""

    def __init__(self, path: Path) -> None:
        raw = json.loads((path / "config.json").read_text())
        self.config = raw.get("text_config", raw)  # the MoE keys of a composite config
        index = path / "model.safetensors.index.json"
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        self.num_files = len(files)
        self.tensors: dict[str, torch.Tensor] = {}
        for file in files:
            self.tensors.update(load_file(str(path / file)))

    decode = staticmethod(decode64)

    def stored_projection(self, stem: str, fmt: WeightFormat) -> Weights:
        weight = self.tensors.get(f"{stem}.weight_packed", self.tensors.get(f"{stem}.weight"))
        assert weight is not None, stem
        return weight, None if fmt is WeightFormat.BF16 else self.tensors[
            f"{stem}.{SCALE_NAMES[fmt]}"
        ]

    def stored_experts(self, prefix: str, fmt: WeightFormat) -> list[dict[str, Weights]]:
        """Per expert, per projection: the stored (weight, scale), fused layouts split."""
        experts, inter = self.config["num_experts"], self.config["moe_intermediate_size"]
        fused = self.tensors.get(f"{prefix}.experts.gate_up_proj")
        if fused is not None:
            down = self.tensors[f"{prefix}.experts.down_proj"]
            return [
                {"gate_proj": (fused[e, :inter], None), "up_proj": (fused[e, inter:], None),
                 "down_proj": (down[e], None)}
                for e in range(experts)
            ]  # fmt: skip
        return [
            {p: self.stored_projection(f"{prefix}.experts.{e}.{p}", fmt) for p in PROJS}
            for e in range(experts)
        ]

    def decoded_experts(self, prefix: str, fmt: WeightFormat) -> list[dict[str, torch.Tensor]]:
        return [{p: decode64(*w[p], fmt) for p in PROJS} for w in self.stored_experts(prefix, fmt)]

    def forward(
        self,
        x: torch.Tensor,
        prefix: str,
        experts: list[dict[str, torch.Tensor]],
        shared_fmt: WeightFormat,
    ) -> torch.Tensor:
        """Router softmax, top-k (renormalized per norm_topk_prob), the experts given
        (float64 gate/up/down per expert), plus the sigmoid-gated shared expert."""
        x = x.detach().cpu().double()
        top_k = self.config["num_experts_per_tok"]
        probs = torch.softmax(x @ self.tensors[f"{prefix}.gate.weight"].double().T, dim=-1)
        weights, ids = probs.topk(top_k, dim=-1)
        if self.config.get("norm_topk_prob", True):
            weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, w in enumerate(experts):
            rows, slots = (ids == e).nonzero(as_tuple=True)
            if rows.numel():
                y = swiglu64(x[rows], w["gate_proj"], w["up_proj"], w["down_proj"])
                out.index_add_(0, rows, weights[rows, slots, None] * y)
        shared = [
            decode64(*self.stored_projection(f"{prefix}.shared_expert.{p}", shared_fmt), shared_fmt)
            for p in PROJS
        ]
        gate = torch.sigmoid(x @ self.tensors[f"{prefix}.shared_expert_gate.weight"].double().T)
        return out + swiglu64(x, *shared) * gate


@pytest.fixture(scope="session")
def float64_oracle() -> type[Float64Oracle]:
    """The independent float64 reference (a class: ``float64_oracle(checkpoint_path)``)."""
    return Float64Oracle


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative Frobenius error of ``actual`` against a float64 ``expected``."""
    return float((actual.detach().cpu().double() - expected).norm() / expected.norm())


@pytest.fixture(scope="session")
def relative_error() -> Callable[[torch.Tensor, torch.Tensor], float]:
    return rel_err
