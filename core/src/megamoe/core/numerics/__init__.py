"""Formats and bit-exact casts: pure functions on tensors, no modules and no files.

The bottom of ``megamoe.core`` (only ``megamoe.core.errors`` lies below). ``formats`` names
the weight formats, which kernel runs which, and the kernels' size rules; ``quant`` casts a
float tensor to MXFP8, MXFP4 or block-FP8 and back, bit for bit as DeepGEMM does
(``mx_codes`` holds the E2M1 and UE8M0 codes); ``swiglu`` is
the activation with the optional clamp, ``router_logits`` a router's logits in the kernel's
precision, ``fp8_gemm`` the shared expert's FP8 GEMM and its activation cast, ``dispatch``
the Hopper kernel's FP8 input buffer. Data flows in as tensors and out as tensors.
"""
