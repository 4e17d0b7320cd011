"""B6, the WY backward of KDA (fla's ``chunk_kda_bwd_wy_dqkg_fused``), for Hopper.

What it computes, per chunk c of 64 tokens and value head (S = h[c], dS = dh[c],
dvn = the dv that B5 produces, A = Akk_inv):

- ``dq = scale (do S^T) exp2 gc``; ``dk_h = (v_new dS^T) exp2(gc_last - gc)``; ``dw = -dvn S^T``;
- ``dv2 = beta (A^T dvn)``; ``dk = dk_h + beta exp2(gc) (A^T dw)``;
- ``db = rowsum(A^T dvn * v) + rowsum(A^T dw * kg)`` with ``kg = k exp2 gc``;
- ``dA = -A^T strict_lower([dvn v^T + dw kg^T] Diag(beta)) A^T``;
- ``dg = q dq - k dk_h + beta kg (A^T dw)`` (+ ``exp2(gc_last) sum_V S dS + sum_rows k dk_h``
  on the chunk's last row).

Where fla's kernel loses time (12.4 ms at prod8192_gate on the H200, 3.3x its 3.73 ms
memory floor): its program loops over K slabs of 32 or 64 and, inside, over V tiles, so
v_new, do and dv are read once per K slab; every dot is [64, BV] @ [BV, 32|64] -- a tiny N,
three dots chained on the same operands -- so it is latency-bound; a ``debug_barrier`` runs
every inner iteration (the ``i_k == 0`` block reuses the loop's shared memory), which
defeats software pipelining; and the exp2/dg/dA epilogue runs once per slab.

Two designs, same contract and outputs as fla's function:

1. ``fullk`` -- one program per (chunk, b*hv) with no K-slab loop: h and dh load as
   [BV, K] tiles, the V-shaped tiles are read once, the three dots widen to
   [64, BV] @ [BV, K], the barrier disappears and the epilogue runs once. Accumulators
   dq, dk, dw [64, K] and dA [64, 64] in fp32 registers. One program fills an SM, so
   nothing hides its waits: A^T and beta come with every V tile rather than before the
   loop (beta's load first in the loop body, issued ahead of the tile wait), the
   epilogue issues all its loads in one batch, and two V tiles before the end
   the program asks L2 for the epilogue's k, q and g (``prefetch.global.L2``, a hint that
   changes no value and is skipped under the interpreter), g is pinned to the
   accumulators' layout where it is loaded, so the epilogue converts it once rather than
   three values derived from it, and dq is stored straight from that layout (8-byte pair
   stores, ``_store_pairs``) rather than through shared memory, and beta is pinned to db's
   row layout so the dA chain's column copy of it is one conversion rather than 16
   loads per thread. db's v-side is accumulated element by element over the V tiles and
   summed over its columns once after the loop (a row sum per tile was three of the
   loop's five CTA barriers), and dA too is stored by pair stores, which take one base
   pointer and int32 element offsets (with a 64-bit pointer per element the compiler kept
   the addresses live and spilled: 196 B at HV=32), while dq's are addressed by a pointer
   per element (faster there). The V tile is the pinned BV halved until V spans two tiles
   (``fullk_bv``): a single tile peels the V loop and spilled ~3 KB per thread, slower than
   fla's kernel. Launch order: at K=128 with at
   least ``HEADS_FAST_MIN_BHV`` (b, hv) pairs a 1D grid with b*hv fastest, so the programs
   in flight share a chunk index across sequences and heads; otherwise fla's order (2D
   grid, chunks fastest). Both orders compute bitwise the same outputs. Launched with a
   ``timeline`` buffer in its config, it also stores per program its SM and three
   ``%globaltimer`` readings (``tools.b6_timeline``); without one that code is
   not compiled (same PTX).
2. ``transposed`` -- two kernels. The main kernel accumulates the transposes
   dq^T = S do^T, dw^T = S dvn^T, dk^T = dS v_new^T, so every dot has M = K and h, dh load
   in their natural [K, BV] layout; it parks the raw dq and dk in their fp32 outputs, -dw
   (bf16) and sum_V S dS in scratch, and runs the elementwise epilogue over K strips
   re-read from L2, so the epilogue's live set is a strip, not [64, K]. A side kernel does
   the v-side -- dv2, its part of db -- and dA = chain(dvn v^T + dw kg^T), accumulated in
   that order into one accumulator as in design 1. The side kernel finishes db in place on
   the main kernel's partial: the one read-modify-write output, which is why neither
   kernel is ever autotuned.

Numerics: the V accumulation keeps fla's order (V tiles ascending, fp32 accumulators);
what moves is the reduction blocking inside each dot (fp32 reassociations of the same
terms). Every bf16 rounding fla makes is made at the same point (dw and kg before their
dots, dA before each of its two chain dots, dv2 at the store); no exp2 is factored
differently.

Not handled here (the stage goes to fla's kernel; ``supports`` says why): K not 64 or
128, V not a multiple of 32, fp32 inputs, chunk size other than 64, grids below
``MIN_CTAS``.

State layouts: h and dh come in fla's [K, V] layout or, with ``state_v_first`` (what fla's
own KimiDeltaAttention layer passes), in [V, K]; a constexpr (STATE_V_FIRST) changes only
the tiles' addressing, so the values and every sum's order are the same. The [V, K] tile
is [BV, BK] with K contiguous, which puts sum_V h*dh across threads rather than within
them: at K=128, V=256 the kernel spills 284 B against 28 (sm_90a) and takes 6.96 ms
against 4.66 in the whole op's stage times at prod8192_layer / prod8192_gate (2026-12-01,
``bench/results/chunk_kda.jsonl``). Not tuned yet: the reduction as diagonals of a
batched tensor-core product compiles to 156 B there and measured 5.04 against 4.75 ms in
the [K, V] layout (docs/b6-wy-backward.md, "The [V, K] state layout").

Measured on the H200 (2026-11-30, torch 2.11, triton 3.6; rows in
``bench/results/stages.jsonl``, the sweeps, ablations and their reading in
``docs/b6-wy-backward.md``):

- prod8192_gate (B16 T8192 H=HV=16 K128 V256): fullk 4.80 ms against fla's 12.52 in the
  same run at 0abd794, 2.61x fla, 1.29x the 3.73 ms floor (4.74-4.96 in the side by
  sides of eleven machine starts); kimi 3.88 against 10.53 (2.72x), b8 2.45 (2.56x), small 0.704
  (2.37x), k64 1.37 (1.93x), V=64 1.93 (2.38x), V=32 2.05 (2.23x). dq's pair stores by
  pointers, side by side with offsets: 5.00 -> 4.89 ms, kimi 3.81 -> 3.75 (bitwise the
  same outputs; 28 B of spills against 24). The V tile rule, same run against fla's
  4.67 / 4.56 ms (B8 T8192 H=HV=16 K128): V=64 at BV 64 / 32 / 16 9.20 / 1.88 / 2.31 ms,
  V=32 at BV 64 / 32 / 16 8.45 / 5.49 / 1.96; K=64, V=64 at BV 64 / 32 1.53 / 1.22. Not
  better (same process): the epilogue's k, q, g loaded by TMA into shared memory and
  read in the accumulators' layout 5.81 against 4.96 (g alone 5.42; each TMA load waits
  alone, 152-204 B of spills); dk and dg stored by TMA from shared memory 5.25 against
  4.85 (4 B of spills, the fewest yet), with dv2 by TMA in the loop too 5.47; A^T dvn issued first so the four accumulating dots run on
  into the next V tile, made safe by a second load of h and dh for sum_V S dS (a third
  buffer, 216 KB) 5.24 against 4.91 -- the second loads alone 5.33, and without them
  (an ablation without sum_V S dS) 4.834 run on against 4.836 not: the loop does not
  wait on its dots. Before: 4.90 ms against fla's 12.34 at 9d25a16, 2.52x fla, 1.31x the
  floor (4.87 against 12.62 at eadc09a, the
  pair stores' 64-bit pointers; BV=64, 8 warps, 3 stages, A and beta
  loaded with every V tile, beta's load first in the loop body, the epilogue's k, q and
  g prefetched into L2 two V tiles before the end, g converted once into the
  accumulators' layout, dq and dA stored from it, the epilogue's beta pinned to db's
  layout, db's v-side summed once after the loop, b*hv-fastest launch order; 188 KB
  shared, 255 registers, 24 B of spills per thread; 28 B at 0abd794). Pair stores by int32 offsets, side
  by side with eadc09a: prod8192_gate 4.85 -> 4.96 ms (+2.3%), kimi (H=HV=32, V=128)
  4.19 -> 3.78 (-9.8%; eadc09a had made kimi 6% slower than the kernel before it, 196 B
  of spills at HV=32 against 20 B now); shipped for kimi and for robustness across HV
  (offline, nine (HV, V) pairs, HV 4-64, V 128-512: 16-40 B against up to 208). db's v-side accumulated element by
  element with dA's pair stores, side by side with the kernel before it: 5.02 -> 4.77 ms,
  b8 2.58 -> 2.46, small 0.776 -> 0.712 (db moves by 1.2e-7 relative, the rest bitwise;
  spills 48 -> 36 B, the V loop 502 -> 468 SASS instructions and 5 -> 2 CTA barriers per
  tile); either alone 4.96 and 4.91. Not better on top of it (same process): the
  prefetch one V tile before the end 4.90 against 4.93 (b8 2.52 against 2.53, noise),
  three before 5.09, the loop's beta loaded at the first tile only 5.01 (b8 2.66 against
  2.53), dk or dg by pair stores 5.00 / 5.03 (68 / 72 B), dk, dg and dv2 stored
  evict-first 4.897 against 4.903. The epilogue's beta pinned, side by side with the
  kernel before it: 5.29 -> 5.12 ms, b8 2.76 -> 2.66 (bitwise the same outputs; 104 ->
  48 B of spills). Beta's load first, side by side with the
  kernel before it: 5.25 -> 5.16 ms, b8 2.67 -> 2.64, small 0.762 -> 0.746, k64 1.47 ->
  1.42 (bitwise the same outputs). Not better on top of it (same process, prod8192_gate):
  dk stored by pair stores as well 5.30 against 5.23 (112 B of spills), dA by pair
  stores 5.20-5.24 against 5.23 (within noise, sign changes by shape), dv2 stored in the
  loop as packed bf16 pairs 5.41 (152 B), db's k-side dot issued before the epilogue's
  loads 5.44 (144 B).
  dq stored from the accumulators' layout, side by side with the kernel before it:
  5.53 -> 5.38 ms, b8 2.90 -> 2.82, small 0.80 -> 0.76, k64 1.59 -> 1.60 (spills 164 ->
  104 B; dk and dg stored the same way compile to 212-296 B, so they are not). g converted once,
  side by side with the kernel before it: 6.03 -> 5.41 and 6.04 -> 5.41 ms (two machine
  starts), b8 3.21 -> 2.89, small 0.87 -> 0.79, k64 1.55 -> 1.46-1.47, 1,024 chunk-heads
  0.277 -> 0.260 (spills 288 -> 164 B; dg moves by 1.7e-8, the rest bitwise). Not better
  on top of it: beta loaded once before the V loop (5.75), dA accumulated transposed so
  beta scales rows (5.44), db's v-side from the dA accumulator after the loop (5.73),
  q and k pinned too (5.60 against 5.57), BV=128 at 2 stages (6.25) and BV=32 at 4
  (6.59, against 5.39). The launch order, side by side with fla's order in one process
  (outputs bitwise equal): 6.31 -> 6.09, 6.37 -> 6.18 and 6.17 -> 5.96 ms on three machine
  starts; kimi 5.36 -> 4.99, b8 3.24 -> 3.14; worse where it is not used: small (8 heads,
  B=4) 0.94 -> 0.99, k64 1.59-1.61 -> 1.62; no change at 1,024 and 64 chunk-heads.
  Before the launch order: 6.26-6.45 ms (1.99-2.02x fla); side by side, 6.26 ms against
  6.47 with A and beta in the loop but no prefetch and 6.83 for the kernel before both
  (A^T and beta loaded once before the loop, where their store to shared memory held the
  first V tile requests behind one DRAM round trip). Prefetching at the start of the
  program instead took 6.93 ms, at the first V tile 6.95; prefetching the next program's
  first tiles (launch order + one wave) 6.80; evict-first stores 6.16 against 6.26 in one
  run, not shipped on one measurement. Before the epilogue issued its loads in one batch
  (each load waited out its own DRAM round trip behind a layout-conversion barrier) the
  kernel took 6.74-6.82 ms; at 2 stages and int64 in-tile offsets, 7.68 ms. transposed:
  9.94 ms at its best (BV=32, KS=64; main kernel 213 registers and no spills, side kernel
  124). fullk won at every shape and grid measured (1.58-2.74x fla: kimi 3.74 ms and b8
  2.44 (eadc09a) in the b*hv-fastest order; small 0.692, k64 1.43 (eadc09a), 1,024
  chunk-heads 0.242 and 64
  chunk-heads 0.087 in fla's order, which they keep; at the two small grids fla ran the
  config tuned at prod8192_gate, and autotuned there on another machine start it took
  0.565 and 0.206 against our 0.301 and 0.123), so it is the default and there is no
  CTA floor.
- K=64 (k64: B8 T8192 H=HV=16 K64 V128): 1.37 ms against fla's 2.64 (1.93x, 1.60x the
  0.85 ms floor) at 0abd794, at the K=128 config (217 registers, no spills); 1.43
  against 2.71 at eadc09a (222 registers); 1.52 against 2.78 with
  the epilogue's beta pinned, 1.40 against 2.60 before it on another machine start (not
  timed side by side); before g was converted
  once 1.60 ms against 2.72 (1.55 -> 1.46 side by side); 1.75 ms without the
  prefetch; 4-warp programs (two per SM) 1.67-1.76 ms, 8 warps capped at 128 registers
  2.35 ms.
- where a program's time goes (per-program %globaltimer stamps, prod8192_gate, one
  launch, at the current kernel): V loop 9.95 us and epilogue 10.46 us (medians) of a
  20.5 us program, an upper bound (the stamped kernel took 5.45 ms against 4.87); before
  g was converted once: V loop 11.8 us and epilogue 11.8 us (medians) of a
  ~24 us program, one program per SM (after: 11.1 and 11.7 of ~23 us, an upper bound,
  as the stamped kernel compiles to a slower epilogue, 6.12 against 5.55 ms); at any moment about half the SMs are in each phase (56-68 streaming), a V loop
  takes 11.6 us in the quarter of programs with the fewest other SMs streaming and 11.9
  in the busiest quarter, and DRAM moves 15.85 GB in 6.2 ms (~2.6 TB/s, ~60% of the copy
  rate). So the V loop is not limited by DRAM bytes, nor by too few requests in flight:
  more made it slower -- the later V tiles prefetched into L2 at the start
  7.02-7.35 ms against 6.27 (b8 3.61-3.71 against 3.15), BV=32 with 4-5 stages 7.35-8.00;
  so did staggering the first wave (6.31 against 6.17) and the two ways tried of taking all the
  epilogue's layout conversions out, each of which raised spills to 456-760 B:
  loads and stores through inline PTX in the accumulator layout 7.43-10.35 ms, the
  epilogue inside a one-iteration loop so its loads are staged in shared memory and read
  in the accumulator layout 7.95-8.48 ms. Evict-first stores: 6.12 against 6.17 (second
  run under the 2% bar). What does limit the loop (L2 or fabric contention, DRAM
  efficiency of the access pattern -- the launch order moves it -- or stalls inside the
  program) is not settled: Nsight Compute's stall samples (one launch, 6.99 ms at the
  profiler's locked clocks) put 40% in the V loop and 55% in the epilogue, 25.6% of issue
  slots busy with 2 warps per scheduler, DRAM at 54% of peak; the loop's largest waits
  were its per-tile beta load (8.4% of samples) and its tile wait (6.1%), and hoisting
  the beta load made the kernel slower. In the current kernel's profile (5.58 ms at the
  profiler's clocks, 31% of issue slots busy, DRAM 60%) 45% of samples are in the V
  loop (its dots 16%, the h and dh tiles' first use 7%, dv2's store 5%) and 49% in the
  epilogue (spread: stores 9%, sums 4%, the dA chain's beta 3%, g's load 3%); sum_V h*dh
  as thread-local partial sums (no shuffles in the loop) took 4.98 against 4.86 ms, dv2
  as packed bf16 pairs 5.11, and the pair stores without their checks 4.89; 16 warps
  (128 registers, 140 B of spills) 6.59 against 4.83.
- the 4.5 ms target is not met yet (4.80 ms, ~6% short): one 8-warp program per SM (255
  registers), whose V loop and once-per-chunk-head epilogue each take ~10 us and
  never overlap within the SM; 4.5 ms needs ~18 us per program against ~19.5 now.
  Moving the stage's bytes alone in this kernel's tiles, residency, epilogue shape and
  prefetch, with no dots (``tools.b6_stream``, 2026-12-01), takes 4.27 ms
  against this kernel's 4.89 in the same process (b8 2.12 / 2.44); this kernel's V loop
  with a light epilogue 4.70 against 4.92: ~0.4 ms of the 0.6 over the bytes is the V
  loop's arithmetic (about its five dots' tensor-core time, ~0.5 us a tile, though letting
  the dots run on into the next tile bought nothing), ~0.2 the epilogue's. Asking L2 for
  tile i+2 before tile i's dots: 4.95-5.03 against 4.92 (bitwise the same outputs).
  Of the loop's part, sum_V h*dh is 0.07-0.10 ms (skipped with the buffers unchanged:
  4.73 against 4.80; with the light epilogue as well 4.48); on the tensor cores, as the
  diagonals of [16, 16] blocks of h dh^T (mma.sync, 322-343 loop instructions against
  468, 132-140 B of epilogue spills), 5.05-5.10 against 4.79 (kimi 4.03-4.05 / 3.72).
  What would hide the rest is the next chunk-head's loads during the epilogue, by
  producer warps with few registers (warp specialization with register reallocation),
  which the Triton language here cannot ask for and Gluon, which can, does not run in
  the interpreter (docs/b6-wy-backward.md, fourteenth round and "What it would take").
  Tried and measured without a gain: K split across
  a pair of 4-warp programs (7.72 ms), an L1 carveout for the spills, accumulators as two
  K halves (spills 296 -> 120 B, same time), TMA-descriptor loads (7.28 against 6.93 ms),
  and a persistent grid with TMA loads (9.38 ms); its flattened form, which would overlap
  the epilogue with the next chunk-head's loads, failed parity on the H200 (everything that
  uses the A^T and beta carried from the chunk-head's prologue) while passing in the
  interpreter; with A and beta loaded inside the V loop it held parity and took 10.27 ms.
  A persistent grid calling the chunk-head function (inlined, its loop spills 364-520 B),
  side by side with the shipped launch at 6f13156: 5.05 ms against 4.75 (kimi 3.97 /
  3.74, b8 2.57 / 2.42, small 0.840 / 0.759), and 5.75 with the next chunk-head's first
  tiles prefetched into L2 during each epilogue; removed. BV=32 at 4-6 stages (same
  bytes in flight as BV=64 at 3, 76 B of spills, 147-229 KB): 5.95-6.04 against 4.77
  (kimi 4.25-4.52 / 3.71, b8 3.02-3.06 / 2.43), flat in the depth: the per-tile costs
  double with the tile count. Triton 3.6's automatic warp specialization (4 warps, operands by
  tensor descriptor; ``tools.ws_probe``) on this V loop: never compiles with
  the epilogue's (-dw) kg^T dot, compiles the rest in 1-4 of 16 attempts with 1.4-1.9 KB
  of spills, and that rest took 8.57-9.61 ms against 4.99 for the same source
  unspecialized and 4.89 for this kernel (bitwise the same dq, dk, dv2, dA).
- the transposed main kernel at three pipeline stages failed parity at >= 1,024
  chunk-heads (a grid-dependent error, which points at a race between the parked
  accumulators and the pipelined strip loads; not chased further); its pinned config uses
  two stages, which held parity everywhere.
- whole op at prod8192_gate with this stage ours and every other on fla: fwd+bwd 39.61 ms
  against fla's 47.02 ms (1.187x) at 0abd794; 39.71 against 47.06 (1.185x) at eadc09a;
  40.11 against 47.21 (1.177x) before the epilogue's beta was pinned.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernel_fun.kda.stages import add_impl


# --------------------------------------------------------------------------------------
# Shared pieces
# --------------------------------------------------------------------------------------
# Two faults of Triton 3.6's interpreter with bf16, which it stores as uint16: tl.dot
# multiplies that storage (a [16,16] bf16 dot comes out ~1e10 off; fp16 and fp32 are
# right), and fp32 -> bf16 casts truncate instead of rounding to nearest even. Under the
# interpreter the dots take fp32 copies of their operands (exact for bf16 values) and the
# casts round to nearest even by hand; compiled for the GPU both helpers are the plain op.
_INTERPRETING = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def _dot(a, b):
    if _INTERPRETING:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def _to(x, dtype: tl.constexpr):
    if _INTERPRETING:
        if dtype == tl.bfloat16:
            bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _prefetch_rows(base, rows, row_stride, m_rows, ROW_ELEMS: tl.constexpr):
    """Asks L2 for the 128-byte lines of rows ``base + rows * row_stride`` (elements), each
    ROW_ELEMS elements long. A hint: it returns nothing, faults on nothing (masked lanes are
    predicated off) and is skipped under the interpreter, where it would mean nothing. Its
    addresses still matter: prefetches outside the tensors measured 5x slower on the H200
    (docs/b6-wy-backward.md, fourth round), which no value shows."""
    if not _INTERPRETING:
        ROW_BYTES: tl.constexpr = ROW_ELEMS * base.dtype.element_ty.primitive_bitwidth // 8
        NL: tl.constexpr = (ROW_BYTES + 127) // 128
        o_l = tl.arange(0, NL)
        ptrs = (base + rows[:, None] * row_stride).to(tl.pointer_type(tl.int8)) + o_l[None, :] * 128
        on = tl.broadcast_to(m_rows[:, None], (rows.shape[0], NL)).to(tl.int32)  # a row's lines share its mask
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
            "=r,l,r", [ptrs, on], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _chunk_coords(i_t, i_bh, cu_seqlens, chunk_indices, T, HV: tl.constexpr, BT: tl.constexpr,
                  IS_VARLEN: tl.constexpr):
    """(chunk index within its sequence, global chunk index, first token row, sequence length)."""
    i_b = i_bh // HV
    if IS_VARLEN:
        i_tg = i_t.to(tl.int64)
        i_n = tl.load(chunk_indices + i_t * 2).to(tl.int64)
        i_c = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int64)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        T_seq = (eos - bos).to(tl.int32)
    else:
        NT = tl.cdiv(T, BT)
        i_c = i_t.to(tl.int64)
        i_tg = i_b.to(tl.int64) * NT + i_t
        bos = i_b.to(tl.int64) * T
        T_seq = T
    return i_c, i_tg, bos, T_seq


@triton.jit
def _clock(dep):
    """%globaltimer (ns), read once the [N] vector ``dep`` is ready (0 under the interpreter,
    where there is no clock to read). Only the timeline instrument (TIMELINE) uses it."""
    if _INTERPRETING:
        return tl.max(dep.to(tl.float32) * 0, axis=0).to(tl.int64)
    else:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer; // $1", "=l,r", [dep.to(tl.float32)],
                                      dtype=tl.int64, is_pure=False, pack=1)
        return tl.max(t, axis=0)


@triton.jit
def _smid(dep):
    """The SM this program runs on (0 under the interpreter)."""
    if _INTERPRETING:
        return tl.max(dep.to(tl.float32) * 0, axis=0).to(tl.int64)
    else:
        s = tl.inline_asm_elementwise("mov.u32 $0, %smid; // $1", "=r,r", [dep.to(tl.float32)],
                                      dtype=tl.int32, is_pure=False, pack=1)
        return tl.max(s, axis=0).to(tl.int64)


@triton.jit
def _opaque_zeros_like(x):
    """fp32 zeros in x's layout that the compiler cannot fold: adding them to a loaded tile
    pins that tile to x's layout at one point (a layout conversion of the load), where it
    would otherwise convert each value derived from the tile separately. Exact: v + 0.0 is
    v for every v but -0.0, which becomes +0.0; here it feeds exp2 (g) or products that
    are summed with other terms or masked (beta), so no output value changes. Plain zeros
    under the interpreter, which has no inline assembly."""
    if _INTERPRETING:
        return tl.zeros_like(x)
    else:
        return tl.inline_asm_elementwise("mov.b32 $0, 0;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)


def _pair_store_asm(addresses: str, x0: str, x1: str, m0: str, m1: str) -> str:
    """PTX of one pair of ``_store_pairs``: ``addresses`` sets a0, a1 (the two addresses) and
    adj (whether they are adjacent); the rest is shared by both ways of addressing."""
    return ("{ .reg .pred m0, m1, adj, al, v, f0, f1; .reg .b64 a0, a1, d, lo; .reg .b32 e;"
            f" setp.ne.b32 m0, {m0}, 0; setp.ne.b32 m1, {m1}, 0; {addresses}"
            " and.b64 lo, a0, 7; setp.eq.s64 al, lo, 0;"
            " and.pred v, adj, al; and.pred v, v, m0; and.pred v, v, m1;"
            f" @v st.global.v2.f32 [a0], {{{x0}, {x1}}};"
            " not.pred v, v; and.pred f0, v, m0; and.pred f1, v, m1;"
            f" @f0 st.global.f32 [a0], {x0}; @f1 st.global.f32 [a1], {x1};"
            " mov.b32 $0, 0; mov.b32 $1, 0; }")


# operands: $2, $3 two pointers, $4, $5 values, $6, $7 masks
_PAIRS_BY_POINTERS = tl.constexpr(_pair_store_asm(
    "mov.b64 a0, $2; mov.b64 a1, $3; sub.s64 d, a1, a0; setp.eq.s64 adj, d, 4;", "$4", "$5", "$6", "$7"))
# operands: $2, $3 the base pointer, $4, $5 int32 element offsets, $6, $7 values, $8, $9 masks
_PAIRS_BY_OFFSETS = tl.constexpr(_pair_store_asm(
    "sub.s32 e, $5, $4; setp.eq.s32 adj, e, 1; mad.wide.s32 a0, $4, 4, $2; mad.wide.s32 a1, $5, 4, $3;",
    "$6", "$7", "$8", "$9"))


@triton.jit
def _store_pairs(base, off, x, mask):
    """tl.store(base + off, x, mask) for fp32, written by each thread as 8-byte stores of
    consecutive element pairs in x's own layout, so a tile in the accumulators' layout is
    stored without first moving through shared memory into a blocked layout. In that
    layout a thread's elements come in pairs of adjacent columns; each pair is checked at
    run time (second address = first + 4 bytes, first 8-byte aligned, both unmasked) and
    stored element by element otherwise, so any layout stores the same values.

    Two ways to address, which compile differently and neither is best everywhere:
    ``off`` int32 element offsets from the one pointer ``base`` (the addresses are formed
    inside the store), or ``off=None`` with ``base`` a pointer per element. Given a 64-bit
    pointer per element the compiler may keep up to 32 of them live for a [64, 64] tile:
    dA's store that way spilled 196 B at HV=32 (20 B by offsets). dq's [64, K] store is
    faster by pointers (prod8192_gate 5.00 -> 4.89 ms, kimi 3.81 -> 3.75, side by side;
    28 B of spills against 24 at prod8192_gate)."""
    tl.static_assert(x.dtype == tl.float32, "_store_pairs stores fp32 values")
    tl.static_assert(base.dtype.element_ty == tl.float32, "_store_pairs stores to fp32 pointers")
    if off is not None:
        tl.static_assert(off.dtype == tl.int32, "_store_pairs takes int32 element offsets")
    if _INTERPRETING:
        if off is None:
            tl.store(base, x, mask=mask)
        else:
            tl.store(base + off, x, mask=mask)
    elif off is None:
        tl.inline_asm_elementwise(_PAIRS_BY_POINTERS, "=r,=r,l,l,r,r,r,r",
                                  [base.to(tl.int64, bitcast=True), x, mask.to(tl.int32)],
                                  dtype=tl.int32, is_pure=False, pack=2)
    else:
        tl.inline_asm_elementwise(_PAIRS_BY_OFFSETS, "=r,=r,l,l,r,r,r,r,r,r",
                                  [tl.broadcast_to(base.to(tl.int64, bitcast=True), x.shape), off, x,
                                   mask.to(tl.int32)],
                                  dtype=tl.int32, is_pure=False, pack=2)


@triton.jit
def _k_side_terms(b_At, b_dwb, b_kg, b_gexp, b_beta, b_dgk, m_last, b_dg, b_dk, b_db):
    """The terms through kg = k exp2(g) and -dw (bf16), shared by both designs' epilogues:
    dkgb = A^T (-dw), then db += rowsum(dkgb kg), dg += kg dkgb beta (+ dgk on the chunk's
    last row), dk += dkgb exp2(g) beta."""
    b_dkgb = _dot(b_At, b_dwb)
    b_db += tl.sum(b_dkgb * b_kg, axis=1)
    b_dg += b_kg * b_dkgb * b_beta[:, None] + tl.where(m_last[:, None], b_dgk[None, :], 0)
    b_dk += b_dkgb * b_gexp * b_beta[:, None]
    return b_dg, b_dk, b_db


@triton.jit
def _da_chain(b_dA, b_At, b_beta, m_strict):
    """dA = -A^T strict_lower(X Diag(beta)) A^T, rounding to A's dtype before each dot as fla does."""
    b_dA = tl.where(m_strict, b_dA * b_beta[None, :], 0)
    b_dA = _dot(_to(b_dA, b_At.dtype), b_At)
    b_dA = _dot(b_At, _to(b_dA, b_At.dtype))
    return tl.where(m_strict, -b_dA, 0)


# --------------------------------------------------------------------------------------
# Design 1: full K, one kernel
# --------------------------------------------------------------------------------------
@triton.heuristics({"IS_VARLEN": lambda args: args["cu_seqlens"] is not None,
                    "TIMELINE": lambda args: args["stamps"] is not None})
@triton.jit(do_not_specialize=["T", "NBH"])
def wy_dqkg_fullk_kernel(
    q, k, v, v_new, g, beta, A, h, do, dh, dv,
    dq, dk, dv2, dg, db, dA,
    cu_seqlens, chunk_indices, scale, T, NBH, stamps,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr,
    PF_ITER: tl.constexpr, HEADS_FAST: tl.constexpr, TIMELINE: tl.constexpr,
    STATE_V_FIRST: tl.constexpr = False,
):
    if TIMELINE:  # the timeline instrument (tools.b6_timeline): program start
        t_start = _clock(tl.arange(0, BT))
    if HEADS_FAST:
        # 1D grid, b*hv (NBH of them) fastest: the programs in flight work on one chunk
        # index of every sequence and head rather than on consecutive chunks of one head
        pid = tl.program_id(0).to(tl.int64)
        i_t, i_bh = pid // NBH, pid % NBH
    else:
        i_t, i_bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_hv = i_bh % HV
    i_h = i_hv // (HV // H)
    i_c, i_tg, bos, T = _chunk_coords(i_t, i_bh, cu_seqlens, chunk_indices, T, HV, BT, IS_VARLEN)

    # Every pointer starts at this chunk's first row, so the offsets inside the tile are
    # int32 (an int64 offset tensor costs twice the registers).
    row0 = bos + i_c * BT
    n_t = (T - i_c * BT).to(tl.int32)
    o_t = tl.arange(0, BT)
    m_t = o_t < n_t
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    i_last = tl.minimum(n_t, BT) - 1
    m_last = o_t == i_last

    q += (row0 * H + i_h) * K
    k += (row0 * H + i_h) * K
    v += (row0 * HV + i_hv) * V
    v_new += (row0 * HV + i_hv) * V
    g += (row0 * HV + i_hv) * K
    beta += row0 * HV + i_hv
    A += (row0 * HV + i_hv) * BT
    h += (i_tg * HV + i_hv) * K * V
    dh += (i_tg * HV + i_hv) * K * V
    do += (row0 * HV + i_hv) * V
    dv += (row0 * HV + i_hv) * V
    dq += (row0 * HV + i_hv) * K
    dk += (row0 * HV + i_hv) * K
    dv2 += (row0 * HV + i_hv) * V
    dg += (row0 * HV + i_hv) * K
    db += row0 * HV + i_hv
    dA += (row0 * HV + i_hv) * BT

    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)
    b_dA = tl.zeros([BT, BT], dtype=tl.float32)
    b_db = tl.zeros([BT], dtype=tl.float32)
    b_dgk = tl.zeros([BK], dtype=tl.float32)
    # db's v-side, sum_V (A dv)*v, accumulated element by element over the V tiles (in
    # ascending order) and summed over its columns once after the loop: a row sum per tile
    # is a cross-thread reduction through shared memory, three of the loop's five CTA
    # barriers per tile (502 -> 468 SASS instructions in the loop). Same terms, fp32
    # reassociated: db moves by ~1e-7 relative, every other output is bit for bit the same.
    b_dbv = tl.zeros([BT, BV], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        # beta comes with every V tile (an L2 hit after the first): loaded once before the
        # loop, it would hold the first tile requests behind a DRAM round trip (5.75 against
        # 5.41 ms). Written first in the body, its load is issued ahead of the tile wait and
        # the CTA barrier rather than among the dots (5.20 against 5.23 ms at prod8192_gate,
        # b8 2.70 against 2.73, small 0.745 against 0.759; the same outputs bit for bit).
        b_beta = tl.load(beta + o_t * HV, mask=m_t, other=0).to(tl.float32)
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        p_tv = o_t[:, None] * (HV * V) + o_v[None, :]
        b_do = tl.load(do + p_tv, mask=m_tv, other=0)
        b_vn = tl.load(v_new + p_tv, mask=m_tv, other=0)
        b_dvn = tl.load(dv + p_tv, mask=m_tv, other=0)
        b_v = tl.load(v + p_tv, mask=m_tv, other=0)
        # [BV, BK] tiles of the state and its gradient: a transposed view of fla's [K, V]
        # layout, or the [V, K] layout itself (state_v_first)
        if STATE_V_FIRST:
            p_vk = o_v[:, None] * K + o_k[None, :]
        else:
            p_vk = o_v[:, None] + o_k[None, :] * V
        m_vk = m_v[:, None] & m_k[None, :]
        b_hT = tl.load(h + p_vk, mask=m_vk, other=0)
        b_dhT = tl.load(dh + p_vk, mask=m_vk, other=0)
        # A^T too comes with every V tile, through the tile pipeline
        b_At = tl.trans(tl.load(A + o_t[:, None] * (HV * BT) + o_t[None, :], mask=m_t[:, None], other=0))
        if PF_ITER >= 0:
            if i_v == PF_ITER:  # the epilogue's k, q, g into L2 while the last tiles stream
                _prefetch_rows(k, o_t, H * K, m_t, K)
                _prefetch_rows(q, o_t, H * K, m_t, K)
                _prefetch_rows(g, o_t, HV * K, m_t, K)

        b_dgk += tl.sum(b_hT.to(tl.float32) * b_dhT.to(tl.float32), axis=0)
        b_dq += _dot(b_do, b_hT)
        b_dk += _dot(b_vn, b_dhT)
        b_dw += _dot(b_dvn, b_hT)
        b_dA += _dot(b_dvn, tl.trans(b_v))
        b_dvb = _dot(b_At, b_dvn)
        tl.store(dv2 + p_tv, _to(b_dvb * b_beta[:, None], dv2.dtype.element_ty), mask=m_tv)
        b_dbv += b_dvb * b_v.to(tl.float32)

    b_db += tl.sum(b_dbv, axis=1)
    if TIMELINE:  # the V loop's last result is in
        t_loop = _clock(b_db)
    # Every epilogue load (A^T and beta again, g's last row, k, q, g) is issued here, in one
    # batch, g last. Each use of a loaded tile starts with a layout conversion, which is a
    # CTA barrier that the compiler places right after the load, so a load written next to
    # its use waits out its own DRAM round trip: three in a row per chunk-head (g, then q,
    # then k) before this ordering.
    p_tk = o_t[:, None] * (HV * K) + o_k[None, :]
    p_qk = o_t[:, None] * (H * K) + o_k[None, :]
    # beta pinned to db's row layout, two loads per thread; its column copy for the dA
    # chain then comes through one shared-memory conversion. Left to itself the compiler
    # loads that copy straight in the chain's layout, 16 two-byte loads per thread whose
    # addresses and values it spills (104 -> 48 B of spills, 125 -> 109 global loads;
    # 5.29 -> 5.12 ms side by side at prod8192_gate, b8 2.76 -> 2.66).
    b_beta = tl.load(beta + o_t * HV, mask=m_t, other=0).to(tl.float32) + _opaque_zeros_like(b_db)
    b_At = tl.load(A + o_t[None, :] * (HV * BT) + o_t[:, None], mask=m_t[None, :], other=0)
    b_gn = tl.load(g + i_last * (HV * K) + o_k, mask=m_k, other=0).to(tl.float32)
    b_k = tl.load(k + p_qk, mask=m_tk, other=0)
    b_q = tl.load(q + p_qk, mask=m_tk, other=0)
    b_g = tl.load(g + p_tk, mask=m_tk, other=0).to(tl.float32)
    # g in the accumulators' layout, converted once: left to itself the compiler computes
    # exp2(g), exp2(gn - g) and k exp2(g) in the load's layout and converts each of them
    # (exp2(g) twice), which took three fp32 [64, K] round trips through shared memory and
    # 124 B more spills per thread (5.41 against 6.03 ms at prod8192_gate).
    b_g = b_g + _opaque_zeros_like(b_dq)
    b_gexp = tl.exp2(b_g)

    b_dq = b_dq * b_gexp * scale
    b_dg = b_q.to(tl.float32) * b_dq
    # stored from the accumulators' layout: 104 B of spills per thread instead of 164 (5.38
    # against 5.53 ms at prod8192_gate); by a pointer per element, not offsets (5.00 ->
    # 4.89 ms at prod8192_gate, 3.81 -> 3.75 at kimi, side by side)
    _store_pairs(dq + p_tk, None, b_dq, m_tk)

    b_dk = b_dk * tl.where(m_t[:, None], tl.exp2(b_gn[None, :] - b_g), 0)
    b_kdk = b_k.to(tl.float32) * b_dk
    b_dg -= b_kdk
    b_dgk = b_dgk * tl.exp2(b_gn) + tl.sum(b_kdk, axis=0)

    b_dwb = _to(-b_dw, b_k.dtype)
    b_kg = b_k * b_gexp
    b_dA += _dot(b_dwb, tl.trans(_to(b_kg, b_k.dtype)))
    b_dg, b_dk, b_db = _k_side_terms(b_At, b_dwb, b_kg, b_gexp, b_beta, b_dgk, m_last, b_dg, b_dk, b_db)
    tl.store(dk + p_tk, b_dk, mask=m_tk)
    tl.store(dg + p_tk, b_dg, mask=m_tk)

    m_strict = (o_t[:, None] > o_t[None, :]) & m_t[:, None] & m_t[None, :]
    b_dA = _da_chain(b_dA, b_At, b_beta, m_strict)
    # from the accumulators' layout too (one fp32 [64, 64] conversion fewer): with db's
    # v-side summed after the loop, 72 -> 36 B of spills and 4.96 -> 4.77 ms side by side;
    # alone, on the kernel before, 5.12 -> 5.02 and within noise before that
    _store_pairs(dA, o_t[:, None] * (HV * BT) + o_t[None, :], b_dA, tl.broadcast_to(m_t[:, None], (BT, BT)))
    tl.store(db + o_t * HV, b_db, mask=m_t)
    if TIMELINE:  # every store issued; one row per program, in launch order
        row = stamps + (tl.program_id(0) + tl.program_id(1) * tl.num_programs(0)).to(tl.int64) * 4
        tl.store(row + 0, _smid(b_db))
        tl.store(row + 1, t_start)
        tl.store(row + 2, t_loop)
        tl.store(row + 3, _clock(b_db))


# --------------------------------------------------------------------------------------
# Design 2: transposed main kernel + v-side kernel
# --------------------------------------------------------------------------------------
@triton.heuristics({"IS_VARLEN": lambda args: args["cu_seqlens"] is not None})
@triton.jit(do_not_specialize=["T"])
def wy_dqkg_transposed_main_kernel(
    q, k, g, beta, A, h, do, dh, dv, v_new,
    dq, dk, dg, db, dw_park, kg_park, dgk_buf,
    cu_seqlens, chunk_indices, scale, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, KS: tl.constexpr, IS_VARLEN: tl.constexpr,
    STATE_V_FIRST: tl.constexpr = False,
):
    i_t, i_bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_hv = i_bh % HV
    i_h = i_hv // (HV // H)
    i_c, i_tg, bos, T = _chunk_coords(i_t, i_bh, cu_seqlens, chunk_indices, T, HV, BT, IS_VARLEN)

    o_t = i_c * BT + tl.arange(0, BT)
    m_t = o_t < T
    o_i = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    i_last = tl.minimum(T, i_c * BT + BT) - 1
    m_last = o_t == i_last

    q += (bos * H + i_h) * K
    k += (bos * H + i_h) * K
    g += (bos * HV + i_hv) * K
    beta += bos * HV + i_hv
    A += (bos * HV + i_hv) * BT
    h += (i_tg * HV + i_hv) * K * V
    dh += (i_tg * HV + i_hv) * K * V
    do += (bos * HV + i_hv) * V
    dv += (bos * HV + i_hv) * V
    v_new += (bos * HV + i_hv) * V
    dq += (bos * HV + i_hv) * K
    dk += (bos * HV + i_hv) * K
    dg += (bos * HV + i_hv) * K
    db += bos * HV + i_hv
    dw_park += (bos * HV + i_hv) * K
    kg_park += (bos * HV + i_hv) * K
    dgk_buf += (i_tg * HV + i_hv) * K

    # Main phase: M = K dots on [K, BV] tiles of h and dh (fla's layout, or a transposed
    # view of the [V, K] one with state_v_first).
    b_dqT = tl.zeros([BK, BT], dtype=tl.float32)
    b_dwT = tl.zeros([BK, BT], dtype=tl.float32)
    b_dkT = tl.zeros([BK, BT], dtype=tl.float32)
    b_dgk = tl.zeros([BK], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        if STATE_V_FIRST:
            p_kv = o_k[:, None] + o_v[None, :] * K
        else:
            p_kv = o_k[:, None] * V + o_v[None, :]
        m_kv = m_k[:, None] & m_v[None, :]
        b_h = tl.load(h + p_kv, mask=m_kv, other=0)
        b_dh = tl.load(dh + p_kv, mask=m_kv, other=0)
        # [BV, BT] views of the token-major do, dv, v_new
        p_vt = o_v[:, None] + o_t[None, :] * (HV * V)
        m_vt = m_v[:, None] & m_t[None, :]
        b_doT = tl.load(do + p_vt, mask=m_vt, other=0)
        b_dvT = tl.load(dv + p_vt, mask=m_vt, other=0)
        b_vnT = tl.load(v_new + p_vt, mask=m_vt, other=0)
        b_dgk += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), axis=1)
        b_dqT += _dot(b_h, b_doT)
        b_dwT += _dot(b_h, b_dvT)
        b_dkT += _dot(b_dh, b_vnT)

    # Park: raw dq and dk in their outputs, -dw in bf16 (what every consumer of dw reads),
    # sum_V S dS in scratch; stored through transposed pointers, never a register transpose.
    p_kt = o_k[:, None] + o_t[None, :] * (HV * K)
    m_kt = m_k[:, None] & m_t[None, :]
    tl.store(dq + p_kt, b_dqT, mask=m_kt)
    tl.store(dk + p_kt, b_dkT, mask=m_kt)
    tl.store(dw_park + p_kt, _to(-b_dwT, dw_park.dtype.element_ty), mask=m_kt)
    tl.store(dgk_buf + o_k, b_dgk, mask=m_k)
    tl.debug_barrier()  # the strips below re-read what other threads of this program parked

    b_beta = tl.load(beta + o_t * HV, mask=m_t, other=0).to(tl.float32)
    b_At = tl.load(A + o_t[None, :] * (HV * BT) + o_i[:, None], mask=m_t[None, :], other=0)
    b_db = tl.zeros([BT], dtype=tl.float32)
    for i_s in range(tl.cdiv(K, KS)):
        o_s = i_s * KS + tl.arange(0, KS)
        m_s = o_s < K
        m_ts = m_t[:, None] & m_s[None, :]
        p_ts = o_t[:, None] * (HV * K) + o_s[None, :]
        p_qk = o_t[:, None] * (H * K) + o_s[None, :]
        b_g = tl.load(g + p_ts, mask=m_ts, other=0).to(tl.float32)
        b_gn = tl.load(g + i_last * (HV * K) + o_s, mask=m_s, other=0).to(tl.float32)
        b_gexp = tl.exp2(b_g)

        b_dq = tl.load(dq + p_ts, mask=m_ts, other=0) * b_gexp * scale
        b_dg = tl.load(q + p_qk, mask=m_ts, other=0).to(tl.float32) * b_dq
        tl.store(dq + p_ts, b_dq, mask=m_ts)

        b_dk = tl.load(dk + p_ts, mask=m_ts, other=0) * tl.where(m_t[:, None], tl.exp2(b_gn[None, :] - b_g), 0)
        b_k = tl.load(k + p_qk, mask=m_ts, other=0)
        b_kdk = b_k.to(tl.float32) * b_dk
        b_dg -= b_kdk
        b_dgk_s = tl.load(dgk_buf + o_s, mask=m_s, other=0) * tl.exp2(b_gn) + tl.sum(b_kdk, axis=0)

        b_dwb = tl.load(dw_park + p_ts, mask=m_ts, other=0)
        b_kg = b_k * b_gexp
        tl.store(kg_park + p_ts, _to(b_kg, kg_park.dtype.element_ty), mask=m_ts)
        b_dg, b_dk, b_db = _k_side_terms(b_At, b_dwb, b_kg, b_gexp, b_beta, b_dgk_s, m_last, b_dg, b_dk, b_db)
        tl.store(dk + p_ts, b_dk, mask=m_ts)
        tl.store(dg + p_ts, b_dg, mask=m_ts)
    tl.store(db + o_t * HV, b_db, mask=m_t)


@triton.heuristics({"IS_VARLEN": lambda args: args["cu_seqlens"] is not None})
@triton.jit(do_not_specialize=["T"])
def wy_dqkg_transposed_side_kernel(
    v, beta, A, dv, dw_park, kg_park,
    dv2, db, dA,
    cu_seqlens, chunk_indices, T,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    i_t, i_bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_hv = i_bh % HV
    i_c, i_tg, bos, T = _chunk_coords(i_t, i_bh, cu_seqlens, chunk_indices, T, HV, BT, IS_VARLEN)

    o_t = i_c * BT + tl.arange(0, BT)
    m_t = o_t < T
    o_i = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_k = o_k < K

    v += (bos * HV + i_hv) * V
    dv += (bos * HV + i_hv) * V
    dv2 += (bos * HV + i_hv) * V
    beta += bos * HV + i_hv
    A += (bos * HV + i_hv) * BT
    dw_park += (bos * HV + i_hv) * K
    kg_park += (bos * HV + i_hv) * K
    db += bos * HV + i_hv
    dA += (bos * HV + i_hv) * BT

    b_beta = tl.load(beta + o_t * HV, mask=m_t, other=0).to(tl.float32)
    b_At = tl.load(A + o_t[None, :] * (HV * BT) + o_i[:, None], mask=m_t[None, :], other=0)
    b_dA = tl.zeros([BT, BT], dtype=tl.float32)
    b_db = tl.zeros([BT], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v[None, :] < V)
        p_tv = o_t[:, None] * (HV * V) + o_v[None, :]
        b_dvn = tl.load(dv + p_tv, mask=m_tv, other=0)
        b_v = tl.load(v + p_tv, mask=m_tv, other=0)
        b_dA += _dot(b_dvn, tl.trans(b_v))
        b_dvb = _dot(b_At, b_dvn)
        tl.store(dv2 + p_tv, _to(b_dvb * b_beta[:, None], dv2.dtype.element_ty), mask=m_tv)
        b_db += tl.sum(b_dvb * b_v.to(tl.float32), axis=1)
    p_tk = o_t[:, None] * (HV * K) + o_k[None, :]
    m_tk = m_t[:, None] & m_k[None, :]
    b_dwb = tl.load(dw_park + p_tk, mask=m_tk, other=0)
    b_kg = tl.load(kg_park + p_tk, mask=m_tk, other=0)
    b_dA += _dot(b_dwb, tl.trans(b_kg))

    m_strict = (o_t[:, None] > o_t[None, :]) & m_t[:, None] & m_t[None, :]
    b_dA = _da_chain(b_dA, b_At, b_beta, m_strict)
    tl.store(dA + o_t[:, None] * (HV * BT) + o_i[None, :], b_dA, mask=m_t[:, None])
    # The one read-modify-write: the main kernel's sum_K part of db, plus the sum_V part.
    p_db = db + o_t * HV
    tl.store(p_db, tl.load(p_db, mask=m_t, other=0) + b_db, mask=m_t)


# --------------------------------------------------------------------------------------
# Configs (pinned; never autotuned -- see the module docstring) and the launcher
# --------------------------------------------------------------------------------------
# (design, K) -> launch config, pinned from the H200 sweeps of 2026-11-30 (rows in
# bench/results/stages.jsonl, summary in docs/b6-wy-backward.md). At K=128, V=256:
# fullk BV=64/8 warps/3 stages (172 KB of shared memory) 6.74 ms at prod8192_gate against
# 7.37 ms at 2 stages in the same run (7.93 ms at BV=32/3 stages, 9.28-14.76 ms for the
# other configs of the first sweep), 6.50 ms since its epilogue loads go in one batch,
# 6.26-6.45 ms (188 KB) with A and beta loaded with the V tiles and the prefetch below;
# transposed BV=32/KS=64 9.88 ms, the best of its six (its 3-stage main kernel failed
# parity, see the doc). PF_AT: the V tile, counted from the end, during which the
# epilogue's k, q, g are prefetched into L2: 2 measured 6.26-6.45 ms, 1 6.34-6.44, 3 6.51,
# 4 (the first tile) 6.95, none 6.47-6.50. K=64 (k64 shape): the same config 1.60 ms, the
# best measured (4-warp programs 1.67-1.76, BV=32 1.88, BV=128 1.88, 2 stages 1.85).
CONFIGS = {
    ("fullk", 64): dict(BV=64, num_warps=8, num_stages=3, PF_AT=2),
    ("fullk", 128): dict(BV=64, num_warps=8, num_stages=3, PF_AT=2),
    ("transposed", 64): dict(BV=32, KS=64, num_warps=8, num_stages=2, side_BV=32, side_warps=8, side_stages=2),
    ("transposed", 128): dict(BV=32, KS=64, num_warps=8, num_stages=2, side_BV=32, side_warps=8, side_stages=2),
}
# fullk beat transposed at every shape measured (prod8192_gate, b8, 1024/256/64 chunk-heads).
DEFAULT_DESIGN = "fullk"
# Launch order of fullk (HEADS_FAST): a 1D grid with b*hv fastest when K = 128 and there are at
# least this many (b, hv) pairs, else fla's order (a 2D grid, chunks fastest). Side by side on
# the H200 (2026-11-30, bitwise-equal outputs, ms 2D -> 1D): prod8192_gate 6.31 -> 6.09 and
# 6.37 -> 6.18, kimi 5.36 -> 4.99, b8 3.24 -> 3.14 (B*HV 256, 256, 128); small (B*HV 32)
# 0.94 -> 0.99, k64 (K=64) 1.61 -> 1.62 and 1.59 -> 1.62, 1,024 and 64 chunk-heads (B*HV 16)
# 0.332 -> 0.326 and 0.126 -> 0.126. Why the order matters was not isolated; see the doc.
HEADS_FAST_MIN_BHV = 128


def heads_fast_order(K: int, n_bhv: int) -> bool:
    """fullk's launch order for K and B*HV (n_bhv) (b, hv) pairs: True for the 1D grid with
    b*hv fastest, False for fla's order."""
    return K == 128 and n_bhv >= HEADS_FAST_MIN_BHV


def fullk_bv(V: int, pinned: int) -> int:
    """fullk's V tile for V: the pinned width, halved (down to 16) until V spans at least two
    tiles. With a single tile the V loop is peeled and everything in it is live at once: at
    K=128 ~3 KB of spills per thread. Measured on the H200 (stage alone, B8 T8192 H=HV=16
    K128, against fla's 4.67 / 4.56 ms): V=64 at BV 64 / 32 / 16: 9.20 / 1.88 / 2.31 ms;
    V=32 at BV 64 / 32 / 16: 8.45 / 5.49 / 1.96 ms. At K=64, V=64 (no spills either way)
    BV=32 1.22 ms against 1.53 at BV=64, side by side, so the rule holds at both K."""
    bv = pinned
    while bv > 16 and triton.cdiv(V, bv) < 2:
        bv //= 2
    return bv


# What ``config`` may set, per design (``timeline`` is the timeline instrument's buffer).
_CONFIG_KEYS = {
    "fullk": {"BV", "num_warps", "num_stages", "PF_AT", "HEADS_FAST", "maxnreg", "timeline"},
    "transposed": {"BV", "KS", "num_warps", "num_stages", "side_BV", "side_warps", "side_stages"},
}


def launch_config(design: str, K: int, V: int, n_bhv: int, config: dict | None = None) -> dict:
    """The effective launch config of ``design``: the pinned one for K, ``config`` over it,
    and for fullk the V tile (``fullk_bv``) and the launch order (HEADS_FAST) the rules pick
    unless ``config`` sets them."""
    if design not in _CONFIG_KEYS:
        raise ValueError(f"unknown B6 design {design!r}; expected 'fullk' or 'transposed'")
    unknown = set(config or {}) - _CONFIG_KEYS[design]
    if unknown:  # a misspelt or retired knob would otherwise be ignored without a word
        raise ValueError(f"B6 {design} takes no config key {sorted(unknown)}; known: {sorted(_CONFIG_KEYS[design])}")
    cfg = {**CONFIGS[(design, K)], **(config or {})}
    if design == "fullk":
        if "BV" not in (config or {}):
            cfg["BV"] = fullk_bv(V, cfg["BV"])
        if cfg.get("HEADS_FAST") is None:
            cfg["HEADS_FAST"] = heads_fast_order(K, n_bhv)
    return cfg


def prefetch_iter(V: int, BV: int, pf_at: int | None) -> int:
    """fullk's PF_ITER: the V tile (from 0) during which the epilogue's k, q and g are
    prefetched into L2, ``pf_at`` tiles before the end (the first tile if there are fewer);
    -1, no prefetch, without ``pf_at``."""
    return max(triton.cdiv(V, BV) - pf_at, 0) if pf_at else -1


# No floor: fullk beat fla's kernel at every grid measured, down to 64 chunk-heads
# (0.087 against 0.152 ms at d4cc914; 0.155 against 0.245 at 1a00800 and 0.123 against
# 0.206 at cc3f7e4, other machine starts). Grids below this many chunk-heads would go to
# fla.
MIN_CTAS = 0
_SMALLEST_BV = 32


def wy_dqkg_bwd(q, k, v, v_new, gc, beta, A, h, do, dh, dv, scale, chunk_size, cu_seqlens, chunk_indices,
                state_v_first: bool = False, design: str | None = None, config: dict | None = None):
    """B6 with fla's contract: returns (dq, dk, dv2, db, dg, dA); dq/dk/dg/db/dA fp32. h and
    dh are ``[B, NT, HV, K, V]``, or ``[B, NT, HV, V, K]`` with ``state_v_first``."""
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    BT = chunk_size
    for name, t in dict(q=q, k=k, v=v, v_new=v_new, gc=gc, beta=beta, A=A, h=h, do=do, dh=dh, dv=dv).items():
        if not t.is_contiguous():
            raise ValueError(f"B6 kernels index {name} as a dense tensor; got strides {t.stride()}")
    NT = triton.cdiv(T, BT) if cu_seqlens is None else len(chunk_indices)
    design = design or DEFAULT_DESIGN
    cfg = launch_config(design, K, V, B * HV, config)
    BK = triton.next_power_of_2(K)
    dq = torch.empty(B, T, HV, K, device=k.device, dtype=torch.float32)
    dk = torch.empty_like(dq)
    dg = torch.empty_like(dq)
    dv2 = torch.empty_like(v)
    db = torch.empty(B, T, HV, device=k.device, dtype=torch.float32)
    dA = torch.empty(B, T, HV, BT, device=k.device, dtype=torch.float32)
    grid = (NT, B * HV)
    if design == "fullk":
        fullk_grid = (NT * B * HV,) if cfg["HEADS_FAST"] else grid
        wy_dqkg_fullk_kernel[fullk_grid](
            q=q, k=k, v=v, v_new=v_new, g=gc, beta=beta, A=A, h=h, do=do, dh=dh, dv=dv,
            dq=dq, dk=dk, dv2=dv2, dg=dg, db=db, dA=dA,
            cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, scale=scale, T=T, NBH=B * HV,
            stamps=cfg.get("timeline"),
            H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, BV=cfg["BV"],
            PF_ITER=prefetch_iter(V, cfg["BV"], cfg.get("PF_AT")),
            HEADS_FAST=bool(cfg["HEADS_FAST"]), STATE_V_FIRST=bool(state_v_first),
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
            **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}),
        )
    else:  # transposed (launch_config refuses any other design)
        dw_park = torch.empty(B, T, HV, K, device=k.device, dtype=k.dtype)
        kg_park = torch.empty_like(dw_park)
        dgk_buf = torch.empty(B * NT * HV, K, device=k.device, dtype=torch.float32)
        wy_dqkg_transposed_main_kernel[grid](
            q=q, k=k, g=gc, beta=beta, A=A, h=h, do=do, dh=dh, dv=dv, v_new=v_new,
            dq=dq, dk=dk, dg=dg, db=db, dw_park=dw_park, kg_park=kg_park, dgk_buf=dgk_buf,
            cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, scale=scale, T=T,
            H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, BV=cfg["BV"], KS=cfg["KS"], STATE_V_FIRST=bool(state_v_first),
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
        wy_dqkg_transposed_side_kernel[grid](
            v=v, beta=beta, A=A, dv=dv, dw_park=dw_park, kg_park=kg_park,
            dv2=dv2, db=db, dA=dA,
            cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, T=T,
            HV=HV, K=K, V=V, BT=BT, BK=BK, BV=cfg["side_BV"],
            num_warps=cfg["side_warps"], num_stages=cfg["side_stages"],
        )
    return dq, dk, dv2, db, dg, dA


def supports(q, k, v, v_new, gc, beta, A, h, do, dh, dv, scale, chunk_size, cu_seqlens, chunk_indices,
             state_v_first=False):
    """None when ``wy_dqkg_bwd`` takes the call, else why the stage stays on fla."""
    K, V, HV = k.shape[-1], v.shape[-1], v.shape[2]
    if chunk_size != 64:
        return f"chunk_size={chunk_size} (B6 kernels are built for 64)"
    if K not in (64, 128):
        return f"K={K} (B6 kernels take K in 64, 128)"
    if V % _SMALLEST_BV:
        return f"V={V} is not a multiple of {_SMALLEST_BV}"
    if k.dtype not in (torch.bfloat16, torch.float16) or h.dtype != k.dtype or v.dtype != k.dtype:
        return f"dtype {str(k.dtype).replace('torch.', '')} (B6 kernels take bf16/fp16)"
    layout = (V, K) if state_v_first else (K, V)
    if tuple(h.shape[-2:]) != layout or tuple(dh.shape[-2:]) != layout:
        return f"h/dh are {list(h.shape[-2:])}/{list(dh.shape[-2:])}, not the {'[V, K]' if state_v_first else '[K, V]'} layout"
    n_chunks = triton.cdiv(k.shape[1], chunk_size) * k.shape[0] if cu_seqlens is None else len(chunk_indices)
    if n_chunks * HV < MIN_CTAS:
        return f"{n_chunks * HV} chunk-heads < the B6 floor of {MIN_CTAS}"
    return None


add_impl("B6", "ours", wy_dqkg_bwd, supports)
