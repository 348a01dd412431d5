"""Fixtures of the glm5next tests: a one-rank EP group, small GLM checkpoints, helpers."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megamoe.core.adapters import SyntheticSizes
from megamoe.core.modules.parallel import ParallelSettings, single_rank_group
from megamoe.core.numerics import quant
from megamoe.core.numerics.formats import WeightFormat
from megamoe.core.testing import write_checkpoint
from megamoe.glm5next import ADAPTER

MAX_SHARD_BYTES = 512 * 1024  # several shard files and an index per small checkpoint
# Small but with two 128x128 blocks along every dimension, 8 experts in 4 router groups.
SIZES = SyntheticSizes(
    num_layers=1,
    hidden_size=256,
    intermediate_size=256,
    num_experts=8,
    top_k=2,
    shared_intermediate_size=256,
)


@pytest.fixture(scope="session")
def ep_group() -> dist.ProcessGroup:
    """This process alone as the expert-parallel group (gloo, in-memory store)."""
    return single_rank_group("cpu")


@pytest.fixture(scope="session")
def parallel(ep_group: dist.ProcessGroup) -> ParallelSettings:
    return ParallelSettings(ep_group=ep_group)


@pytest.fixture(scope="session")
def glm_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[WeightFormat], Path]:
    """Writes (once per session and format) a small GLM-5.3-Flash checkpoint in HF layout:
    config.json, sharded safetensors and an index. Block-FP8 experts and shared expert mix
    power-of-two and other block scales."""
    root = tmp_path_factory.mktemp("glm5next-checkpoints")
    written: dict[WeightFormat, Path] = {}

    def get(fmt: WeightFormat) -> Path:
        if fmt not in written:
            config = ADAPTER.synthetic_config(fmt, SIZES)
            tensors = ADAPTER.synthetic_tensors(config, seed=5)
            written[fmt] = write_checkpoint(
                root / fmt.value, config, tensors, max_shard_bytes=MAX_SHARD_BYTES
            )
        return written[fmt]

    return get


@pytest.fixture
def fresh_power_of_two_warning(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Let the once-per-process power-of-two warning fire again in this test."""
    monkeypatch.setattr(quant, "_warned_not_power_of_two", set())
    yield


@pytest.fixture
def tokens() -> torch.Tensor:
    """48 bf16 tokens whose magnitude varies per token."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn((48, SIZES.hidden_size), generator=gen)
    return (x * torch.linspace(0.25, 2.0, 48)[:, None]).to(torch.bfloat16)
