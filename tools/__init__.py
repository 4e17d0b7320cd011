"""Research instruments for kernel-fun's kernels: probes, ablation kernels, timelines and the
offline compile report. They help find and explain a design; they are not part of what
users install (the wheel is ``src/kernel_fun``), and nothing under ``src/`` imports them.
Run from the repository root: ``python -m tools.compile_report --design fullk``.
"""
