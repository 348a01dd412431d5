"""``GemmSmTarget``: the cuBLASLt SM-count target around the shared expert's small GEMMs.

On the CPU no target is ever set. The set-and-restore rule itself runs here against torch's
real carve-out setting (a plain global on a CPU build) and a recorded preferred BLAS
library (a CPU build refuses cuBLASLt); on CUDA ``test_shared_expert_schedule.py`` checks
that the auxiliary stream's shared expert runs under it, and ``tests/test_gpu_block.py``
that the blocks' graphs then still replay eager.
"""

from __future__ import annotations

import pytest
import torch

from megamoe.core.modules import gemm_sm_target
from megamoe.core.modules.gemm_sm_target import SMALL_GEMM_ROWS, GemmSmTarget
from megamoe.core.modules.shared_expert import AuxStream

CARVEOUT = 66


@pytest.fixture
def libraries(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The preferred BLAS library as a recorded value: [current, then every value set]."""
    state: list[object] = ["default"]

    def preferred(backend: object = None) -> object:
        if backend is not None:
            state.append(backend)
        return state[-1]

    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", preferred)
    return state


@pytest.fixture
def target() -> GemmSmTarget:
    sized = GemmSmTarget("cpu")
    sized.carveout = CARVEOUT  # what a 132-SM H200 gets
    return sized


def carveout() -> int | None:
    return torch._C._get_sm_carveout_experimental()


def test_no_target_on_the_cpu() -> None:
    assert GemmSmTarget("cpu").carveout is None
    assert GemmSmTarget(None).carveout is None
    assert AuxStream("cpu").sm_target.carveout is None


def test_a_small_call_runs_on_cublaslt_with_the_carveout_and_restores_the_callers_setting(
    target: GemmSmTarget, libraries: list[object]
) -> None:
    seen: list[tuple[int | None, object]] = []
    torch._C._set_sm_carveout_experimental(3)  # the caller's own, e.g. for NCCL
    try:
        out = target.run(1, lambda: seen.append((carveout(), libraries[-1])) or "done")
        assert out == "done"
        assert seen == [(CARVEOUT, "cublaslt")]
        assert carveout() == 3
        assert libraries[-1] == "default"
    finally:
        torch._C._set_sm_carveout_experimental(None)


def test_the_setting_is_restored_when_the_call_raises(
    target: GemmSmTarget, libraries: list[object]
) -> None:
    def fail() -> None:
        raise RuntimeError("GEMM failed")

    with pytest.raises(RuntimeError, match="GEMM failed"):
        target.run(SMALL_GEMM_ROWS, fail)
    assert carveout() is None
    assert libraries[-1] == "default"


def test_larger_calls_keep_cublas_default(target: GemmSmTarget, libraries: list[object]) -> None:
    seen: list[int | None] = []
    target.run(SMALL_GEMM_ROWS + 1, lambda: seen.append(carveout()))
    assert seen == [None]
    assert libraries == ["default"]


def test_the_carveout_leaves_the_rest_of_the_sms_to_other_kernels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Properties:
        multi_processor_count = 132

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties())
    monkeypatch.setattr(torch.version, "hip", None)
    assert gemm_sm_target._carveout_for(torch.device("cuda", 0)) == 66
    Properties.multi_processor_count = 78  # an H20
    assert gemm_sm_target._carveout_for(torch.device("cuda", 0)) == 39
    assert gemm_sm_target._carveout_for(torch.device("cpu")) is None
