"""kernel-fun's ``causal_conv1d``: fla's short causal convolution (the q, k and v convolutions
of every ``KimiDeltaAttention`` layer) with fla-core 0.5.2's signature, on kernel-fun's
kernels where supported and fla's own elsewhere. See ``kernel_fun.cconv.op``."""

from kernel_fun.cconv.op import causal_conv1d, is_supported, last_route

__all__ = ["causal_conv1d", "is_supported", "last_route"]
