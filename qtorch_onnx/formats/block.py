"""Shared helpers of the block formats (BFP, BFP-prime, OCP MX): block layout and float32 bit tricks.

Everything here follows ``docs/numerics.md`` section 4 (block layout) and the notation of its preamble:
``E(x)`` is the 8-bit biased exponent field (bits 30..23) of a float32. Pure torch, any device, no Python
loop over blocks. This module imports torch only (rule of the house for ``formats/``).
"""
from __future__ import annotations

from typing import Callable

import torch

from ..errors import ConfigError, DataError

__all__ = [
    "exponent_field",
    "exp2_int",
    "round_with_mode",
    "bfloat16_round",
    "to_blocks",
    "normalize_axis",
    "as_float32",
]

_ROUNDING_NAMES = {0: "half away from zero", 1: "half toward +infinity", 2: "half to even"}


def exponent_field(x: torch.Tensor) -> torch.Tensor:
    """Biased exponent field ``E(x)`` of a float32 tensor (docs/numerics.md notation).

    Args:
        x: float32 tensor, any shape.
    Returns:
        int32 tensor of the same shape, values 0..255 (0 for zero and subnormals, 255 for Inf/NaN).
    """
    return torch.bitwise_and(torch.bitwise_right_shift(x.view(torch.int32), 23), 0xFF)


def exp2_int(k: torch.Tensor) -> torch.Tensor:
    """Exact float32 ``2**k`` for an integer tensor ``k``, built from the bit pattern.

    Args:
        k: integer tensor (any int dtype), any shape.
    Returns:
        float32 tensor: ``2**k`` exactly for ``-149 <= k <= 127`` (subnormal below -126); ``0.0`` for
        ``k < -149`` and ``+inf`` for ``k > 127``.
    """
    k = k.to(torch.int32)
    normal = torch.bitwise_left_shift(torch.clamp(k + 127, 1, 254), 23)
    sub = torch.bitwise_left_shift(torch.ones_like(k), torch.clamp(k + 149, 0, 22))
    bits = torch.where(k >= -126, normal, sub)
    bits = torch.where(k < -149, torch.zeros_like(bits), bits)
    bits = torch.where(k > 127, torch.full_like(bits, 0x7F800000), bits)
    return bits.view(torch.float32)


def round_with_mode(v: torch.Tensor, mode: int) -> torch.Tensor:
    """Round a float32 tensor to integers with a block-format rounding mode (docs/numerics.md preamble).

    Modes: 0 half away from zero, 1 half toward +infinity, 2 half to even. Modes 0 and 1 keep the sign
    of the input on a zero result (-0.3 -> -0.0); mode 2 gives +0.0 when a nonzero ``v`` rounds to zero,
    while a zero ``v`` keeps its sign (-0.0 -> -0.0; this is what Quark's golden vectors record, including a
    negative subnormal whose quotient underflowed to -0.0). Any other mode value behaves as 0. Exact for every finite float32 (no ``floor(v + 0.5)`` double rounding);
    NaN/Inf propagate and are expected to be masked by the caller.

    Args:
        v: float32 tensor, any shape.
        mode: the ``rounding_mode`` attribute.
    Returns:
        float32 tensor of integral values, same shape.
    """
    if mode == 2:
        r = torch.round(v)  # IEEE round half to even
        return torch.where((r == 0) & (v != 0), torch.zeros_like(r), r)
    if mode == 1:
        f = torch.floor(v)
        r = f + (v - f >= 0.5).to(v.dtype)  # v - floor(v) is exact in float32
    else:
        t = torch.trunc(v)
        r = t + torch.where((v - t).abs() >= 0.5, torch.sign(v), torch.zeros_like(v))
    return torch.copysign(r.abs(), v)


def bfloat16_round(x: torch.Tensor) -> torch.Tensor:
    """Quark's ``convert_to_bfloat_before_bfp`` rounding: float32 -> bfloat16 precision, kept in float32.

    Pure bit arithmetic, ``bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16`` modulo 2^32, with NO
    special case for NaN (round to nearest even for every finite value, overflow to +-Inf). This is what
    Quark 0.13's golden vectors record and it differs from docs/numerics.md section 3 on NaN inputs: a NaN whose
    payload sits in the low 16 bits can become +-Inf (0x7F800001 -> 0x7F800000), other NaNs keep a
    rounded payload (0x7F80FFFF -> 0x7F810000), 0xFFFF8000.. wraps to +0.0. Never modifies ``x``.

    Args:
        x: float32 tensor, any shape.
    Returns:
        float32 tensor, same shape, whose low 16 bits are zero.
    """
    u = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    lsb = (u >> 16) & 1
    r = (((u + 0x7FFF + lsb) >> 16) << 16) & 0xFFFFFFFF
    r = torch.where(r >= 0x80000000, r - (1 << 32), r)
    return r.to(torch.int32).view(torch.float32)


def normalize_axis(axis: int, rank: int, attribute: str = "axis") -> int:
    """Map a possibly negative ``axis`` to ``0..rank-1`` (rank 1 ignores it, docs/numerics.md section 4).

    Raises:
        ConfigError: ``axis`` outside ``[-rank, rank-1]`` for a tensor of rank >= 2.
    """
    if rank <= 1:
        return 0
    if not isinstance(axis, int) or isinstance(axis, bool) or not -rank <= axis < rank:
        raise ConfigError(f"attribute {attribute!r}={axis!r} is out of range for a rank-{rank} tensor; "
                          f"valid: integers in [{-rank}, {rank - 1}]")
    return axis % rank


def to_blocks(x: torch.Tensor, axis: int, block_size: int) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """Lay a tensor out as blocks along ``axis`` (docs/numerics.md section 4).

    The block axis is moved to the end and zero-padded to a multiple of ``block_size`` (zeros have
    ``E = 0``, so a partial block behaves as a smaller block).

    Args:
        x: tensor of rank >= 1, any dtype; ``axis`` already normalized to ``0..rank-1``.
        axis: block axis.
        block_size: elements per block (> 0).
    Returns:
        ``(blocks, restore)``: ``blocks`` has shape ``(*other_dims, n_blocks, block_size)``; ``restore``
        maps a tensor of that shape back to ``x``'s shape and layout (dropping the padding).
    """
    moved = torch.movedim(x, axis, -1)
    n = moved.shape[-1]
    n_blocks = -(-n // block_size)
    pad = n_blocks * block_size - n
    if pad:
        moved = torch.nn.functional.pad(moved, (0, pad))
    lead = moved.shape[:-1]
    blocks = moved.reshape(*lead, n_blocks, block_size)

    def restore(b: torch.Tensor) -> torch.Tensor:
        flat = b.reshape(*lead, n_blocks * block_size)
        if pad:
            flat = flat[..., :n]
        return torch.movedim(flat, -1, axis).contiguous()

    return blocks, restore


def half_to_float32(x: torch.Tensor) -> torch.Tensor:
    """float16 ``x`` widened to float32 exactly, a NaN quieted with its payload in the top mantissa bits:
    ``sign | 0x7FC00000 | m << 13`` (the x86 F16C conversion, and the operator library's ``half_to_float``).

    torch's own cast is not one function for NaNs: its CPU scalar path writes 0x7FFFFFFF, its vectorised path
    the F16C bits, a CUDA cast 0x7FFFFFFF; and a NaN's bits are seen by ``convert_to_bfloat_before_bfp``
    (0x7FFFFFFF rounds to -0.0 there, 0x7FC00000 stays NaN). Shape and device are ``x``'s.
    """
    y = x.to(torch.float32)
    h = x.view(torch.int16).to(torch.int32) & 0xFFFF
    m = h & 0x3FF
    nan = ((h & 0x7C00) == 0x7C00) & (m != 0)
    bits = ((h & 0x8000) << 16) | 0x7FC00000 | (m << 13)
    return torch.where(nan, bits.view(torch.float32), y)


def as_float32(x: torch.Tensor, op: str) -> tuple[torch.Tensor, torch.dtype]:
    """Check the input dtype of a block operator and widen float16 / bfloat16 to float32 (docs/numerics.md
    section 4: a float16 input is computed in float32 and the result rounded back to float16; float16 NaNs
    widen as in :func:`half_to_float32`).

    bfloat16 is accepted for torch-side use (training in bf16) with the same rule; the ONNX operators
    themselves take float32 and float16 only. The payload of a NaN result in bfloat16 is unspecified (torch's
    CPU cast writes 0xFFFF, a GPU's ``cvt.rn.bf16.f32`` 0x7FFF): bfloat16 NaNs compare as NaNs.

    Returns:
        ``(x as float32, original dtype)``; ``x`` itself when it is float32 already (never modified).
    Raises:
        DataError: ``x`` is not a tensor, or not float32/float16/bfloat16 (names the operator and the valid
            dtypes).
    """
    if not isinstance(x, torch.Tensor):
        raise DataError(f"{op}: input must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype == torch.float32:
        return x, x.dtype
    if x.dtype == torch.float16:
        return half_to_float32(x), x.dtype
    if x.dtype == torch.bfloat16:
        return x.to(torch.float32), x.dtype
    raise DataError(f"{op}: input dtype {x.dtype} is not supported; valid: torch.float32, torch.float16, "
                    "torch.bfloat16")

