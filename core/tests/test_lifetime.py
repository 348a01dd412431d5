"""MegaMoEExperts is freed by reference counting alone: ``del`` returns its memory at once.

Each test turns the cyclic garbage collector off, builds a module, loads it, finalizes it,
runs a forward, reloads it (staged), fails a reload and uses ``weight_loader``, then drops
it: a reference cycle anywhere in what the module owns would keep it alive.
"""

from __future__ import annotations

import pytest
import torch
from lifetime import assert_freed_without_gc

from megamoe.core.errors import NonFiniteError
from megamoe.core.loading.expert_loading import STAGE_WHOLE_RELOAD
from megamoe.core.modules.experts import MegaMoEExperts
from megamoe.core.numerics.formats import RUN_FORMATS, WeightFormat
from megamoe.core.testing import one_rank_experts, synthetic_expert_tensors

H, INTER, E = 128, 128, 4
CHECKPOINT = {  # a checkpoint format that needs a conversion to each run format
    WeightFormat.BF16: WeightFormat.FP8_BLOCK,
    WeightFormat.FP8_BLOCK: WeightFormat.BF16,
    WeightFormat.MXFP8: WeightFormat.FP8_BLOCK,
    WeightFormat.MXFP4: WeightFormat.BF16,
}
PROJ_OF = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]


def _experts(
    run_format: WeightFormat, checkpoint_format: WeightFormat, device: str
) -> MegaMoEExperts:
    return one_rank_experts(
        E,
        H,
        INTER,
        weight_format=run_format,
        checkpoint_format=checkpoint_format,
        num_shared_experts=1,
        max_num_tokens=16,
        backend="reference",
        device=device,
        prefix="model.layers.2.mlp.experts",
        reload_staging_bytes=STAGE_WHOLE_RELOAD,
    )


def _load(m: MegaMoEExperts, seed: int) -> None:
    fmt = m.checkpoint_format
    m.load_weights(synthetic_expert_tensors(fmt, E, H, INTER, seed=seed))
    shared = dict(synthetic_expert_tensors(fmt, 1, H, INTER, seed=seed + 100))
    for shard_id, proj in PROJ_OF.items():
        for kind in m.checkpoint_halves:
            m.load_shared_expert_tensor(shard_id, kind, shared[f"0.{proj}.{kind}"])


def _forward(m: MegaMoEExperts) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, H, generator=gen).to(torch.bfloat16).to(m.device)
    ids = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(6)]).to(m.device)
    return m(x, torch.rand(6, 2, generator=gen).to(m.device), ids)


def _exercised(run_format: WeightFormat, device: str) -> MegaMoEExperts:
    """A module after every load path: first load, forward, failed and good reloads."""
    m = _experts(run_format, CHECKPOINT[run_format], device)
    _load(m, seed=0)
    m.finalize()
    _forward(m)
    bad = dict(synthetic_expert_tensors(m.checkpoint_format, E, H, INTER, seed=1))
    poisoned = bad["2.up_proj.weight"].clone()
    poisoned.view(torch.uint8)[0, :4] = 0xFF  # NaN in bf16 and in FP8 E4M3 alike
    bad["2.up_proj.weight"] = poisoned
    with pytest.raises(NonFiniteError):
        m.load_weights(bad.items())
    _load(m, seed=2)  # staged: the module serves, so finalize() commits it
    m.finalize()
    # weight_loader: hand one shard back in the run format (the same values again).
    params = m.kernel_params
    weight = params["w2_weight"].data[1].clone()
    scale = params["w2_weight_scale"].data[1].clone() if "w2_weight_scale" in params else None
    done = m.weight_loader(
        params["w2_weight"], weight, "down_proj.weight", shard_id="w2", expert_id=1
    )
    if scale is not None:
        done = m.weight_loader(
            params["w2_weight_scale"], scale, "w2 scale", shard_id="w2", expert_id=1
        )
    assert done
    m.finalize()
    out = _forward(m)
    assert out.shape == (6, H)
    assert bool(torch.isfinite(out.float()).all())
    return m


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("run_format", list(RUN_FORMATS), ids=lambda f: f.value)
def test_experts_are_freed_on_del_without_the_garbage_collector(
    run_format: WeightFormat, device: str
) -> None:
    assert_freed_without_gc(
        lambda: _exercised(run_format, device), f"MegaMoEExperts ({run_format.value}, {device})"
    )


def test_experts_freed_while_a_loaded_tensor_lives_on() -> None:
    """Tensors handed to the module (and kept by the caller) do not keep it alive."""
    kept = list(synthetic_expert_tensors(WeightFormat.BF16, E, H, INTER, seed=3))

    def make() -> MegaMoEExperts:
        m = _experts(WeightFormat.BF16, WeightFormat.BF16, "cpu")
        m.load_weights(kept)
        return m

    assert_freed_without_gc(make, "MegaMoEExperts holding caller tensors")


def test_a_cycle_through_the_module_is_reported() -> None:
    """The check can fail: a bound method stored on the module's own parameter is a cycle."""

    def make() -> MegaMoEExperts:
        m = _experts(WeightFormat.BF16, WeightFormat.BF16, "cpu")
        m.w2_weight.loader = m.weight_loader  # type: ignore[attr-defined]
        return m

    with pytest.raises(AssertionError, match=r"cycle.*builtins\.method x1"):
        assert_freed_without_gc(make, "MegaMoEExperts with a loader on its parameter")
