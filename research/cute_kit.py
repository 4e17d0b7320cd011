"""What the CuTe DSL probes (research.b6_cute_probe, research.b7_cute_probe) share: register
fragment helpers for the wgmma accumulator layout, the check that CuTe DSL can run here, the
offline compile report."""

import os


def regs(x):
    """x (a thread's [64, 64] wgmma-layout fragment of fp32 values, in a CuTe DSL kernel) in
    registers, each element addressable."""
    import cutlass
    import cutlass.cute as cute

    r = cute.make_rmem_tensor(x.shape, cutlass.Float32)
    r.store(x)
    return r


def quad_row_sums(x):
    """The sums over a [64, 64] tile's columns of x (a thread's wgmma-layout fragment: its
    element i = a + 2 b + 4 n is row lane // 4 + 8 b of the warp's 16, column 8 n + 2 (lane %
    4) + a) for the thread's two rows, in every lane of its quad."""
    import cutlass
    import cutlass.cute as cute

    sums = []
    for b in (0, 1):
        t = cutlass.Float32(0.0)
        for i in range(cute.size(x.shape)):
            if i // 2 % 2 == b:
                t = t + x[i]
        t = t + cute.arch.shuffle_sync_bfly(t, 1)
        sums.append(t + cute.arch.shuffle_sync_bfly(t, 2))
    return sums


def warp_col_sums(x):
    """The sums over the warp's 16 rows of x (as in ``quad_row_sums``) by column, in the
    elements of row b = 0 (registers, in every lane with the column)."""
    import cutlass.cute as cute

    c = regs(x)
    for i in range(cute.size(x.shape)):
        if i // 2 % 2 == 0:
            c[i] = c[i] + c[i + 2]
    for d in (4, 8, 16):
        for i in range(cute.size(x.shape)):
            if i // 2 % 2 == 0:
                c[i] = c[i] + cute.arch.shuffle_sync_bfly(c[i], d)
    return c


def cute_unavailable(t) -> str | None:
    """Why a CuTe DSL probe cannot run on ``t``'s device (an sm_90 GPU and CuTe DSL installed),
    or None."""
    import torch

    if not t.is_cuda or torch.cuda.get_device_capability(t.device) != (9, 0):
        return "the CuTe probes are built for sm_90a"
    try:
        import cutlass.cute  # noqa: F401
    except ImportError:
        return "CuTe DSL (nvidia-cutlass-dsl) is not installed"
    return None


def ptxas_report(dump: str) -> dict:
    """What a CuTe DSL build dumped in ``dump`` is:
    - registers, spills, stack and ptxas's notes (``benchmarks.compile_report.ptxas_numbers``)
      from Triton's bundled ptxas (``-v``) on its PTX. CuTe DSL 4.8.1
      writes PTX ISA 8.8 and Triton 3.6's ptxas reads up to 8.7, so the header is lowered for
      this count only (the cubin CuTe DSL built with its own compiler is the one that runs);
      (the notes that cost speed: setmaxnreg ignored (C7508), every wgmma serialised
      (C7514, C7515), a wait (C7517) or a fence (C7519) added);
    - in the cubin that runs, the setmaxnreg instructions, wgmmas and local-memory stores it
      kept;
    - and the PTX itself (``ptx``)."""
    import glob
    import re
    import subprocess

    import triton

    from benchmarks.compile_report import ptxas_numbers

    (ptx_path,) = glob.glob(os.path.join(dump, "*.sm_90a.ptx"))
    ptx = open(ptx_path).read()
    lowered = os.path.join(dump, "isa87.ptx")
    with open(lowered, "w") as f:
        f.write(re.sub(r"^\.version 8\.8", ".version 8.7", ptx, flags=re.M))
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    log = subprocess.run([ptxas, "-arch=sm_90a", "-v", lowered, "-o", os.devnull], capture_output=True,
                         text=True, check=True).stderr
    (cubin,) = glob.glob(os.path.join(dump, "*.cubin"))
    sass = subprocess.run([os.path.join(os.path.dirname(ptxas), "nvdisasm"), "-c", cubin], capture_output=True,
                          text=True, check=True).stdout
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
    return {**ptxas_numbers(log), "sass_instructions": len(ops),
            "sass_setmaxnreg": sum(o.startswith("USETMAXREG") for o in ops),
            "sass_hgmma": sum(o.startswith("HGMMA") for o in ops), "sass_stl": sum(o.startswith("STL") for o in ops),
            "ptx": ptx}
