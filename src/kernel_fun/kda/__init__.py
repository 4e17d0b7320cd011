"""Kimi Delta Attention (KDA): ``chunk_kda``, drop-in for ``fla.ops.kda.chunk_kda``.

``from kernel_fun.kda import chunk_kda`` is the one line a user changes. ``is_supported``
says whether a call would run kernel-fun's chain; ``last_record`` says what the last call
ran, stage by stage; ``use_impls`` forces implementations (tests, benchmarks).
"""

from kernel_fun.kda import chain as _chain  # noqa: F401  (registers the stages)
from kernel_fun.kda.kernels import wy_bwd as _wy_bwd  # noqa: F401  (B6: kernel-fun's kernels)
from kernel_fun.kda.kernels import intra_bwd as _intra_bwd  # noqa: F401  (B7 and the B7-B9 unit)
from kernel_fun.kda.kernels import scan_fwd as _scan_fwd  # noqa: F401  (the F7-F8 unit and B3)
from kernel_fun.kda.kernels import wy_fwd as _wy_fwd  # noqa: F401  (F6 and B2)
from kernel_fun.kda.chunk import PARAMETERS, chunk_kda, is_supported
from kernel_fun.kda.stages import CallRecord, last_record, stages, use_impls

__all__ = ["chunk_kda", "is_supported", "last_record", "use_impls", "stages", "CallRecord", "PARAMETERS"]
