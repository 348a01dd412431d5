"""The contract between megamoe-core and model adapters, and their discovery.

Adapters are separate distributions that register an instance of ``ModelAdapter`` under
the entry-point group ``megamoe.adapters``. Core never imports an adapter by name: the
checkpoint reader and the CLI find them here.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Collection, Generator, Iterable, Iterator, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from megamoe.core.checkpoint.expert_names import TensorSpec, expert_tensor_spec, parse_expert_name
from megamoe.core.checkpoint.files import CONFIG_FILE
from megamoe.core.checkpoint.hf_config import (
    MoEConfig,
    dense_cause,
    is_composite,
    mtp_count_text,
    quantization_config,
)
from megamoe.core.checkpoint.layers import (
    MLP,
    MoELayer,
    SharedExpert,
    decoder_prefix,
)
from megamoe.core.checkpoint.quant_config import detect_expert_format, mark_converted
from megamoe.core.checkpoint.reader import CheckpointReader, read_config
from megamoe.core.errors import CheckpointError, NoAdapterError, NoMoELayerError, note_source
from megamoe.core.modules.block_setup import EXPERTS
from megamoe.core.modules.fixed_module import FixedModule
from megamoe.core.modules.parallel import ParallelSettings
from megamoe.core.numerics.formats import BLOCK_FP8_DEFAULT, WeightFormat

if TYPE_CHECKING:
    from megamoe.core.modules.experts import MegaMoEExperts

logger = logging.getLogger("megamoe")

ENTRY_POINT_GROUP = "megamoe.adapters"


@dataclass(frozen=True)
class SyntheticSizes:
    """Sizes of a synthetic checkpoint (small, but every dimension a multiple of 128)."""

    num_layers: int = 2
    hidden_size: int = 256
    intermediate_size: int = 256
    num_experts: int = 8
    top_k: int = 2
    shared_intermediate_size: int = 256


class MoEBlock(FixedModule):
    """What ``ModelAdapter.build_block`` returns: one MoE layer on megamoe.

    Its constructor takes ``(config, *, prefix, parallel, **options)`` with the options of
    ``megamoe.core.modules.block_setup.BlockOptions``. Subclasses load their tensors in
    ``load_weights`` and commit them in ``finalize``; ``load_from_checkpoint`` drives both.

    Its tensors keep their dtypes and device through ``.to()`` and the like, and it refuses
    ``load_state_dict()``, copies and pickling (``megamoe.core.modules.fixed_module``).

    Attributes:
        experts: the routed experts module.
        prefix: the block's tensor prefix.
        is_mtp: the block belongs to the MTP drafter.
        device: where its tensors live.
    """

    experts: MegaMoEExperts
    prefix: str
    is_mtp: bool

    @property
    def fixed_label(self) -> str:
        """The block's prefix, for ``FixedModule``'s refusals."""
        return self.prefix

    @abc.abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load tensors named relative to the block prefix; ``finalize()`` commits them."""

    @abc.abstractmethod
    def finalize(self) -> None:
        """Check that the load is complete and commit the experts' update."""

    @abc.abstractmethod
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Routed plus shared output for this rank's tokens.

        Args:
            hidden_states: (tokens, hidden_size) bfloat16.

        Returns:
            (tokens, hidden_size) bfloat16.

        Raises:
            ValueError: a shape that does not match.
            TypeError: a dtype other than bfloat16.
            RuntimeError: the block was not finalized.
        """

    def wants(self, name: str) -> bool:
        """Whether tensor ``name`` (relative to the block prefix) concerns this rank.

        Routed-expert tensors (``experts.{e}.*``) of experts that other ranks hold do not;
        anything else does (fused expert tensors, and names that do not parse, so that
        loading reports them).
        """
        head, _, rest = name.partition(".")
        if head != EXPERTS:
            return True
        parsed = parse_expert_name(rest)
        if parsed is None or parsed.expert is None:
            return True
        if parsed.expert >= self.experts.num_logical_experts:
            return True
        return bool(self.experts.map_global_expert_id(parsed.expert))

    def load_from_checkpoint(self, reader: CheckpointReader) -> None:
        """Load this layer's tensors (only this rank's experts) and finalize.

        Only this rank's experts are read, one tensor at a time; a reader opened with an
        adapter validated every header when it was opened. Empty tensors are nothing to load
        (transformers saves a zero-width shared MLP for a model without shared experts) and
        are not passed on.

        Args:
            reader: the checkpoint.

        Raises:
            CheckpointError: missing, unreadable or mismatching tensors.
            ValueError / IncompleteShardsError / MissingExpertsError: see the block's
                ``load_weights`` and ``finalize``. An error raised while a tensor is loaded
                carries a note (``add_note``) naming the file it was read from.
        """
        last: list[str] = []  # the tensor being loaded, for an error's note

        def tensors() -> Generator[tuple[str, torch.Tensor]]:
            for name, tensor in reader.iter_tensors(self.prefix, keep=self.wants):
                if tensor.numel():
                    last[:] = [name]
                    yield name, tensor
                    last.clear()  # taken without error

        stream = tensors()
        try:
            self.load_weights(stream)
        except CheckpointError:
            raise  # names its file already
        except Exception as err:
            if last:
                full = f"{self.prefix}.{last[0]}"
                note_source(err, full, reader.source_of(full))
            raise
        finally:
            stream.close()  # an error mid-way leaves no shard open
        self.finalize()


class ModelAdapter(abc.ABC):
    """A model family on megamoe: config parsing, layers, blocks, synthetic checkpoints."""

    name: ClassVar[str]  # short name, e.g. "qwen4exp"
    distribution: ClassVar[str]  # pip name, e.g. "megamoe-qwen4exp"
    model_types: ClassVar[tuple[str, ...]]  # config.json "model_type" values it claims
    architectures: ClassVar[tuple[str, ...]]  # config.json "architectures" it claims
    checkpoint_formats: ClassVar[tuple[WeightFormat, ...]]  # formats it loads
    config_class: ClassVar[type[MoEConfig]]  # the parsed config.json (parse_config)
    block_class: ClassVar[type[MoEBlock]]  # what build_block constructs
    # Run formats whose kernel can take the shared expert as one more expert: convert
    # converts the shared expert (expert_prefixes beyond the first) only to these.
    fusing_run_formats: ClassVar[frozenset[WeightFormat]] = frozenset()

    def claims(self, config: Mapping[str, Any]) -> bool:
        """Whether this adapter handles a checkpoint with this ``config.json``.

        The top-level ``model_type`` or ``architectures`` decide; a composite config's
        ``text_config.model_type`` counts too.
        """
        types = {config.get("model_type")}
        if is_composite(config):
            types.add(config["text_config"].get("model_type"))
        if types & set(self.model_types):
            return True
        return any(arch in self.architectures for arch in config.get("architectures") or ())

    @abc.abstractmethod
    def mtp_block_prefix(self, config: MoEConfig, decoder: str, index: int) -> str:
        """The tensor prefix of MTP drafter layer ``index``'s MoE block.

        Args:
            config: the parsed config.
            decoder: the decoder layers' prefix (see ``decoder_prefix``).
            index: the drafter layer, from 0.
        """

    def parse_config(self, config: Mapping[str, Any]) -> MoEConfig:
        """``config.json`` parsed and validated by ``config_class.from_dict``.

        Raises:
            ValueError: a missing or invalid key (named).
            NotImplementedError: a setting megamoe cannot run (named).
        """
        return self.config_class.from_dict(config)

    def moe_layers(
        self, config: Mapping[str, Any], tensor_names: Collection[str] | None = None
    ) -> list[MoELayer]:
        """Every MoE layer of the checkpoint with the format of its routed experts.

        ``{decoder}.{i}.mlp`` for each main-model layer ``i`` the config marks as MoE
        (``MoEConfig.is_moe_layer``; ``decoder`` from ``decoder_prefix``), then the
        ``num_nextn_predict_layers`` MTP drafter layers at ``mtp_block_prefix``
        (``is_mtp=True``). Given the checkpoint's tensor names, MTP layers the config
        declares but the checkpoint does not hold (what transformers' ``save_pretrained``
        writes: it never saves MTP layers) are left out, and that is logged (once per
        checkpoint opened: ``CheckpointReader`` calls this once).

        Args:
            config: the parsed ``config.json``.
            tensor_names: every tensor name of the checkpoint; None decides from the
                config alone.

        Raises:
            NoMoELayerError: no layer is left: every decoder layer is dense and no MTP
                layer is held (a ``CheckpointError``); the message names the rule that
                made them dense.
            ValueError: an invalid config key (named).
            NotImplementedError: a quantization method megamoe cannot load, naming it and
                the layer prefix.
        """
        cfg = self.parse_config(config)
        decoder = decoder_prefix(config, tensor_names)
        found = [
            (i, f"{decoder}.{i}.{MLP}", False)
            for i in range(cfg.num_hidden_layers)
            if cfg.is_moe_layer(i)
        ]
        declared = [
            (j, self.mtp_block_prefix(cfg, decoder, j), True)
            for j in range(cfg.num_nextn_predict_layers)
        ]
        held = declared
        if tensor_names is not None:
            heads = {p: f"{p}.{EXPERTS}." for _, p, _ in declared}
            held = [m for m in declared if any(n.startswith(heads[m[1]]) for n in tensor_names)]
        if len(held) < len(declared):
            logger.warning(
                "%s checkpoint declares %d MTP layer(s) but holds the experts of %d "
                "(e.g. no tensors under %s.*; transformers' save_pretrained writes none, and "
                "a config without the count declares the release's): loading the layers it "
                "holds, without those MTP drafter layers",
                self.name,
                len(declared),
                len(held),
                next(p for _, p, _ in declared if all(p != h[1] for h in held)),
            )
        if not found and not held:
            raise NoMoELayerError(_no_moe_layer(cfg, len(declared)))
        return [
            MoELayer(
                index=index,
                prefix=prefix,
                checkpoint_format=detect_expert_format(
                    cfg.quantization_config,
                    f"{prefix}.{EXPERTS}",
                    num_experts=cfg.num_routed_experts,
                ),
                is_mtp=is_mtp,
            )
            for index, prefix, is_mtp in found + held
        ]

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
        **options: Any,
    ) -> MoEBlock:
        """The MoE block of ``layer`` (a ``block_class``), weights still unloaded.

        ``load_from_checkpoint`` loads them. ``moe_format`` forces the run format of the
        main model's layers; the MTP drafter's layers take the default. ``options`` go to
        the block class as they are: the other ``BlockOptions`` (``emulate_kernel``,
        ``arch``, ``reload_staging_bytes``, ``experts_path``, ``small_batch_max_tokens``) and
        the adapter's own (e.g. ``use_aux_stream``, ``shared_gemm``). See the adapter's block
        class for the errors.
        """
        return self.block_class(
            config,
            prefix=layer.prefix,
            parallel=parallel,
            moe_format=moe_format,
            is_mtp=layer.is_mtp,
            backend=backend,
            device=device,
            max_num_tokens=max_num_tokens,
            **options,
        )

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

    def converted_config(
        self,
        config: Mapping[str, Any],
        fmt: WeightFormat,
        layers: Iterable[MoELayer] | None = None,
    ) -> dict[str, Any]:
        """``config.json`` of a checkpoint whose expert groups were converted to ``fmt``.

        The default lists every one of ``expert_prefixes`` of every converted MoE layer in
        the top-level ``quantization_config`` (see
        ``megamoe.core.checkpoint.quant_config.mark_converted``); every other module keeps its
        format.

        Args:
            config: the source ``config.json``.
            fmt: the experts' new format.
            layers: the converted layers (the checkpoint reader's); None takes
                ``moe_layers(config)``.
        """
        layers = self.moe_layers(config) if layers is None else layers
        prefixes = [p for layer in layers for p in self.expert_prefixes(layer)]
        converted = dict(config)
        # The top level is where transformers looks first (and where it writes the key).
        converted["quantization_config"] = mark_converted(
            quantization_config(config), fmt, prefixes
        )
        return converted

    def expert_prefixes(self, layer: MoELayer) -> tuple[str, ...]:
        """Tensor prefixes of the expert groups ``megamoe convert`` converts in ``layer``.

        The first holds the routed experts (``{e}.{proj}.*`` or fused). Further prefixes,
        e.g. a shared expert the kernel runs as one more expert (``{proj}.*``, no index),
        are converted to the same format when the checkpoint has them, stored as the routed
        experts are, and the target is one of ``fusing_run_formats`` (elsewhere the shared
        expert runs as a separate MLP from its checkpoint tensors, so converting it would
        only lose precision); ``converted_config`` marks them converted, and convert
        unmarks those it leaves as stored.
        """
        return (f"{layer.prefix}.experts",)

    def shared_expert(self, config: Mapping[str, Any], layer: MoELayer) -> SharedExpert | None:
        """The shared expert of ``layer`` the checkpoint must hold; None for a model without.

        The checkpoint reader checks its tensors' names, dtypes and shapes from the headers,
        as it does the routed experts'. The default: none.
        """
        return None

    def dense_tensors(
        self, config: Mapping[str, Any], layer: MoELayer
    ) -> dict[str, tuple[int, ...]]:
        """The unquantized tensors ``layer``'s block loads besides the experts, with shapes.

        Full names (the router weight, a selection bias, a gate), each loaded as bf16, fp16
        or fp32; the checkpoint reader checks they are there with these shapes, from the
        headers. The default: the router ``gate.weight`` (E, H).
        """
        experts, hidden, _ = self.expert_dims(config)
        return {f"{layer.prefix}.gate.weight": (experts, hidden)}

    def expert_dims(self, config: Mapping[str, Any]) -> tuple[int, int, int]:
        """``(routed experts E, hidden size H, expert intermediate size I)`` of ``config``.

        Raises:
            ValueError: a missing or invalid key (see ``parse_config``).
            NotImplementedError: a setting megamoe cannot run (see ``parse_config``).
        """
        cfg = self.parse_config(config)
        return cfg.num_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size

    def expected_expert_tensor(
        self, config: Mapping[str, Any], layer: MoELayer, name: str
    ) -> TensorSpec | None:
        """The dtype and shape routed-expert tensor ``name`` must have in the checkpoint.

        Checked from the safetensors headers before any tensor of the layer is read. The
        default covers the names ``megamoe.core.checkpoint.expert_names`` describes, stored in
        ``layer.checkpoint_format`` with ``expert_dims(config)``; block-FP8 is 128x128 (the
        only block ``quant_config`` detects as FP8_BLOCK, whatever the config's
        ``weight_block_size`` says for other methods).

        Args:
            config: the ``config.json``.
            layer: the layer whose experts hold the tensor.
            name: the tensor name relative to one of ``expert_prefixes(layer)``.

        Returns:
            The spec, or None for a name this adapter does not check.
        """
        return expert_tensor_spec(
            layer.checkpoint_format, name, *self.expert_dims(config), BLOCK_FP8_DEFAULT
        )


def _no_moe_layer(cfg: MoEConfig, mtp_declared: int) -> str:
    """Why a config has no MoE layer: each decoder layer's rule, and the MTP layers."""
    layers = cfg.num_hidden_layers
    causes = dict.fromkeys(dense_cause(cfg, i)[0] for i in range(layers))
    mtp = (
        f"it holds the experts of none of the {mtp_declared} MTP layer(s) {mtp_count_text(cfg)} "
        "declares"
        if mtp_declared
        else f"it has no MTP layer ({mtp_count_text(cfg)})"
    )
    return (
        f"config.json: the checkpoint has no MoE layer: each of its {layers} decoder layer(s) "
        f"is dense by {'; '.join(causes)}, and {mtp}; megamoe has nothing to load, verify or "
        "convert (a dense model needs no megamoe; if this one has experts, fix its config.json)"
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


def adapter_for(config: Mapping[str, Any], source: str = "config.json") -> ModelAdapter:
    """The installed adapter that claims ``config`` (read from ``source``, for the message).

    Raises:
        NoAdapterError: none does (a ``CheckpointError`` and a ``LookupError``); the
            message lists the installed adapters with the model types each takes, and the
            pip command for the others.
    """
    adapters = installed_adapters()
    for adapter in adapters.values():
        if adapter.claims(config):
            return adapter
    installed = ", ".join(
        f"{name} ({', '.join(adapter.model_types)})" for name, adapter in adapters.items()
    )
    others = [d for n, d in KNOWN_DISTRIBUTIONS.items() if n not in adapters]
    hint = f"; for other models: pip install {' '.join(others)}" if others else ""
    raise NoAdapterError(
        f"{source}: no installed megamoe adapter handles "
        f"model_type={config.get('model_type')!r} "
        f"(architectures={config.get('architectures')!r}); installed: "
        f"{installed or 'none'}{hint}"
    )


def open_checkpoint(path: str | Path) -> tuple[CheckpointReader, ModelAdapter]:
    """Open a checkpoint with the installed adapter that claims its ``config.json``.

    Args:
        path: the checkpoint directory.

    Returns:
        ``(reader, adapter)``; the reader has validated the whole checkpoint.

    Raises:
        CheckpointError: see ``CheckpointReader``.
        NoAdapterError: no installed adapter claims the model (a ``CheckpointError`` and a
            ``LookupError``); the message lists the installed adapters and the pip command
            for the others.
        UnsupportedCheckpointError: a setting megamoe cannot run (also a
            ``NotImplementedError``).
    """
    where = Path(path) / CONFIG_FILE
    try:
        adapter = adapter_for(read_config(path), str(where))
    except (TypeError, AttributeError) as err:  # e.g. a list where model_type is a string
        raise CheckpointError(
            f"{where}: model_type or architectures of the wrong type ({err}); expected a "
            "string and a list of strings"
        ) from None
    return CheckpointReader(path, adapter), adapter
