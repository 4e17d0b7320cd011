"""Triton helpers any kernel-fun kernel may use: the interpreter shims, fp32-level dots on
tf32 tensor cores, pair stores from an accumulator's layout, an L2 prefetch hint, a layout
pin, the chunk coordinates of packed sequences, and a launcher's config check.

Each compiles, for the GPU, to exactly what the kernel that first carried it compiled to
(the sm_90a machine code of every shipped kernel is held by its fingerprint:
``python -m benchmarks.compile_report``). Under the interpreter each has a plain
equivalent.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Two faults of Triton 3.6's interpreter with bf16, which it stores as uint16: tl.dot
# multiplies that storage (a [16,16] bf16 dot comes out ~1e10 off; fp16 and fp32 are
# right), and fp32 -> bf16 casts truncate instead of rounding to nearest even. Under the
# interpreter the dots take fp32 copies of their operands (exact for bf16 values) and the
# casts round to nearest even by hand; compiled for the GPU both helpers are the plain op.
INTERPRETING = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


def interpreting() -> bool:
    """Whether kernel-fun's Triton kernels were defined for the interpreter: Triton decides at
    a kernel's definition, so what counts is TRITON_INTERPRET as it was when this module was
    imported (before any kernel of kernel-fun's)."""
    return bool(INTERPRETING.value)


def chunk_offsets(cu_seqlens: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Each packed sequence's first chunk row, [N + 1], formed on the offsets' device (no
    synchronization; the last entry is the real chunk count)."""
    counts = (cu_seqlens[1:] - cu_seqlens[:-1] + (chunk_size - 1)).div(chunk_size, rounding_mode="floor")
    return torch.nn.functional.pad(counts.cumsum(0), (1, 0))


def config_over(pinned: dict, config: dict | None, keys, who: str) -> dict:
    """A launcher's config: ``pinned`` with ``config`` over it (the benchmarks' sweeps), a
    key the launcher does not know refused (a misspelt or retired knob would otherwise be
    ignored without a word)."""
    unknown = set(config or {}) - set(keys)
    if unknown:
        raise ValueError(f"{who} takes no config key {sorted(unknown)}; known: {sorted(keys)}")
    return {**pinned, **(config or {})}


def v_slice(config: dict, V: int) -> int:
    """A scan's V slice for V columns: ``config``'s BV, clipped to V's next power of two (a
    program never wider than V)."""
    return min(config["BV"], triton.next_power_of_2(V))


def sm_count(t: torch.Tensor) -> dict:
    """``least_waves``' ``sms`` keyword for a scan launched on ``t``'s device: its SM count on a
    GPU, nothing off one (the launchers' default, 132)."""
    return {"sms": torch.cuda.get_device_properties(t.device).multi_processor_count} if t.is_cuda else {}


def least_waves(table: dict, sequence_heads: int, V: int, sms: int) -> dict:
    """A chunk scan's config from ``table`` ({BV: (config, step latency, programs an SM)}) for
    ``sequence_heads`` chains of V columns on ``sms`` SMs: the V slice (at most V, or the
    narrowest) whose waves times its step latency is least."""
    def cost(bv):
        return -(-sequence_heads * -(-V // bv) // (sms * table[bv][2])) * table[bv][1]
    return dict(table[min((bv for bv in table if bv <= max(min(table), V)), key=cost)][0])


@triton.jit
def dot(a, b, acc=None):
    if INTERPRETING:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


# An anchored factor exp2(g_r - g_anchor) may pass 1 only while the gate's span through the
# anchor is at most this (log2): factors within 2^+-64, so even gradients of 1e-18 stay
# normal numbers in the dots (B7's diagonal blocks).
GUARD_SPAN = tl.constexpr(64.0)


@triton.jit
def tf32_split(x):
    """fp32 x as hi + lo: hi its top 19 bits (a tf32 value, by truncation: one LOP3), lo the
    exact remainder (|lo| < 2^-10 |x|), which a tf32 product reads to its own top 19 bits."""
    hi = (x.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
    return hi, x - hi


@triton.jit
def dot3(a, b, acc=None):
    """acc + a b for fp32 a, b on the tensor cores in three tf32 products, a_hi b_lo + a_lo b_hi +
    a_hi b_hi (the small ones first), relative error ~2^-20 of each product: fp32-level for
    sums that end in bf16 or in fp32 gradients. Split by hand: Triton 3.6's tf32x3 rounds
    both halves with cvt.rna and guards inf/NaN, ~8 instructions an element on sm_90a
    against 2 here."""
    a_hi, a_lo = tf32_split(a)
    b_hi, b_lo = tf32_split(b)
    acc = tl.dot(a_hi, b_lo, acc, input_precision="tf32")
    acc = tl.dot(a_lo, b_hi, acc, input_precision="tf32")
    return tl.dot(a_hi, b_hi, acc, input_precision="tf32")


@triton.jit
def to(x, dtype: tl.constexpr):
    if INTERPRETING:
        if dtype == tl.bfloat16:
            bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def prefetch_rows(base, rows, row_stride, m_rows, ROW_ELEMS: tl.constexpr):
    """Asks L2 for the 128-byte lines of rows ``base + rows * row_stride`` (elements), each
    ROW_ELEMS elements long. A hint: it returns nothing, faults on nothing (masked lanes are
    predicated off) and is skipped under the interpreter, where it would mean nothing. Its
    addresses still matter: prefetches outside the tensors measured 5x slower on the H200
    (docs/log/b6.md, fourth round), which no value shows."""
    if not INTERPRETING:
        ROW_BYTES: tl.constexpr = ROW_ELEMS * base.dtype.element_ty.primitive_bitwidth // 8
        NL: tl.constexpr = (ROW_BYTES + 127) // 128
        o_l = tl.arange(0, NL)
        ptrs = (base + rows[:, None] * row_stride).to(tl.pointer_type(tl.int8)) + o_l[None, :] * 128
        on = tl.broadcast_to(m_rows[:, None], (rows.shape[0], NL)).to(tl.int32)  # a row's lines share its mask
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
            "=r,l,r", [ptrs, on], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def chunk_coords(i_t, i_bh, cu_seqlens, chunk_indices, T, HV: tl.constexpr, BT: tl.constexpr,
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
def chunk_head(cu_seqlens, chunk_indices, T, H: tl.constexpr, HV: tl.constexpr, BT: tl.constexpr,
               IS_VARLEN: tl.constexpr):
    """A (chunk, value head) program's (value head, q/k head, the chunk's first token row,
    its token count), on fla's grid (chunks, batch x value heads)."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_hv = i_bh % HV
    i_c, i_tg, bos, T_seq = chunk_coords(i_t, i_bh, cu_seqlens, chunk_indices, T, HV, BT, IS_VARLEN)
    return i_hv, i_hv // (HV // H), bos + i_c * BT, tl.minimum(T_seq - i_c * BT, BT).to(tl.int32)


@triton.jit
def opaque_zeros_like(x):
    """fp32 zeros in x's layout that the compiler cannot fold: adding them to a loaded tile
    pins that tile to x's layout at one point (a layout conversion of the load), where it
    would otherwise convert each value derived from the tile separately. Exact: v + 0.0 is
    v for every v but -0.0, which becomes +0.0; here it feeds exp2 (g) or products that
    are summed with other terms or masked (beta), so no output value changes. Plain zeros
    under the interpreter, which has no inline assembly."""
    if INTERPRETING:
        return tl.zeros_like(x)
    else:
        return tl.inline_asm_elementwise("mov.b32 $0, 0;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)


def _pair_store_asm(addresses: str, x0: str, x1: str, m0: str, m1: str) -> str:
    """PTX of one pair of ``store_pairs``: ``addresses`` sets a0, a1 (the two addresses) and
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
def store_pairs(base, off, x, mask):
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
    tl.static_assert(x.dtype == tl.float32, "store_pairs stores fp32 values")
    tl.static_assert(base.dtype.element_ty == tl.float32, "store_pairs stores to fp32 pointers")
    if off is not None:
        tl.static_assert(off.dtype == tl.int32, "store_pairs takes int32 element offsets")
    if INTERPRETING:
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


# The sequential scans' sequences (F7-F8, B3, B4-B5)
@triton.jit
def sequence_span(i_n, cu_seqlens, chunk_offsets, T, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Sequence i_n's first token row, its length and its first chunk's index."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T_seq = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
        boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        T_seq = T
        boh = i_n.to(tl.int64) * tl.cdiv(T, BT)
    return bos, T_seq, boh


def check_dense(**tensors) -> None:
    for name, t in tensors.items():
        if t is not None and not t.is_contiguous():
            raise ValueError(f"the scan kernel indexes {name} as a dense tensor; got strides {t.stride()}")


def chains(B: int, T: int, BT: int, cu_seqlens, chunk_indices):
    """(sequences, chunks in all, each sequence's first chunk index or None when dense). The
    packed chunk count is the chunk index's row count (read from the offsets' data it would
    wait for the stream); the first chunks are formed on the device."""
    if cu_seqlens is None:
        return B, B * triton.cdiv(T, BT), None
    return len(cu_seqlens) - 1, chunk_indices.shape[0], chunk_offsets(cu_seqlens, BT)
