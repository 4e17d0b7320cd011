"""fla's autotuner choices, stored in fla's own config-file format.

fla's ``fla_cache_autotune`` kernels read ``$FLA_CONFIG_DIR/<kernel_name>.json`` when
``FLA_CACHE_MODE`` is set (read once, when fla is imported). After a bench run the configs
fla's autotuner chose are written there, so the next run on a fresh machine compiles one
config per kernel instead of autotuning ~200 variants (~220 s on an H200 per shape family).
STRICT mode is used: an entry applies only to the exact autotune key it was tuned for.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from benchmarks.rows import REPO

# KERNEL_FUN_FLA_CONFIGS names another folder
CONFIG_ROOT = Path(os.environ["KERNEL_FUN_FLA_CONFIGS"]) if os.environ.get("KERNEL_FUN_FLA_CONFIGS") else \
    REPO / "benchmarks" / "fla_configs"


def gpu_dir(gpu_name: str) -> Path:
    import re

    return CONFIG_ROOT / (re.sub(r"[^0-9A-Za-z]+", "_", gpu_name).strip("_") or "unknown_gpu")


def use_stored_configs(gpu_name: str) -> Path | None:
    """Point fla at the stored configs for this GPU. Must run before fla is imported."""
    if "fla" in sys.modules and "fla.ops.utils.cache" in sys.modules:
        raise RuntimeError("fla was imported before its config directory was set")
    path = gpu_dir(gpu_name)
    if "FLA_CONFIG_DIR" in os.environ or not path.is_dir():
        return None
    os.environ["FLA_CONFIG_DIR"] = str(path)
    os.environ.setdefault("FLA_CACHE_MODE", "strict")
    return path


def _fla_autotuners():
    """fla's cache-aware autotuners, found through the kernels its modules define (a
    ``@triton.heuristics`` layer holds the autotuner in ``.fn``)."""
    from fla.ops.utils.cache import CachedAutotuner

    seen = set()
    for name, module in list(sys.modules.items()):
        if not name.startswith("fla.") or module is None:
            continue
        for obj in list(vars(module).values()):
            for _ in range(3):
                if obj is None or isinstance(obj, CachedAutotuner):
                    break
                obj = getattr(obj, "fn", None)
            if isinstance(obj, CachedAutotuner) and id(obj) not in seen:
                seen.add(id(obj))
                yield obj


def _config_dict(cfg) -> dict:
    return {
        "kwargs": dict(cfg.kwargs),
        "num_warps": cfg.num_warps,
        "num_stages": cfg.num_stages,
        "num_ctas": getattr(cfg, "num_ctas", 1),
        "maxnreg": getattr(cfg, "maxnreg", None),
    }


def dump(directory: Path) -> int:
    """Merge every choice fla's autotuners made in this process into ``directory``; returns
    the number of entries written."""
    import triton
    from fla.ops.utils.cache import AutotuneKey

    directory.mkdir(parents=True, exist_ok=True)
    written = 0
    for tuner in _fla_autotuners():
        if not tuner.cache:
            continue
        path = directory / f"{tuner.kernel_name}.json"
        data = json.loads(path.read_text()) if path.exists() else {}
        entries = data.get("autotune_entries") or {}
        for key, cfg in tuner.cache.items():
            entries[AutotuneKey.key_hash(key)] = {
                "autotune_key": AutotuneKey.normalize_autotune_key(list(key)),
                "config": _config_dict(cfg),
            }
            written += 1
        data.update(kernel_name=tuner.kernel_name, triton_version=triton.__version__, autotune_entries=entries)
        path.write_text(json.dumps(with_default(data), indent=1, sort_keys=True) + "\n")
    return written


def with_default(data: dict) -> dict:
    """The file with a ``default_config`` (the first stored entry's, in key order, when it
    has none): with ``FLA_CACHE_MODE=full`` a call whose key no entry matches runs it
    instead of autotuning. Packed sequences need that: they add the dtypes of cu_seqlens and
    chunk_indices to fla's keys, so no dense entry matches them even fuzzily, and their
    first call autotunes every varlen kernel for minutes. For tests, where the config
    changes no value; the bench keeps FUZZY/STRICT and autotunes what it times."""
    entries = data.get("autotune_entries") or {}
    if data.get("default_config") is None and entries:
        data = dict(data, default_config=entries[sorted(entries)[0]]["config"])
    data.setdefault("default_config", None)
    return data

