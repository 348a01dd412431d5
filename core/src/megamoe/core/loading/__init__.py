"""A weight's way from the checkpoint reader to the kernel tensors.

A shard (one projection of one expert) arrives (``arrival``), waits for its other half in
``pairing.ShardPairing`` (a weight and its scale may come in separate calls), is checked
for non-finite values (``finiteness``), requantized once when complete
(``megamoe.core.numerics.quant``) and written in place or staged (``staging``) until
``finalize()``. ``expert_layout`` says which slot each expert takes on this rank and checks
shapes, ``l1_order`` the gate/up row order a kernel reads, ``tagging`` marks the finished
tensors with their format, ``dense_update`` does the same safe reload for routers, biases and
the shared MLP, and ``expert_loading`` is the experts module's loading half that ties them
together. Nothing here is a ``torch.nn.Module``: ``megamoe.core.modules`` holds those.
"""
