"""What every stage entry shares: the ``StageBench`` record and the inputs of a real chain."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from kernel_fun.kda.problems import Problem, problem


@dataclasses.dataclass(frozen=True)
class StageBench:
    """What the stage bench needs of one stage's kernel. ``label`` is the name the stage's
    rows carry for the kernel that ships (the design name the rounds that chose it used);
    ``sweep`` the launch configs worth timing beside the pinned one."""

    stage: str
    label: str
    make_inputs: Callable[..., dict]  # (problem, device, seed) -> the stage's keyword inputs
    bytes: Callable[[Problem], int]  # the fewest bytes the stage moves
    exact: Callable[..., tuple]  # the float64 stage, on the inputs of the first sequences
    ours: Callable[..., tuple]  # (inputs, config or None) -> kernel-fun's outputs
    launch_config: Callable[..., dict]  # (problem, overrides) -> the config that runs
    misses: Callable[..., dict]  # (vs_exact, fla_vs_exact, vs_fla) -> the outputs over their bars
    sweep: tuple[dict, ...] = ()
    fla_outputs: Callable[[tuple], tuple] = tuple  # fla's outputs as ours are compared (B2: u dropped)
    candidate: str | None = None  # (``benchmarks.stage --candidate``: a research kernel in the entry's place)
    key: str = ""  # the entry's name where a stage has two kernels (default: the stage's)
    precompile: bool = True  # Triton's binaries compiled in worker processes first (a CuTe build compiles in place)
    declines: Callable[[dict], str | None] | None = None  # (inputs) -> why the kernel does not take them, or None

    @property
    def name(self) -> str:
        return self.key or self.stage

    def fla(self, **inputs) -> tuple:
        """fla's stage on the inputs (the chain's fla implementation of the stage)."""
        from kernel_fun.kda.stages import stages

        return self.fla_outputs(stages()[self.stage].impls["fla"](**inputs))

    def ships(self, row: dict) -> bool:
        """The stage's kernel is registered and the row ran the config the launcher picks at
        its shape (a row's keys the config does not have are not compared; rows from before
        B6's launch-order switch carry no HEADS_FAST: fla's order)."""
        from kernel_fun.kda.stages import stages

        if row.get("design") != self.label or "ours" not in stages()[self.stage].impls or row.get("candidate"):
            return False
        try:
            picked = self.launch_config(problem(row["shape"]), None)
        except (KeyError, ValueError):  # a shape the launcher does not know
            return False
        config = {**({"HEADS_FAST": False} if "HEADS_FAST" in picked else {}), **(row.get("config") or {})}
        return {k: config.get(k) for k in picked} == picked


def qk_and_gate(p: Problem, device, seed: int):
    """What every stage entry's inputs start from, of the magnitudes a real chain gives:
    ``(randn, q, k, gc)`` with ``randn(*shape, scale=1.0, dtype=bf16)`` drawing on the device
    (GB-sized draws stay there), unit q/k rows in bf16, and the chunk cumsum (fp32) of a
    Kimi-style gate (A_log, dt_bias initialised as Kimi-Linear does, or zero where
    ``p.strong_gate``; ``p.lower_bound``'s form where the problem has one)."""
    from kernel_fun.kda import reference as ref
    from kernel_fun.kda.problems import dt_bias_init

    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    B, T, H, HV, K = p.B, p.T, p.H, p.HV, p.K
    q = torch.nn.functional.normalize(randn(B, T, H, K, dtype=torch.float32), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(randn(B, T, H, K, dtype=torch.float32), dim=-1).bfloat16()
    A_log = torch.log(torch.empty(HV, device=device).uniform_(1, 16, generator=gen))
    dt = torch.exp(torch.empty(HV * K, device=device).uniform_(-6.9, -2.3, generator=gen))
    gc = ref.gate_cumsum(randn(B, T, HV, K), True, A_log, dt_bias_init(dt, p.strong_gate), lower_bound=p.lower_bound)
    return randn, q, k, gc.contiguous()


def chain_runs(p: Problem, device, seed: int, names: tuple[str, ...]) -> dict[str, tuple[dict, tuple]]:
    """(inputs, outputs) of the named stages in one forward through the reference stages
    (torch, on ``device``) at problem ``p``, so a stage's inputs are a real chain's (w and u a
    real WY transform's, the state bounded)."""
    from kernel_fun.kda import chunk_kda, use_impls
    from kernel_fun.kda.problems import make_inputs as call_inputs
    from kernel_fun.kda.stages import capture_stages

    kwargs = call_inputs(p, device=device, seed=seed, requires_grad=False)
    with torch.no_grad(), use_impls("reference"), capture_stages() as log:
        chunk_kda(**kwargs)
    return {name: (x, out) for name, _, x, out in log if name in names}
