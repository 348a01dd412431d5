"""Qwen4-Exp, GLM-5.3-Flash and other transformers MoE models on megamoe's experts.

Importing this package registers ``"megamoe"`` as a transformers experts implementation::

    import megamoe.transformers  # noqa: F401  (registers "megamoe")

    model = AutoModelForImageTextToText.from_pretrained(path, experts_implementation="megamoe")

Each MoE layer's experts are built from what transformers loaded (BF16, or block-FP8 with
its scales) at the layer's first forward, or all at once by ``prepare(model, ...)``, and
run through DeepGEMM's MegaMoE kernel where it runs the format on this device, else
through megamoe's torch reference backend. Needs ``pip install "megamoe-core[transformers]"``;
``megamoe.core`` never imports this package.
"""

from __future__ import annotations

import importlib.metadata

from packaging.version import Version

MIN_TRANSFORMERS = "5.24"  # the first release with qwen4_exp and glm5_next
PIP_COMMAND = 'pip install "megamoe-core[transformers]"'

try:
    _installed = importlib.metadata.version("transformers")
except importlib.metadata.PackageNotFoundError as exc:
    raise ImportError(
        f"megamoe.transformers needs transformers>={MIN_TRANSFORMERS}, which is not "
        f"installed: {PIP_COMMAND}"
    ) from exc
if Version(_installed) < Version(MIN_TRANSFORMERS):
    raise ImportError(
        f"megamoe.transformers needs transformers>={MIN_TRANSFORMERS}, found {_installed}: "
        f"{PIP_COMMAND}"
    )

from megamoe.transformers.implementation import (  # noqa: E402  (after the version check)
    DEFAULT_MAX_NUM_TOKENS,
    IMPLEMENTATION,
    build_experts,
    megamoe_experts_forward,
    prepare,
    register,
)

register()

__all__ = [
    "DEFAULT_MAX_NUM_TOKENS",
    "IMPLEMENTATION",
    "MIN_TRANSFORMERS",
    "build_experts",
    "megamoe_experts_forward",
    "prepare",
    "register",
]
