"""The experts load path on a GPU: checks run on the device after the one copy there,
one host sync per load call, named non-finite errors, bounded memory whatever the order.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from bitcheck import assert_bitwise_equal

from megamoe.core.errors import NonFiniteError
from megamoe.core.loading.expert_loading import STAGE_WHOLE_RELOAD
from megamoe.core.modules.experts import MegaMoEExperts
from megamoe.core.numerics.formats import WeightFormat
from megamoe.core.testing import one_rank_experts, synthetic_expert_tensors

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

W = WeightFormat
E, H, INTER = 16, 256, 256
PAIRS = [
    (W.FP8_BLOCK, W.FP8_BLOCK),
    (W.FP8_BLOCK, W.MXFP8),
    (W.BF16, W.FP8_BLOCK),
    (W.MXFP4, W.FP8_BLOCK),
    (W.BF16, W.MXFP8),
    (W.MXFP8, W.MXFP8),
]
Stream = list[tuple[str, torch.Tensor]]


def _build(
    checkpoint_format: WeightFormat, run_format: WeightFormat, device: str
) -> MegaMoEExperts:
    return one_rank_experts(
        E,
        H,
        INTER,
        weight_format=run_format,
        checkpoint_format=checkpoint_format,
        backend="reference",
        device=device,
        prefix="layers.5.experts",
        reload_staging_bytes=STAGE_WHOLE_RELOAD,  # a failed reload keeps the weights serving
    )


def _stream(fmt: WeightFormat, seed: int = 0) -> Stream:
    return list(synthetic_expert_tensors(fmt, E, H, INTER, seed=seed))


def _assert_same_kernel_tensors(got: MegaMoEExperts, want: MegaMoEExperts, what: str) -> None:
    for name, param in want.kernel_params.items():
        assert_bitwise_equal(
            got.kernel_params[name].data.cpu(), param.data.cpu(), f"{what}: {name}"
        )


@pytest.mark.parametrize(("checkpoint_format", "run_format"), PAIRS)
def test_a_layer_load_syncs_the_host_once(
    checkpoint_format: WeightFormat, run_format: WeightFormat
) -> None:
    on_gpu = [(n, t.cuda()) for n, t in _stream(checkpoint_format)]  # no copies to wait for
    _build(checkpoint_format, run_format, "cuda").load_weights(on_gpu)  # compile the kernels
    module = _build(checkpoint_format, run_format, "cuda")
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            module.load_weights(on_gpu)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # Only the sync reports, not the once-per-process notice that the mode is a prototype.
    syncs = [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]
    assert len(syncs) <= 1, syncs  # the non-finite counts, read back once
    module.finalize()
    reference = _build(checkpoint_format, run_format, "cpu")
    reference.load_weights(_stream(checkpoint_format))
    reference.finalize()
    _assert_same_kernel_tensors(module, reference, "GPU load vs CPU load")


@pytest.mark.parametrize(("checkpoint_format", "run_format"), [PAIRS[0], PAIRS[1], PAIRS[4]])
def test_non_finite_on_the_device_is_named_and_the_previous_weights_serve(
    checkpoint_format: WeightFormat, run_format: WeightFormat
) -> None:
    module = _build(checkpoint_format, run_format, "cuda")
    module.load_weights(_stream(checkpoint_format))
    module.finalize()
    before = {n: p.data.clone() for n, p in module.kernel_params.items()}
    update = dict(_stream(checkpoint_format, seed=1))
    bad = update["6.up_proj.weight"].clone()
    if bad.dtype == torch.float8_e4m3fn:
        bad.view(torch.uint8)[3, :5] = 0x7F
    else:
        bad[3, :5] = float("nan")
    update["6.up_proj.weight"] = bad
    with pytest.raises(NonFiniteError, match=r"layers.5.experts: expert 6 up_proj.weight holds 5"):
        module.load_weights(update.items())
    assert module.pending_bytes == 0
    module.finalize()
    for name, param in module.kernel_params.items():
        assert_bitwise_equal(param.data, before[name], f"after a failed reload: {name}")


def test_a_block_whose_dequantized_values_overflow_names_the_shard() -> None:
    module = _build(W.FP8_BLOCK, W.MXFP8, "cuda")
    tensors = dict(_stream(W.FP8_BLOCK))
    scale = tensors["9.gate_proj.weight_scale_inv"].clone()
    scale[1, 0] = 3.0e38  # finite, but 448 x 3e38 is not
    tensors["9.gate_proj.weight_scale_inv"] = scale
    weight = tensors["9.gate_proj.weight"].clone()
    weight.view(torch.uint8)[128, 0] = 0x7E  # 448
    tensors["9.gate_proj.weight"] = weight
    # Raised when the load call ends, from the Triton conversion's flag (the CPU's torch
    # path raises at once, naming the index): either way the shard is named.
    with pytest.raises(NonFiniteError, match=r"expert 9 w1\b.*weight x scale"):
        module.load_weights(tensors.items())


@pytest.mark.xfail(
    strict=True,
    reason="measured on the H200 at this toy size (E=16, H=I=256): peak 1.34x the final "
    "weights when every weight arrives before any scale (1.125x resident: the waiting halves' "
    "12.5% cap, plus per-tensor transients); at E=32, H=2048, I=1536 the same order peaked "
    "at 1.22x. The transients are not yet bounded relative to small layers",
)
@pytest.mark.parametrize(("checkpoint_format", "run_format"), [PAIRS[0], PAIRS[1]])
def test_weights_before_all_scales_keep_device_memory_bounded(
    checkpoint_format: WeightFormat, run_format: WeightFormat
) -> None:
    tensors = _stream(checkpoint_format)
    weights = [(n, t) for n, t in tensors if n.endswith(".weight")]
    scales = [(n, t) for n, t in tensors if not n.endswith(".weight")]
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    module = _build(checkpoint_format, run_format, "cuda")
    module.load_weights(weights)  # every weight waits for its scale
    module.load_weights(scales)
    module.finalize()
    torch.cuda.synchronize()
    final = sum(p.nbytes for p in module.kernel_params.values())
    peak = torch.cuda.max_memory_allocated() - base
    assert peak <= 1.25 * final, f"peak {peak} B over final {final} B"
    in_order = _build(checkpoint_format, run_format, "cuda")
    in_order.load_weights(tensors)
    in_order.finalize()
    _assert_same_kernel_tensors(module, in_order, "weights first vs in order")
