"""Named KDA problems and their random inputs, shared by the tests, the bench and the demo.

Inputs follow fla's own tests (whose error budgets kernel-fun adopts): q, k, v uniform in
[0, 1) (q, k row-normalized when l2norm is not done in the op, which keeps the delta rule
contractive); raw gate input standard
normal with Kimi-Linear's A_log and dt_bias initializations, or a pre-computed log-decay ``logsigmoid(x) / 16``; beta
in (0, 1) (raw logits when the op applies the sigmoid). Never zeros: zeros hide unwritten
outputs and wrong indexing.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import torch
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class Problem:
    name: str
    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    gate_in_kernel: bool = True
    l2norm_in_kernel: bool = True
    beta_sigmoid_in_kernel: bool = False
    allow_neg_eigval: bool = False
    lower_bound: float | None = None
    initial_state: bool = False
    output_final_state: bool = False
    cu_seqlens: tuple[int, ...] | None = None
    dtype: torch.dtype = torch.bfloat16
    state_v_first: bool = False
    safe_gate: bool = False
    disable_recompute: bool = False
    # dt_bias zero in place of Kimi-Linear's initialisation: softplus ~0.69 a token times
    # exp(A_log) in [1, 16], the strong gates of fast-forgetting heads (up to ~16 in log2 a
    # token, where the initialisation gives ~0.01-2)
    strong_gate: bool = False

    @property
    def sequences(self) -> int:
        return self.B if self.cu_seqlens is None else len(self.cu_seqlens) - 1

    @property
    def chunk_heads(self) -> int:
        if self.cu_seqlens is None:
            return self.B * -(-self.T // 64) * self.HV
        lens = [b - a for a, b in zip(self.cu_seqlens[:-1], self.cu_seqlens[1:])]
        return sum(-(-n // 64) for n in lens) * self.HV

    def describe(self) -> str:
        flags = []
        if self.gate_in_kernel:
            flags.append("gate" if self.lower_bound is None else f"gate(lb={self.lower_bound})")
        if self.l2norm_in_kernel:
            flags.append("l2norm")
        if self.beta_sigmoid_in_kernel:
            flags.append("beta_sigmoid" + ("(neg)" if self.allow_neg_eigval else ""))
        if self.initial_state:
            flags.append("h0")
        if self.cu_seqlens is not None:
            flags.append(f"varlen{len(self.cu_seqlens) - 1}")
        for name in ("state_v_first", "safe_gate", "disable_recompute", "strong_gate"):
            if getattr(self, name):
                flags.append(name)
        return (f"B{self.B} T{self.T} H{self.H} HV{self.HV} K{self.K} V{self.V} "
                f"{str(self.dtype).replace('torch.', '')} {'+'.join(flags) or 'pre-gated'}")


# the documents of prod_packed, in order (131,072 tokens)
PACKED_LENGTHS = (9000, 3100, 12000, 700, 5500, 8192, 2300, 15000, 4096, 6100, 300, 9800, 7000, 1234, 11000, 5000,
                  3900, 8400, 600, 10000, 7850)

# The bench's named shapes: production Kimi-Linear-style training calls.
SHAPES = {
    "prod8192_gate": Problem("prod8192_gate", 16, 8192, 16, 16, 128, 256),
    "prod8192": Problem("prod8192", 16, 8192, 16, 16, 128, 256, gate_in_kernel=False),
    "kimi": Problem("kimi", 8, 8192, 32, 32, 128, 128),
    "b8": Problem("b8", 8, 8192, 16, 16, 128, 256),
    "small": Problem("small", 4, 8192, 8, 8, 128, 256),
    # prod8192_gate with the flags fla's own KimiDeltaAttention layer passes on every call
    # (the V-first state layout, beta's sigmoid in the op), and once more built with
    # safe_gate=True, lower_bound=-5
    "prod8192_layer": Problem("prod8192_layer", 16, 8192, 16, 16, 128, 256, beta_sigmoid_in_kernel=True,
                              state_v_first=True),
    "prod8192_layer_safe": Problem("prod8192_layer_safe", 16, 8192, 16, 16, 128, 256, beta_sigmoid_in_kernel=True,
                                   state_v_first=True, safe_gate=True, lower_bound=-5.0),
    # prod8192_gate's 131,072 tokens as one packed batch of 21 documents of 300 to 15,000 tokens,
    # 19 of them not whole chunks (cu_seqlens): how training on packed documents calls the op
    "prod_packed": Problem("prod_packed", 1, 131072, 16, 16, 128, 256,
                           cu_seqlens=tuple(itertools.accumulate(PACKED_LENGTHS, initial=0))),
}


# Stage shapes, for a stage timed alone: B1 at T 4096, 1024 and 256 with the production
# heads (1,024, 256 and 64 chunk-heads: a stage's grid on few programs, B6's being
# (chunks, B*HV) for fla's kernel and ours) ...
FLOOR_SHAPES = {
    "grid1024": dict(B=1, T=4096, H=16, HV=16, K=128, V=256),
    "grid256": dict(B=1, T=1024, H=16, HV=16, K=128, V=256),
    "grid64": dict(B=1, T=256, H=16, HV=16, K=128, V=256),
}
# ... and K=64 (the other head size the B6 kernels take) at b8's token count, and V=64 and
# V=32, where V fits one tile of B6's pinned BV (docs/log/b6.md, tenth round).
OTHER_SHAPES = {"k64": dict(B=8, T=8192, H=16, HV=16, K=64, V=128),
                "v64": dict(B=8, T=8192, H=16, HV=16, K=128, V=64),
                "v32": dict(B=8, T=8192, H=16, HV=16, K=128, V=32),
                "k64v64": dict(B=8, T=8192, H=16, HV=16, K=64, V=64)}
# One sequence of 8192 tokens on one head: a scan's 128 dependent chunk steps on as few
# programs as its V slices, so its time over 128 is the latency of one step.
OTHER_SHAPES["step8192"] = dict(B=1, T=8192, H=1, HV=1, K=128, V=256)
# The KDA call inside fla's KimiDeltaAttention layer at the layer bench's B2 T8192 (hidden 2048,
# 16 heads of 128): 32 sequence-heads, V = 128, with the flags the layer passes; its scans run
# on 32 chains, where a V slice of 128 is one program a chain.
OTHER_SHAPES["layer2x8192"] = dict(B=2, T=8192, H=16, HV=16, K=128, V=128, beta_sigmoid_in_kernel=True,
                                   state_v_first=True)
STAGE_SHAPES = {name: Problem(name, **dims) for name, dims in {**FLOOR_SHAPES, **OTHER_SHAPES}.items()}
# prod8192_gate and grid1024 with strong gates (``strong_gate``): what B7's levels cost there
STAGE_SHAPES["prod8192_strong"] = dataclasses.replace(SHAPES["prod8192_gate"], name="prod8192_strong", strong_gate=True)
STAGE_SHAPES["grid1024_strong"] = dataclasses.replace(STAGE_SHAPES["grid1024"], name="grid1024_strong", strong_gate=True)


def dt_bias_init(dt: torch.Tensor, strong_gate: bool = False) -> torch.Tensor:
    """dt_bias as Kimi-Linear initialises it from a draw of dt (dt's inverse softplus), or
    zeros with ``strong_gate`` (``Problem.strong_gate``)."""
    return torch.zeros_like(dt) if strong_gate else dt + torch.log(-torch.expm1(-dt))


def problem(name: str) -> Problem:
    """The named problem: a bench shape (``SHAPES``) or a stage shape (``STAGE_SHAPES``)."""
    if name in SHAPES:
        return SHAPES[name]
    return STAGE_SHAPES[name]


def shrunk(p: Problem, T: int) -> Problem:
    """``p`` as one sequence of at most T tokens (the float64 oracle's size); a packed ``p``
    keeps its documents, each scaled to the new length (boundaries that meet merged)."""
    if p.cu_seqlens is None:
        return dataclasses.replace(p, B=1, T=min(p.T, T))
    total = p.cu_seqlens[-1]
    T = min(total, T)
    bounds = sorted({c * T // total for c in p.cu_seqlens})
    return dataclasses.replace(p, B=1, T=T, cu_seqlens=tuple(bounds))


def make_inputs(p: Problem, device="cpu", seed: int = 0, requires_grad: bool = True) -> dict:
    """The keyword arguments of a ``chunk_kda`` call for problem ``p`` (leaf tensors)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape, dtype=p.dtype):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)

    def rand(*shape, dtype=p.dtype):
        return torch.rand(*shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)

    B, T, H, HV, K, V = p.B, p.T, p.H, p.HV, p.K, p.V
    q, k = rand(B, T, H, K, dtype=torch.float32), rand(B, T, H, K, dtype=torch.float32)
    if not p.l2norm_in_kernel:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    q, k = q.to(p.dtype), k.to(p.dtype)
    v = rand(B, T, HV, V)
    kwargs = dict(q=q, k=k, v=v)
    if p.gate_in_kernel:
        kwargs["g"] = randn(B, T, HV, K)
        kwargs["A_log"] = torch.log(torch.empty(HV).uniform_(1, 16, generator=gen)).to(device)
        # Mamba/Kimi-style init: dt log-uniform in [1e-3, 1e-1]
        dt = torch.exp(torch.empty(HV * K).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
        kwargs["dt_bias"] = dt_bias_init(dt, p.strong_gate).to(device)
    else:
        kwargs["g"] = (F.logsigmoid(torch.randn(B, T, HV, K, generator=gen)) / 16).to(device=device, dtype=p.dtype)
    if p.beta_sigmoid_in_kernel:
        kwargs["beta"] = randn(B, T, HV)
    else:
        kwargs["beta"] = torch.sigmoid(torch.randn(B, T, HV, generator=gen)).to(device=device, dtype=p.dtype)
    N = p.sequences
    if p.initial_state:
        state = (N, HV, V, K) if p.state_v_first else (N, HV, K, V)
        kwargs["initial_state"] = randn(*state, dtype=torch.float32) * 0.1
    if requires_grad:
        for name, t in kwargs.items():
            t.requires_grad_(True)
    kwargs.update(
        use_gate_in_kernel=p.gate_in_kernel,
        use_qk_l2norm_in_kernel=p.l2norm_in_kernel,
        use_beta_sigmoid_in_kernel=p.beta_sigmoid_in_kernel,
        allow_neg_eigval=p.allow_neg_eigval,
        output_final_state=p.output_final_state,
    )
    if p.lower_bound is not None:
        kwargs["lower_bound"] = p.lower_bound
    for name in ("state_v_first", "safe_gate", "disable_recompute"):
        if getattr(p, name):
            kwargs[name] = True
    if p.cu_seqlens is not None:
        kwargs["cu_seqlens"] = torch.tensor(p.cu_seqlens, dtype=torch.int64, device=device)
    return kwargs


GRAD_NAMES = {"q": "dq", "k": "dk", "v": "dv", "g": "dg", "beta": "dbeta",
              "initial_state": "dh0", "A_log": "dA_log", "dt_bias": "ddt_bias"}


def leaves(kwargs: dict) -> dict[str, torch.Tensor]:
    """The differentiable tensor inputs of a call, by argument name."""
    return {n: t for n, t in kwargs.items() if isinstance(t, torch.Tensor) and t.requires_grad}


def cotangents(o: torch.Tensor, final_state: torch.Tensor | None, seed: int = 1, grid: torch.dtype | None = None):
    """Random do (and dht) for a backward, never zeros. ``grid`` rounds the draws to a
    dtype first, so an oracle run in float64 gets exactly the cotangents a bf16 run got."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def draw(t):
        x = torch.randn(t.shape, generator=gen)
        if grid is not None:
            x = x.to(grid)
        return x.to(device=t.device, dtype=t.dtype)

    return draw(o), (draw(final_state) if final_state is not None else None)


def run_fwd_bwd(fn, kwargs: dict, seed: int = 1, grid: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Call ``fn(**kwargs)`` and backpropagate random cotangents; returns o, final_state and
    every gradient, keyed ``o``, ``final_state``, ``dq``, ``dk``, ..."""
    return fwd_bwd_step(fn, kwargs, seed, grid)()


def fwd_bwd_step(fn, kwargs: dict, seed: int = 1, grid: torch.dtype | None = None):
    """``run_fwd_bwd`` as a step to repeat: the cotangents are drawn at the first call and
    kept (they are drawn on the CPU: at prod8192_gate a fresh draw costs seconds a step)."""
    named = leaves(kwargs)
    drawn = []

    def step() -> dict[str, torch.Tensor]:
        o, final_state = fn(**kwargs)
        if not drawn:
            drawn.extend(cotangents(o, final_state, seed, grid))
        outs, grads_in = [o], [drawn[0]]
        if final_state is not None:
            outs.append(final_state)
            grads_in.append(drawn[1])
        grads = torch.autograd.grad(outs, list(named.values()), grads_in, allow_unused=True)
        result = {"o": o.detach(), "final_state": final_state.detach() if final_state is not None else None}
        for name, grad in zip(named, grads):
            result[GRAD_NAMES[name]] = grad
        return result

    return step


def as_oracle_inputs(kwargs: dict) -> dict:
    """The same call with every floating tensor as a float64 leaf (for ``recurrent_kda``)."""
    out = {}
    for name, t in kwargs.items():
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            out[name] = t.detach().to(torch.float64).requires_grad_(t.requires_grad)
        else:
            out[name] = t
    return out
