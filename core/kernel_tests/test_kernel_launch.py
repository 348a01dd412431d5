"""A kernel launch's options reach Triton's JIT as the launch names them."""

from __future__ import annotations

from typing import Any

from megamoe.core.kernels.launch import KernelLaunch


class RecordingKernel:
    """Stands in for a ``@triton.jit`` function: records each launch's grid and options."""

    arg_names = ("x_ptr", "BLOCK")

    def __init__(self) -> None:
        self.launches: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **options: Any) -> None:
            self.launches.append((grid, args, options))

        return launch


def test_the_stages_the_dependent_launch_and_the_register_cap_reach_the_jit() -> None:
    kernel = RecordingKernel()
    launch = KernelLaunch(kernel, runtime_args=1)  # type: ignore[arg-type]
    launch(None, (3, 1, 1), 0, ("x",), (64,), 4, 3, True, 168)
    launch(None, (1, 1, 1), 0, ("x",), (64,), 8)
    assert kernel.launches == [
        ((3, 1, 1), ("x", 64), {"num_warps": 4, "num_stages": 3, "launch_pdl": True,
                                "maxnreg": 168}),
        ((1, 1, 1), ("x", 64), {"num_warps": 8}),
    ]  # fmt: skip
