"""Where the bench reads and writes: the repository's ``bench/`` folder when kernel-fun runs
from its checkout (an editable install, as ``scripts/install`` makes), else folders named by
the environment or under the working directory -- never a path computed inside
site-packages.

- ``KERNEL_FUN_RESULTS``: the folder of result rows (default: the checkout's
  ``bench/results``, else ``./kernel_fun_results``).
- ``KERNEL_FUN_FLA_CONFIGS``: the folder of stored fla autotune choices (default: the
  checkout's ``bench/fla_configs``, else ``./kernel_fun_fla_configs``).
"""

from __future__ import annotations

import os
from pathlib import Path


def checkout() -> Path | None:
    """The kernel-fun repository this package was imported from, or None when installed."""
    root = Path(__file__).resolve().parents[3]
    project = root / "pyproject.toml"
    if project.is_file() and 'name = "kernel-fun"' in project.read_text():
        return root
    return None


def _folder(variable: str, in_checkout: str, elsewhere: str) -> Path:
    if os.environ.get(variable):
        return Path(os.environ[variable])
    root = checkout()
    return root / in_checkout if root is not None else Path.cwd() / elsewhere


def results_dir() -> Path:
    return _folder("KERNEL_FUN_RESULTS", "bench/results", "kernel_fun_results")


def fla_configs_dir() -> Path:
    return _folder("KERNEL_FUN_FLA_CONFIGS", "bench/fla_configs", "kernel_fun_fla_configs")
