"""The released models' expert sizes, as transformers 5.24.0 defines them, fit the Hopper kernel.

``DeepGemmBackend.check_layer`` refuses sizes the Hopper ``fp8_mega_moe`` kernel does not
run (``check_sm90_sizes``). The configs' defaults are the released checkpoints' sizes
(../shared/MODELS.md): Qwen4-Exp H=2048, I=512 (shared 512); GLM-5.3-Flash H=4096,
I=2048, whose shared expert is I wide too. Their MTP layers have the same sizes.
"""

from __future__ import annotations

import pytest
import transformers

from megamoe.core.backends.deepgemm import check_sm90_sizes

RELEASED = {
    "qwen4_exp": transformers.Qwen4ExpConfig,
    "glm5_next": transformers.Glm5NextConfig,
}


@pytest.mark.parametrize("family", list(RELEASED))
def test_the_released_models_run_on_the_hopper_kernel(family: str) -> None:
    config = RELEASED[family]()
    text = getattr(config, "text_config", config)
    widths = {text.moe_intermediate_size, getattr(text, "shared_expert_intermediate_size", 0)}
    for width in widths - {0}:
        check_sm90_sizes(family, text.hidden_size, width)


@pytest.mark.parametrize(
    ("hidden", "intermediate", "message"),
    [
        (2048, 1408, "hidden_size=2048, intermediate_size=1408; the Hopper"),  # not 256-aligned
        (2304, 512, "hidden_size=2304, intermediate_size=512; the Hopper"),  # not 512-aligned
        (4096, 4352, "intermediate_size=4352 exceeds 4096"),
    ],
)
def test_other_sizes_are_refused_with_the_rule(
    hidden: int, intermediate: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message) as refused:
        check_sm90_sizes("layers.1.mlp.experts", hidden, intermediate)
    assert "layers.1.mlp.experts" in str(refused.value)
    assert "backend='reference'" in str(refused.value)
