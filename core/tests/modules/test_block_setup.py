"""The setup every adapter's MoE block shares: expert split, formats, experts, input checks
and ``MoEBlock``'s rank filter and checkpoint loading."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from megamoe.core.adapters import MoEBlock, SyntheticSizes
from megamoe.core.checkpoint.reader import CheckpointReader
from megamoe.core.modules.block_setup import ExpertPlan, check_hidden_states, plan_experts
from megamoe.core.modules.experts import MegaMoEExperts
from megamoe.core.modules.parallel import ParallelSettings
from megamoe.core.numerics.formats import WeightFormat
from megamoe.core.testing import write_synthetic_checkpoint

FP8_QUANT = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
MAIN, MTP = "model.layers.1.mlp", "mtp.layers.0.mlp"
GROUP = object()  # stands in for a process group: FakeRanks answers size and rank itself


@dataclasses.dataclass(frozen=True)
class Dims:
    hidden_size: int = 128
    moe_intermediate_size: int = 128
    num_routed_experts: int = 8
    num_experts_per_tok: int = 2
    quantization_config: Mapping[str, Any] | None = None
    swiglu_limit: float | None = None


@dataclasses.dataclass(frozen=True)
class FakeRanks(ParallelSettings):
    """The settings as rank ``rank`` of an expert-parallel group of ``size`` sees them."""

    size: int = 1
    rank: int = 0

    @property
    def ep_size(self) -> int:
        return self.size

    @property
    def ep_rank(self) -> int:
        return self.rank


def _plan(prefix: str = MAIN, dims: Dims | None = None, **kwargs: Any) -> ExpertPlan:
    parallel = kwargs.pop("parallel", FakeRanks(ep_group=GROUP))
    kwargs.setdefault("arch", "reference")
    return plan_experts("Toy", prefix, dims or Dims(), parallel=parallel, **kwargs)


# -- plan_experts ----------------------------------------------------------------------------


def test_physical_experts_split_linearly_with_redundant_ones() -> None:
    parallel = FakeRanks(ep_group=GROUP, num_redundant_experts=2, size=2, rank=1)
    plan = _plan(parallel=parallel, max_num_tokens=64, emulate_kernel=True)
    assert (plan.num_logical_experts, plan.num_physical_experts) == (8, 10)
    assert (plan.num_local_experts, plan.experts_start_idx) == (5, 5)
    assert (plan.top_k, plan.hidden_size, plan.intermediate_size) == (2, 128, 128)
    assert (plan.max_num_tokens, plan.emulate_kernel, plan.process_group) == (64, True, GROUP)
    assert plan.device == torch.device("cpu") and plan.experts_prefix == f"{MAIN}.experts"


def test_an_uneven_split_and_unsupported_parallel_settings_are_refused() -> None:
    uneven = FakeRanks(ep_group=GROUP, num_redundant_experts=2, size=4)
    with pytest.raises(
        ValueError,
        match=r"model\.layers\.1\.mlp: 10 physical experts \(8 routed \+ num_redundant_experts=2"
        r"\) do not split evenly over 4 expert-parallel ranks; change num_redundant_experts",
    ):
        _plan(parallel=uneven)
    with pytest.raises(NotImplementedError, match=r"Toy MegaMoE runs expert parallel: pass"):
        _plan(parallel=ParallelSettings())
    with pytest.raises(NotImplementedError, match=r"Toy MegaMoE supports tp_size=1 only"):
        _plan(parallel=FakeRanks(ep_group=GROUP, tp_size=2))


def test_forced_format_applies_to_main_layers_and_never_to_mtp_layers() -> None:
    fp8 = Dims(quantization_config=FP8_QUANT)
    main = _plan(MAIN, fp8, moe_format="mxfp8")
    assert (main.is_mtp, main.checkpoint_format, main.run_format) == (
        False,
        WeightFormat.FP8_BLOCK,
        WeightFormat.MXFP8,
    )
    mtp = _plan(MTP, fp8, moe_format="mxfp8")  # inferred from the prefix
    assert (mtp.is_mtp, mtp.run_format) == (True, WeightFormat.FP8_BLOCK)
    forced = _plan(MTP, fp8, moe_format="mxfp8", is_mtp=False)
    assert (forced.is_mtp, forced.run_format) == (False, WeightFormat.MXFP8)
    with pytest.raises(ValueError, match=r"moe_format='fp8_block' cannot run on sm100"):
        _plan(MAIN, fp8, moe_format="fp8_block", arch="sm100")


def test_the_reference_backend_decides_the_target_without_arch() -> None:
    plan = _plan(MAIN, Dims(quantization_config=FP8_QUANT), backend="reference", arch=None)
    assert plan.run_format is WeightFormat.FP8_BLOCK and plan.backend == "reference"


def test_the_chosen_formats_are_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="megamoe"):
        for _ in range(2):
            plan_experts(
                "LogOnceToy", MAIN, Dims(), parallel=FakeRanks(ep_group=GROUP), arch="sm100"
            )
    lines = [r.getMessage() for r in caplog.records if "LogOnceToy" in r.getMessage()]
    assert lines == ["LogOnceToy MegaMoE runs bf16 routed experts (checkpoint: bf16)"]


def test_build_experts_constructs_the_planned_experts() -> None:
    parallel = FakeRanks(ep_group=GROUP, size=2, rank=1)
    plan = dataclasses.replace(_plan(parallel=parallel, backend="reference"), process_group=None)
    experts = plan.build_experts(MegaMoEExperts, num_shared_experts=1)
    assert type(experts) is MegaMoEExperts
    assert (experts.num_experts, experts.num_local_experts, experts.experts_start_idx) == (8, 4, 4)
    assert (experts.num_logical_experts, experts.top_k, experts.num_shared_experts) == (8, 2, 1)
    assert (experts.weight_format, experts.checkpoint_format) == (WeightFormat.BF16,) * 2
    assert experts.prefix == f"{MAIN}.experts" and experts.backend.name == "reference"
    assert experts.map_global_expert_id(5) == [1] and experts.map_global_expert_id(2) == []


# -- input checks and dense tensors ----------------------------------------------------------


def test_hidden_states_must_be_tokens_by_hidden_in_bf16_on_the_block_device() -> None:
    cpu = torch.device("cpu")
    check_hidden_states(MAIN, torch.zeros(3, 128, dtype=torch.bfloat16), 128, cpu)
    check_hidden_states(MAIN, torch.zeros(0, 128, dtype=torch.bfloat16), 128, cpu)
    for shape in ((3, 64), (3, 128, 1), (128,)):
        with pytest.raises(ValueError, match=rf"{MAIN}: hidden_states has shape .*, expected "):
            check_hidden_states(MAIN, torch.zeros(shape, dtype=torch.bfloat16), 128, cpu)
    with pytest.raises(TypeError, match=r"dtype torch\.float16, expected torch\.bfloat16"):
        check_hidden_states(MAIN, torch.zeros(3, 128, dtype=torch.float16), 128, cpu)
    with pytest.raises(ValueError, match=r"hidden_states is on cpu, the block on meta"):
        check_hidden_states(
            MAIN, torch.zeros(3, 128, dtype=torch.bfloat16), 128, torch.device("meta")
        )


# -- MoEBlock: rank filter and checkpoint loading --------------------------------------------


class RecordingBlock(MoEBlock):
    """Rank 1 of 2 (experts 4..7 of 8); records what it is asked to load."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix, self.is_mtp, self.finalized = prefix, False, False
        parallel = FakeRanks(ep_group=GROUP, size=2, rank=1)
        plan = _plan(prefix, parallel=parallel, backend="reference")
        self.experts = dataclasses.replace(plan, process_group=None).build_experts(MegaMoEExperts)
        self.loaded: list[str] = []

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        self.loaded += [name for name, _ in weights]
        return set(self.loaded)

    def finalize(self) -> None:
        self.finalized = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states


def test_wants_keeps_everything_but_other_ranks_experts() -> None:
    block = RecordingBlock(MAIN)
    assert block.wants("experts.5.up_proj.weight") and block.wants("experts.4.down_proj.weight")
    assert not block.wants("experts.3.gate_proj.weight")
    # Fused, unparsable or out-of-range expert names stay, so that loading reports them.
    for name in ("experts.gate_up_proj", "experts.x.y", "experts.99.up_proj.weight", "gate.weight"):
        assert block.wants(name), name


def test_load_from_checkpoint_reads_only_this_ranks_experts(tmp_path: Path, toy_adapter) -> None:
    sizes = SyntheticSizes(num_layers=1, hidden_size=128, intermediate_size=128, num_experts=8)
    write_synthetic_checkpoint(tmp_path, toy_adapter, "bf16", sizes)
    block = RecordingBlock("model.layers.0.mlp")
    block.load_from_checkpoint(CheckpointReader(tmp_path, toy_adapter))
    projs = ("gate_proj", "up_proj", "down_proj")
    assert sorted(block.loaded) == sorted(
        ["gate.weight"]
        + [f"experts.{e}.{p}.weight" for e in range(4, 8) for p in projs]
        + [f"shared_experts.{p}.weight" for p in projs]
    )
    assert block.finalized
