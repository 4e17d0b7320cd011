"""Kimi Delta Attention (KDA): ``chunk_kda``, drop-in for ``fla.ops.kda.chunk_kda``.

``from kernel_fun.kda import chunk_kda`` is the one line a user changes. ``is_supported``
says whether a call would run kernel-fun's chain; ``last_record`` says what the last call
ran, stage by stage; ``use_impls`` forces implementations (tests, benchmarks).

Layout: ``chunk.py`` the public function (validation, the gate, fla's fallback, a plan kept
per call shape), ``chain.py`` the stages and the autograd Function over them, ``ops.py`` the
same chain as PyTorch operators (torch.compile, fake tensors), ``stages.py`` the dispatcher,
``reference.py`` the torch references and the float64 oracle, ``kernels/`` kernel-fun's
kernels (one module per stage unit, registered there), ``problems.py`` the named shapes.
"""

from kernel_fun.kda import chain as _chain  # noqa: F401  (declares the stages)
from kernel_fun.kda import kernels as _kernels  # noqa: F401  (registers kernel-fun's kernels)
from kernel_fun.kda.chunk import PARAMETERS, chunk_kda, is_supported
from kernel_fun.kda.stages import CallRecord, last_record, stages, use_impls

__all__ = ["chunk_kda", "is_supported", "last_record", "use_impls", "stages", "CallRecord", "PARAMETERS"]
