"""A Hugging Face checkpoint on disk: its configs, tensor names, files and the validated reader.

``hf_config`` and ``quant_config`` read ``config.json`` (the MoE sizes, and which format each
layer's experts are stored in); ``expert_names`` names every expert tensor a format needs;
``files`` keeps every file name inside the checkpoint directory and reads the safetensors
headers; ``shardfile`` reads and writes single tensors by position; ``nvfp4`` turns an NVFP4
checkpoint's weight, block and global scales into values (a checkpoint format only); ``layers``
holds the ``MoELayer`` and ``SharedExpert`` records and ``ModelRules``, what the reader asks of
a model adapter; ``reader.CheckpointReader`` validates a whole checkpoint from its headers
before any data is read, then streams one layer's local expert tensors. ``convert_output`` is
the confined output directory ``megamoe.core.convert`` writes. Data flows from files to ``(name,
tensor)`` pairs handed to ``megamoe.core.loading``.
"""
