"""The contract between megamoe-core and model adapters, and their discovery.

Adapters are separate distributions that register an instance of ``ModelAdapter`` under
the entry-point group ``megamoe.adapters``. Core never imports an adapter by name: the
checkpoint reader and the CLI find them here.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from megamoe.core.expert_names import TensorSpec, expert_tensor_spec
from megamoe.core.formats import BLOCK_FP8_DEFAULT, WeightFormat
from megamoe.core.parallel import ParallelSettings

if TYPE_CHECKING:
    from megamoe.core.checkpoint import CheckpointReader
    from megamoe.core.experts import MegaMoEExperts

ENTRY_POINT_GROUP = "megamoe.adapters"


@dataclass(frozen=True)
class MoELayer:
    """One MoE layer of a checkpoint.

    Attributes:
        index: layer number (within the main model or the MTP drafter).
        prefix: tensor-name prefix of the MoE block, e.g. ``model.layers.3.mlp``.
        checkpoint_format: how its routed experts are stored.
        is_mtp: the layer belongs to the MTP drafter (it takes the default run format,
            never a forced one).
    """

    index: int
    prefix: str
    checkpoint_format: WeightFormat
    is_mtp: bool = False


@dataclass(frozen=True)
class SyntheticSizes:
    """Sizes of a synthetic checkpoint (small, but every dimension a multiple of 128)."""

    num_layers: int = 2
    hidden_size: int = 256
    intermediate_size: int = 256
    num_experts: int = 8
    top_k: int = 2
    shared_intermediate_size: int = 256


class MoEBlock(torch.nn.Module):
    """What ``ModelAdapter.build_block`` returns: one MoE layer on megamoe.

    Attributes:
        experts: the routed experts module.
    """

    experts: MegaMoEExperts

    @abc.abstractmethod
    def load_from_checkpoint(self, reader: CheckpointReader) -> None:
        """Load this layer's tensors (only this rank's experts) and finalize."""

    @abc.abstractmethod
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Routed plus shared output for this rank's tokens, (tokens, hidden) bf16."""


class ModelAdapter(abc.ABC):
    """A model family on megamoe: config parsing, layers, blocks, synthetic checkpoints."""

    name: ClassVar[str]  # short name, e.g. "qwen4exp"
    distribution: ClassVar[str]  # pip name, e.g. "megamoe-qwen4exp"
    model_types: ClassVar[tuple[str, ...]]  # config.json "model_type" values it claims
    architectures: ClassVar[tuple[str, ...]]  # config.json "architectures" it claims
    checkpoint_formats: ClassVar[tuple[WeightFormat, ...]]  # formats it loads

    def claims(self, config: Mapping[str, Any]) -> bool:
        """Whether this adapter handles a checkpoint with this ``config.json``."""
        if config.get("model_type") in self.model_types:
            return True
        return any(arch in self.architectures for arch in config.get("architectures") or ())

    @abc.abstractmethod
    def moe_layers(self, config: Mapping[str, Any]) -> list[MoELayer]:
        """Every MoE layer of the checkpoint (MTP drafter included) with its expert format.

        Raises:
            NotImplementedError: a quantization method megamoe cannot load, naming it and
                the layer prefix.
        """

    @abc.abstractmethod
    def build_block(
        self,
        config: Mapping[str, Any],
        layer: MoELayer,
        *,
        parallel: ParallelSettings,
        moe_format: WeightFormat | str | None = None,
        backend: str = "auto",
        device: torch.device | str | None = None,
        max_num_tokens: int = 256,
    ) -> MoEBlock:
        """Build the MoE block of ``layer`` (weights still unloaded)."""

    @abc.abstractmethod
    def reference_forward(
        self, reader: CheckpointReader, layer: MoELayer, hidden_states: torch.Tensor
    ) -> torch.Tensor:
        """Float64 output of the layer computed from the checkpoint's dequantized tensors.

        Independent of the loading path, so it can check a loaded block.
        """

    @abc.abstractmethod
    def synthetic_config(self, fmt: WeightFormat, sizes: SyntheticSizes) -> dict[str, Any]:
        """A ``config.json`` for a small checkpoint storing its experts as ``fmt``."""

    @abc.abstractmethod
    def synthetic_tensors(
        self, config: Mapping[str, Any], seed: int = 0
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor of a synthetic checkpoint for ``config``, in checkpoint naming."""

    def converted_config(self, config: Mapping[str, Any], fmt: WeightFormat) -> dict[str, Any]:
        """``config.json`` of a checkpoint whose routed experts were converted to ``fmt``."""
        raise NotImplementedError(f"{self.name} does not support megamoe convert")

    def expert_prefixes(self, layer: MoELayer) -> tuple[str, ...]:
        """Tensor prefixes of the expert groups ``megamoe convert`` converts in ``layer``.

        The first holds the routed experts (``{e}.{proj}.*`` or fused). Further prefixes,
        e.g. a shared expert the kernel runs as one more expert (``{proj}.*``, no index),
        are converted to the same format when the checkpoint has them; ``converted_config``
        must then mark them converted too.
        """
        return (f"{layer.prefix}.experts",)

    def expert_dims(self, config: Mapping[str, Any]) -> tuple[int, int, int]:
        """``(routed experts E, hidden size H, expert intermediate size I)`` of ``config``.

        The default reads the Hugging Face keys ``num_experts`` (Qwen-style) or
        ``n_routed_experts`` (DeepSeek-style), ``hidden_size`` and ``moe_intermediate_size``.

        Raises:
            ValueError: a key is missing or not a positive integer.
        """
        keys = (
            "n_routed_experts" if "n_routed_experts" in config else "num_experts",
            "hidden_size",
            "moe_intermediate_size",
        )
        dims = []
        for key in keys:
            value = config.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(
                    f"config.json: {key}={value!r} must be a positive integer; {self.name} "
                    "needs it to size the experts"
                )
            dims.append(value)
        return dims[0], dims[1], dims[2]

    def expected_expert_tensor(
        self, config: Mapping[str, Any], layer: MoELayer, name: str
    ) -> TensorSpec | None:
        """The dtype and shape routed-expert tensor ``name`` must have in the checkpoint.

        Checked from the safetensors headers before any tensor of the layer is read. The
        default covers the names ``megamoe.core.expert_names`` describes, stored in
        ``layer.checkpoint_format`` with ``expert_dims(config)`` and the block-FP8
        ``weight_block_size`` of ``quantization_config``.

        Args:
            config: the ``config.json``.
            layer: the layer whose experts hold the tensor.
            name: the tensor name relative to one of ``expert_prefixes(layer)``.

        Returns:
            The spec, or None for a name this adapter does not check.
        """
        quant = config.get("quantization_config") or {}
        block = tuple(quant.get("weight_block_size") or BLOCK_FP8_DEFAULT)
        return expert_tensor_spec(
            layer.checkpoint_format, name, *self.expert_dims(config), (block[0], block[-1])
        )


def installed_adapters() -> dict[str, ModelAdapter]:
    """Adapters registered under the ``megamoe.adapters`` entry-point group, by name.

    Raises:
        TypeError: an entry point does not resolve to a ``ModelAdapter`` instance.
    """
    found: dict[str, ModelAdapter] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        adapter = ep.load()
        if not isinstance(adapter, ModelAdapter):
            raise TypeError(
                f"entry point {ep.name!r} in group {ENTRY_POINT_GROUP!r} gives "
                f"{type(adapter).__name__}, expected a ModelAdapter instance"
            )
        found[adapter.name] = adapter
    return dict(sorted(found.items()))


# Adapters megamoe publishes, for the install hint when none claims a checkpoint.
KNOWN_DISTRIBUTIONS = {"qwen4exp": "megamoe-qwen4exp", "glm5next": "megamoe-glm5next"}


def adapter_for(config: Mapping[str, Any]) -> ModelAdapter:
    """The installed adapter that claims ``config``.

    Raises:
        LookupError: none does; the message lists the installed adapters and the pip
            command for the others.
    """
    adapters = installed_adapters()
    for adapter in adapters.values():
        if adapter.claims(config):
            return adapter
    others = [d for n, d in KNOWN_DISTRIBUTIONS.items() if n not in adapters]
    hint = f"; for other models: pip install {' '.join(others)}" if others else ""
    raise LookupError(
        f"no installed megamoe adapter handles model_type={config.get('model_type')!r} "
        f"(architectures={config.get('architectures')!r}); installed: "
        f"{', '.join(adapters) or 'none'}{hint}"
    )
