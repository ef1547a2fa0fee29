"""Triton kernels for BFP / BFP-prime quantize-dequantize (docs/numerics.md sections 4-6, 8).

Bit-for-bit the torch reference :func:`qtorch_onnx.formats.bfp.bfp_reference` (forward value and
straight-through mask). The block axis is handled in place, without a transposed copy: the tensor is seen
as ``(outer, n_axis, inner)`` (contiguous) and one program quantizes a tile of ``ROWS`` (outer, inner) rows
by one block of ``BLOCK_SIZE`` elements along the axis, at stride ``inner``.

Exactness: every float operation is either exact (scaling by a power of two upward, integer-valued
arithmetic below 2^24) or one correctly rounded IEEE multiply, so no result depends on FMA contraction
or on the division instruction (divisions by the power-of-two step are done as products). Subnormal
float32 arithmetic must not be flushed (Triton's default).

Public: :func:`bfp_quantize_dequantize_triton`, :func:`ste_backward_triton`. Shared jit helpers
(``exponent_field``, ``exp2i``, ``div_pow2``, ``round_magnitude``, ``apply_sign``) are reused by
:mod:`qtorch_onnx.triton_kernels.mx`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["bfp_quantize_dequantize_triton", "ste_backward_triton", "block_view", "tile_rows"]


# ----------------------------------------------------------------------------------------- helpers
@triton.jit
def exponent_field(x):
    """E(x): the biased exponent field (int32, 0..255) of float32 ``x``."""
    return (x.to(tl.int32, bitcast=True) >> 23) & 0xFF


@triton.jit
def exp2i(k):
    """Exact float32 2^k for int32 ``k`` clamped to [-149, 127] (subnormal below -126)."""
    k = tl.minimum(tl.maximum(k, -149), 127)
    normal = tl.minimum(tl.maximum(k + 127, 1), 254) << 23
    sub = tl.full(k.shape, 1, tl.int32) << tl.minimum(tl.maximum(k + 149, 0), 22)
    return tl.where(k >= -126, normal, sub).to(tl.float32, bitcast=True)


@triton.jit
def negate(x):
    """-x for float32 ``x`` by flipping the sign bit, so -(+0.0) is -0.0. Not ``-x``: triton before 3.8 lowers
    unary minus as ``0 - x``, which gives +0.0 for +0.0 and lost the sign of quantized negative zeros."""
    return (x.to(tl.int32, bitcast=True) ^ -2147483648).to(tl.float32, bitcast=True)


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def row_max(e):
    """Maximum over axis 1 (keepdims). Own combine function instead of ``tl.max``: triton.language's
    ``@jit`` helpers are JITFunctions when triton was imported before ``TRITON_INTERPRET=1`` was set (torch
    imports it), and the interpreter cannot call those."""
    return tl.reduce(e, 1, _max_combine)[:, None]


@triton.jit
def div_pow2(x, k):
    """``x / 2^k`` correctly rounded, for int32 ``k`` in [-276, 127]: a product by 2^-k, split in two
    upward (exact) products when 2^-k is not a float32."""
    first = exp2i(tl.minimum(tl.maximum(-k, -127), 127))
    second = exp2i(tl.maximum(-k - 127, 0))
    return (x * first) * second


@triton.jit
def round_magnitude(v, MODE: tl.constexpr):
    """|R(v)| for finite float32 ``|v| < 2^31`` with rounding mode 0/1/2 (others as 0), exactly."""
    ti = v.to(tl.int32)  # truncation toward zero
    t = ti.to(tl.float32)
    f = tl.abs(v - t)  # exact fraction in [0, 1)
    if MODE == 2:
        up = (f > 0.5) | ((f == 0.5) & ((ti & 1) != 0))
    elif MODE == 1:
        up = tl.where(v < 0, f > 0.5, f >= 0.5)
    else:
        up = f >= 0.5
    return tl.abs(t) + up.to(tl.float32)


@triton.jit
def apply_sign(mag, v, MODE: tl.constexpr):
    """Signed rounded value with the zero-sign rule of ``round_with_mode`` (modes 0/1: sign of ``v``;
    mode 2: +0.0 when a nonzero ``v`` rounds to zero, ``v = -0.0`` stays -0.0)."""
    neg = v.to(tl.int32, bitcast=True) < 0
    r = tl.where(neg, negate(mag), mag)
    if MODE == 2:
        r = tl.where((mag == 0) & (v != 0), 0.0, r)
    return r


@triton.jit
def _bf16_bits(x):
    """Quark's convert_to_bfloat_before_bfp: (u + 0x7FFF + lsb) with low 16 bits cleared, no NaN case."""
    u = x.to(tl.int32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) & -65536
    return r.to(tl.float32, bitcast=True)


@triton.jit
def _load_tile(x_ptr, rows, n_rows, n_axis, inner, a, jmask, BF16: tl.constexpr):
    o = rows // inner
    i = rows - o * inner
    row_off = o.to(tl.int64) * n_axis * inner + i
    offs = row_off[:, None] + a.to(tl.int64)[None, :] * inner
    valid = (rows < n_rows)[:, None] & (jmask & (a < n_axis))[None, :]
    xin = tl.load(x_ptr + offs, mask=valid, other=0.0)
    x = xin.to(tl.float32)  # float16/bfloat16 widen exactly
    if x_ptr.dtype.element_ty == tl.float16:
        # a NaN keeps its payload, quieted (formats.block.half_to_float32); a GPU cast writes 0x7FFFFFFF
        h = xin.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        m = h & 0x3FF
        nan_bits = ((h & 0x8000) << 16) | 0x7FC00000 | (m << 13)
        x = tl.where(((h & 0x7C00) == 0x7C00) & (m != 0), nan_bits.to(tl.float32, bitcast=True), x)
    if BF16:
        x = _bf16_bits(x)
    return x, offs, valid


@triton.jit
def block_tile(n_blk, BLOCK_SIZE: tl.constexpr, BS: tl.constexpr, ROWS: tl.constexpr):
    """This program's tile: ``rows`` (ROWS row indices), ``j`` (0..BS-1 within the block) and ``a`` (the
    block's positions along the axis), from ``program_id(0) = row_tile * n_blk + block``."""
    pid = tl.program_id(0)
    pid_b = pid % n_blk
    pid_r = pid // n_blk
    rows = pid_r * ROWS + tl.arange(0, ROWS)
    j = tl.arange(0, BS)
    return rows, j, pid_b * BLOCK_SIZE + j


# ------------------------------------------------------------------------------------------ kernel
@triton.jit
def _bfp_kernel(x_ptr, y_ptr, keep_ptr, n_rows, n_axis, inner, n_blk,
                M: tl.constexpr, MODE: tl.constexpr, PRIME: tl.constexpr, SUB: tl.constexpr,
                SHIFT_MAX: tl.constexpr, BF16: tl.constexpr, WRITE_MASK: tl.constexpr,
                BLOCK_SIZE: tl.constexpr, BS: tl.constexpr, ROWS: tl.constexpr):
    rows, j, a = block_tile(n_blk, BLOCK_SIZE, BS, ROWS)
    jmask = j < BLOCK_SIZE
    x, offs, valid = _load_tile(x_ptr, rows, n_rows, n_axis, inner, a, jmask, BF16)
    e = exponent_field(x)
    qmax: tl.constexpr = (1 << M) - 1
    if PRIME:
        shared = row_max(e)  # Inf/NaN included
        # sub-block maxima without a reshape: reload the SUB members of each element's sub-block
        e_sub = tl.full(e.shape, 0, tl.int32)
        for t in tl.static_range(SUB):
            a_t = (a - j) + (j // SUB) * SUB + t
            x_t, _, _ = _load_tile(x_ptr, rows, n_rows, n_axis, inner, a_t, jmask, BF16)
            e_sub = tl.maximum(e_sub, exponent_field(x_t))
        shift = tl.minimum(shared - e_sub, SHIFT_MAX)
        bits = x.to(tl.int32, bitcast=True)
        mant = tl.where(e != 0, (bits & 0x7FFFFF) | 0x800000, 0)
        t_bits = tl.minimum(shared - shift - e + (24 - M), 31)  # >= 1; > 25 gives 0 anyway
        q = mant >> t_bits
        rem = mant - (q << t_bits)
        half = tl.full(e.shape, 1, tl.int32) << (t_bits - 1)
        if MODE == 0:
            up = rem >= half
        elif MODE == 1:
            up = (rem > half) | ((rem == half) & (bits >= 0))
        else:
            up = (rem > half) | ((rem == half) & ((q & 1) == 1))
        saturated = up & (q == qmax)
        q = q + (up & (q != qmax)).to(tl.int32)
        k = shared - 127 - shift + 1 - M
        k_hi = tl.maximum(k, -126)
        mag = (q.to(tl.float32) * exp2i(k_hi)) * exp2i(k - k_hi)
        y = tl.where(bits < 0, negate(mag), mag)
        nan = tl.full(e.shape, 0x7FFFFFFF, tl.int32).to(tl.float32, bitcast=True)
        y = tl.where(shared == 255, nan, y)
        keep = ~saturated | (e == 255)  # NaN/Inf pass gradient 1, whatever their payload
    else:
        special = e == 255
        shared = row_max(tl.where(special, 0, e))
        k = shared - 127 - (M - 1)
        v = div_pow2(x, k)
        mag = round_magnitude(v, MODE)
        clipped = mag > qmax
        r = apply_sign(tl.minimum(mag, qmax * 1.0), v, MODE)
        y = r * exp2i(k)
        y = tl.where(special, x, y)
        keep = ~(clipped & ~special)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=valid)  # round to nearest even when narrower
    if WRITE_MASK:
        tl.store(keep_ptr + offs, keep.to(tl.int8), mask=valid)


@triton.jit
def _ste_kernel(g_ptr, keep_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    g = tl.load(g_ptr + offs, mask=m, other=0.0)
    k = tl.load(keep_ptr + offs, mask=m, other=0)
    tl.store(out_ptr + offs, tl.where(k != 0, g, 0.0 * g), mask=m)


# ---------------------------------------------------------------------------------------- wrappers
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_input_dtype(x: torch.Tensor, op: str) -> None:
    """Raise the reference's DataError unless ``x`` is a float32/float16/bfloat16 tensor (no copy made)."""
    if not isinstance(x, torch.Tensor) or x.dtype not in _DTYPES:
        from qtorch_onnx.formats.block import as_float32

        as_float32(x, op)  # raises with the reference's message


def block_view(x: torch.Tensor, axis: int) -> tuple[int, int, int]:
    """``(outer, n_axis, inner)`` of a contiguous tensor seen with the block axis in the middle."""
    shape = x.shape if x.dim() else (1,)
    outer = 1
    for s in shape[:axis]:
        outer *= s
    inner = 1
    for s in shape[axis + 1:]:
        inner *= s
    return outer, shape[axis], inner


def tile_rows(block_size: int, n_rows: int, target: int = 2048) -> int:
    """Rows per program: a power of two with ``rows * next_pow2(block_size) <= target``, at most ``n_rows``."""
    bs = triton.next_power_of_2(block_size)
    return max(1, min(max(1, target // bs), triton.next_power_of_2(max(1, n_rows))))


def bfp_quantize_dequantize_triton(x: torch.Tensor, *, bfp_method: str = "to_bfp", axis: int = 1,
                                   bit_width: int = 16, block_size: int = 8, rounding_mode: int = 0,
                                   sub_block_size: int = 2, sub_block_shift_bits: int = 1,
                                   convert_to_bfloat_before_bfp: int = 0, return_mask: bool = False,
                                   rows_per_program: int | None = None):
    """Triton BFP / BFP-prime quantize-dequantize; same contract and result bits as ``bfp_reference``.

    Args:
        x: float32 or float16 tensor on a Triton device (or CPU under ``TRITON_INTERPRET=1``).
        bfp_method ... convert_to_bfloat_before_bfp: as :func:`qtorch_onnx.ops.bfp_quantize_dequantize`.
        return_mask: also return the straight-through mask (bool, ``x``'s shape).
        rows_per_program: tile height override (power of two), for tests.
    Returns:
        ``y`` (``x``'s shape and dtype) or ``(y, mask)``.
    Raises:
        ConfigError / DataError: as the reference.
    """
    from qtorch_onnx.formats.bfp import bfp_reference, validate_bfp_attributes
    from qtorch_onnx.formats.block import normalize_axis

    fmt = validate_bfp_attributes(bfp_method, bit_width, block_size, rounding_mode, sub_block_size,
                                  sub_block_shift_bits, convert_to_bfloat_before_bfp)
    check_input_dtype(x, "BFPQuantizeDequantize")
    ax = normalize_axis(axis, x.dim())
    if x.numel() <= 1:
        return bfp_reference(x, bfp_method=fmt.bfp_method, axis=axis, bit_width=bit_width, block_size=block_size,
                             rounding_mode=rounding_mode, sub_block_size=sub_block_size,
                             sub_block_shift_bits=sub_block_shift_bits,
                             convert_to_bfloat_before_bfp=convert_to_bfloat_before_bfp, return_mask=return_mask,
                             validate=False)
    xf = x.contiguous()  # float16/bfloat16 are read as they are and widened in the kernel
    outer, n_axis, inner = block_view(xf, ax)
    y = torch.empty_like(xf)
    keep = torch.empty(xf.shape, dtype=torch.int8, device=xf.device) if return_mask else y
    n_rows = outer * inner
    rows = rows_per_program or tile_rows(block_size, n_rows)
    n_blk = triton.cdiv(n_axis, block_size)
    grid = (triton.cdiv(n_rows, rows) * n_blk,)
    prime = fmt.bfp_method == "to_bfp_prime"
    _bfp_kernel[grid](xf, y, keep, n_rows, n_axis, inner, n_blk,
                      M=bit_width - 9, MODE=rounding_mode, PRIME=prime, SUB=sub_block_size if prime else 1,
                      SHIFT_MAX=(1 << sub_block_shift_bits) - 1, BF16=bool(convert_to_bfloat_before_bfp),
                      WRITE_MASK=return_mask, BLOCK_SIZE=block_size, BS=triton.next_power_of_2(block_size),
                      ROWS=rows)
    return (y, keep.bool()) if return_mask else y


def ste_backward_triton(grad_y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Straight-through backward (docs/numerics.md section 8): ``grad_x = grad_y`` where ``mask``, else 0.

    Args:
        grad_y: float tensor; mask: bool tensor of the same shape (from ``return_mask=True``).
    Returns:
        ``grad_x``, same shape and dtype as ``grad_y`` (bit-equal to ``grad_y * mask``).
    """
    g = grad_y.contiguous()
    k = mask.contiguous().to(torch.int8)
    out = torch.empty_like(g)
    n = g.numel()
    if n:
        _ste_kernel[(triton.cdiv(n, 1024),)](g, k, out, n, BLOCK=1024)
    return out
