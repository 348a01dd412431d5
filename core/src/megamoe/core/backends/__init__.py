"""Experts backends: what runs ``MegaMoEExperts.forward`` on a device.

Each implements ``megamoe.core.modules.experts_backend.ExpertsBackend`` and is found by name
(``megamoe.core.modules.backend_select``). ``reference`` is torch on any device, the
numerical oracle; ``deepgemm`` runs DeepGEMM's MegaMoE kernel, with ``deepgemm_layout``
writing the kernel's physical layout in place and ``symm_buffer`` the symmetric buffer one
per (group, shape, kind).
"""
