"""The ``torch.nn.Module``s an engine holds, and the backend contract they run through.

``experts.MegaMoEExperts`` owns one layer's routed experts in the run format: it loads
through ``megamoe.core.loading.expert_loading`` and runs its forward as one custom op
(``experts_op``: ``torch.ops.megamoe.experts``) that calls its backend. ``experts_backend``
is the interface a backend implements and ``backend_select`` picks one by name
(``"auto"``, ``"reference"``, ``"deepgemm"``); the implementations live above, in
``megamoe.core.backends``, and are imported by name when chosen (DeepGEMM is optional at
run time). ``shared_expert`` is the shared SwiGLU MLP (``gemm_sm_target`` the SMs its FP8
GEMM may take), ``block_setup`` turns a block's options into the experts' settings,
``parallel`` holds the parallel settings an engine fills in, and ``fixed_module`` keeps a
module's tensors where the kernel needs them.
"""
