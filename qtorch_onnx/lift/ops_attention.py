"""Transformer-block converters: Attention-23/24/25 (MHA/GQA/MQA, KV cache, masks, softcap, all four outputs),
RotaryEmbedding-23 and LinearAttention-27. Semantics from the ONNX operator spec (``onnx.defs`` docs of those versions)."""
from __future__ import annotations

import math

import torch
from torch import nn

from .ops_common import (
    TP, ConversionNotSupported, OnnxGraph, OnnxNode, OnnxToTorchModule, attr, register_versions, result,
)

_PRECISION = {TP.FLOAT: torch.float32, TP.DOUBLE: torch.float64, TP.FLOAT16: torch.float16, TP.BFLOAT16: torch.bfloat16}


class OnnxAttention(nn.Module, OnnxToTorchModule):
    """ONNX Attention-23/24: ``softmax(softcap(Q' K'^T) + bias) V`` with ``Q' = Q sqrt(scale)``,
    ``K' = K sqrt(scale)`` (the spec's overflow-safe scaling; ``scale`` default ``1/sqrt(head_size)``).

    Inputs: Q ``[B, Hq, Sq, D]`` or ``[B, Sq, Hq*D]`` (then ``q_num_heads``/``kv_num_heads`` are
    required); K ``[B, Hkv, Skv, D]`` / ``[B, Skv, Hkv*D]``; V ``[B, Hkv, Skv, Dv]`` / 3-D alike;
    optional ``attn_mask`` (bool: True attends; float: added) broadcastable to ``[B, Hq, Sq, T]``,
    its last axis padded to ``T = past + Skv`` with False / -inf; ``past_key``/``past_value``
    ``[B, Hkv, P, D|Dv]`` (concatenated before K/V along the sequence axis); ``nonpad_kv_seqlen``
    ``[B]`` (opset 24: keys at positions ``>= nonpad_kv_seqlen[b]`` are masked). Opset 25 adds a
    sliding window: with ``diff = i + offset - j``, ``left_window_size >= 0`` keeps ``diff <= left``
    and ``right_window_size >= 0`` keeps ``-diff <= right`` (-1: unbounded).

    ``is_causal``: query ``i`` attends key ``j`` iff ``j <= i + offset`` with offset = past length,
    or ``nonpad_kv_seqlen[b] - Sq`` when that input is given, else 0 (bottom-right alignment).
    GQA/MQA: each KV head serves ``Hq / Hkv`` consecutive query heads. A query row whose additive
    bias is -inf everywhere yields zeros (not NaN), in Y and in mode-3 ``qk_matmul_output``.
    ``softmax_precision`` (ONNX element type) sets the softmax dtype.

    Outputs: Y (Q's rank and dtype), present_key ``[B, Hkv, T, D]``, present_value, qk_matmul_output
    ``[B, Hq, Sq, T]`` per ``qk_matmul_output_mode`` (0: QK^T scaled, 1: after softcap, 2: plus bias,
    3: after softmax). ``n_outputs`` is the number of node outputs (trailing absent ones dropped).
    """

    def __init__(self, is_causal: bool, q_num_heads: int | None, kv_num_heads: int | None, scale: float | None,
                 softcap: float, softmax_dtype: torch.dtype | None, qk_mode: int, n_outputs: int,
                 left_window: int = -1, right_window: int = -1):
        super().__init__()
        self.left_window, self.right_window = left_window, right_window
        self.is_causal, self.q_num_heads, self.kv_num_heads = is_causal, q_num_heads, kv_num_heads
        self.scale, self.softcap, self.softmax_dtype = scale, softcap, softmax_dtype
        self.qk_mode, self.n_outputs = qk_mode, n_outputs

    def _heads(self, t: torch.Tensor, n: int | None) -> torch.Tensor:
        b, s, hidden = t.shape
        return t.reshape(b, s, n, hidden // n).transpose(1, 2)

    def forward(self, q, k, v, attn_mask=None, past_key=None, past_value=None, nonpad_kv_seqlen=None):  # noqa: D102
        three_d = q.dim() == 3
        if three_d:
            q, k, v = self._heads(q, self.q_num_heads), self._heads(k, self.kv_num_heads), self._heads(v, self.kv_num_heads)
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(q.shape[-1])
        s = torch.tensor(math.sqrt(scale), dtype=torch.float64).to(q.dtype)
        if past_key is not None:
            k = torch.cat([past_key, k], dim=2)
        if past_value is not None:
            v = torch.cat([past_value, v], dim=2)
        present_k, present_v = k, v
        sq, total = q.shape[2], k.shape[2]
        dtype, dev = q.dtype, q.device
        neg_inf = torch.tensor(float("-inf"), dtype=dtype, device=dev)
        zero = torch.zeros((), dtype=dtype, device=dev)

        bias = torch.zeros((sq, total), dtype=dtype, device=dev)
        if attn_mask is not None:
            pad = total - attn_mask.shape[-1]
            if attn_mask.dtype == torch.bool:
                if pad > 0:
                    attn_mask = torch.nn.functional.pad(attn_mask, (0, pad), value=False)
                attn_mask = torch.where(attn_mask, zero, neg_inf)
            elif pad > 0:
                attn_mask = torch.nn.functional.pad(attn_mask, (0, pad), value=float("-inf"))
            bias = bias + attn_mask
        if self.is_causal or self.left_window >= 0 or self.right_window >= 0:
            i = torch.arange(sq, device=dev).reshape(sq, 1)
            j = torch.arange(total, device=dev).reshape(1, total)
            if past_key is None and nonpad_kv_seqlen is not None:
                offset = (nonpad_kv_seqlen.reshape(-1, 1, 1).to(torch.int64) - sq)
                diff = (i + offset - j).unsqueeze(1)  # [B, 1, Sq, T]
            else:
                diff = i + (past_key.shape[2] if past_key is not None else 0) - j
            if self.is_causal:
                bias = bias + torch.where(diff >= 0, zero, neg_inf)
            if self.left_window >= 0 or self.right_window >= 0:
                ok = torch.ones_like(diff, dtype=torch.bool)
                if self.left_window >= 0:
                    ok = ok & (diff <= self.left_window)
                if self.right_window >= 0:
                    ok = ok & (-diff <= self.right_window)
                bias = bias + torch.where(ok, zero, neg_inf)
        if nonpad_kv_seqlen is not None:
            keep = torch.arange(total, device=dev).reshape(1, total) < nonpad_kv_seqlen.reshape(-1, 1).to(torch.int64)
            bias = bias + torch.where(keep, zero, neg_inf).reshape(-1, 1, 1, total)

        hq, hkv = q.shape[1], k.shape[1]
        if hq != hkv:
            if hq % hkv:
                raise ValueError(f"Attention: q_num_heads={hq} is not a multiple of kv_num_heads={hkv}")
            k = k.repeat_interleave(hq // hkv, dim=1)
            v = v.repeat_interleave(hq // hkv, dim=1)
        qk = torch.matmul(q * s, (k * s).transpose(-1, -2))
        qk_out = qk
        if self.softcap > 0:
            qk = torch.tanh(qk / self.softcap) * self.softcap
            if self.qk_mode == 1:
                qk_out = qk
        scores = qk + bias
        if self.qk_mode == 2:
            qk_out = scores
        if self.softmax_dtype is not None:
            scores = scores.to(self.softmax_dtype)
        row_max = scores.amax(dim=-1, keepdim=True)
        safe_max = torch.where(torch.isneginf(row_max), torch.zeros_like(row_max), row_max)
        e = torch.exp(scores - safe_max)
        den = e.sum(dim=-1, keepdim=True)
        probs = e / torch.where(den == 0, torch.ones_like(den), den)
        dead = torch.isneginf(bias.amax(dim=-1, keepdim=True))
        probs = torch.where(dead, torch.zeros_like(probs), probs)
        if self.qk_mode == 3:
            qk_out = probs
        y = torch.matmul(probs.to(dtype), v)
        if three_d:
            y = y.transpose(1, 2).reshape(y.shape[0], y.shape[2], -1)
        if self.n_outputs == 1:
            return y
        qk_out = qk_out.to(dtype)
        return (y, present_k, present_v, qk_out)[: max(self.n_outputs, 1)]


def _attention(node: OnnxNode, graph: OnnxGraph):
    sp = attr(node, "softmax_precision")
    if sp is not None and sp not in _PRECISION:
        raise ConversionNotSupported(f"Attention node {node.name!r}: softmax_precision={sp} "
                                     f"(valid: 1 float, 10 float16, 11 double, 16 bfloat16)")
    mode = attr(node, "qk_matmul_output_mode", 0)
    if mode not in (0, 1, 2, 3):
        raise ConversionNotSupported(f"Attention node {node.name!r}: qk_matmul_output_mode={mode} (valid: 0-3)")
    module = OnnxAttention(bool(attr(node, "is_causal", 0)), attr(node, "q_num_heads"), attr(node, "kv_num_heads"),
                           attr(node, "scale"), float(attr(node, "softcap", 0.0)),
                           _PRECISION.get(sp) if sp is not None else None, mode, len(node.output_values),
                           attr(node, "left_window_size", -1), attr(node, "right_window_size", -1))
    return result(module, node)


register_versions("Attention", 23, _attention)


class OnnxRotaryEmbedding(nn.Module, OnnxToTorchModule):
    """ONNX RotaryEmbedding-23 (RoPE, arXiv:2104.09864).

    X: ``[B, H, S, D]`` or ``[B, S, H*D]`` (``num_heads`` required); cos_cache/sin_cache: ``[P, R/2]``
    indexed by ``position_ids`` ``[B, S]``, or ``[B, S, R/2]`` without position_ids; R =
    ``rotary_embedding_dim`` (0: D). The first R features rotate, pairs being halves (default) or
    even/odd features (``interleaved``): ``(x1 cos - x2 sin, x1 sin + x2 cos)``; the rest pass through.
    Y: X's shape and dtype.
    """

    def __init__(self, num_heads: int, rotary_dim: int, interleaved: bool):
        super().__init__()
        self.num_heads, self.rotary_dim, self.interleaved = num_heads, rotary_dim, interleaved

    def forward(self, x, cos_cache, sin_cache, position_ids=None):  # noqa: D102
        shape = x.shape
        if x.dim() == 4:
            t = x.transpose(1, 2)  # [B, S, H, D]
        else:
            t = x.reshape(shape[0], shape[1], self.num_heads, shape[2] // self.num_heads)
        d = t.shape[-1]
        r = self.rotary_dim or d
        if position_ids is not None:
            cos_cache, sin_cache = cos_cache[position_ids.to(torch.int64)], sin_cache[position_ids.to(torch.int64)]
        cos, sin = cos_cache.unsqueeze(2), sin_cache.unsqueeze(2)  # [B, S, 1, R/2]
        rot, rest = t[..., :r], t[..., r:]
        if self.interleaved:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
        else:
            x1, x2 = rot[..., : r // 2], rot[..., r // 2:]
        real = cos * x1 - sin * x2
        imag = sin * x1 + cos * x2
        if self.interleaved:
            rot = torch.stack([real, imag], dim=-1).reshape(rot.shape)
        else:
            rot = torch.cat([real, imag], dim=-1)
        out = torch.cat([rot, rest], dim=-1)
        return out.transpose(1, 2) if x.dim() == 4 else out.reshape(shape)


def _rotary(node: OnnxNode, graph: OnnxGraph):
    return result(OnnxRotaryEmbedding(attr(node, "num_heads", 0) or 0, attr(node, "rotary_embedding_dim", 0),
                                      bool(attr(node, "interleaved", 0))), node)


register_versions("RotaryEmbedding", 23, _rotary)


class OnnxLinearAttention(nn.Module, OnnxToTorchModule):
    """ONNX LinearAttention-27, run as its sequential recurrence in float32 (the spec's definition).

    query ``[B, T, Hq*dk]``, key ``[B, T, Hkv*dk]``, value ``[B, T, Hkv*dv]``, optional past_state
    ``[B, Hkv, dk, dv]`` (default zeros), decay (log-space, ``[B, T, Hkv]`` or ``[B, T, Hkv*dk]``),
    beta (``[B, T, Hkv]`` or ``[B, T, 1]``). Per step t: gated rules decay the state by ``exp(g_t)``
    (per key dim or per head); delta rules replace ``v_t`` by ``beta_t (v_t - S^T k_t)``; then
    ``S += k_t v_t^T`` and ``o_t = scale q_t^T S`` (query head h reads KV head ``h // (Hq/Hkv)``;
    scale 0 means ``1/sqrt(dk)``). Outputs ``[B, T, Hq*dv]`` (query dtype) and present_state (past
    state's dtype, else query's).
    """

    def __init__(self, q_heads: int, kv_heads: int, scale: float, rule: str, n_outputs: int):
        super().__init__()
        self.q_heads, self.kv_heads, self.scale, self.rule, self.n_outputs = q_heads, kv_heads, scale, rule, n_outputs

    def forward(self, query, key, value, past_state=None, decay=None, beta=None):  # noqa: D102
        b, t, _ = query.shape
        hq, hkv = self.q_heads, self.kv_heads
        dk, dv = query.shape[-1] // hq, value.shape[-1] // hkv
        q = query.reshape(b, t, hq, dk).transpose(1, 2).float()
        k = key.reshape(b, t, hkv, dk).transpose(1, 2).float()
        v = value.reshape(b, t, hkv, dv).transpose(1, 2).float()
        g = None
        if decay is not None:
            last = decay.shape[-1]
            g = decay.reshape(b, t, hkv, last // hkv).transpose(1, 2).float()  # [B, Hkv, T, 1|dk]
        bt = beta.reshape(b, t, beta.shape[-1], 1).transpose(1, 2).float() if beta is not None else None
        state = past_state.float().clone() if past_state is not None else torch.zeros(b, hkv, dk, dv,
                                                                                     device=query.device)
        scale = self.scale if self.scale else 1.0 / math.sqrt(dk)
        group = hq // hkv
        outs = []
        for i in range(t):
            if g is not None and self.rule in ("gated", "gated_delta"):
                state = state * torch.exp(g[:, :, i, :]).unsqueeze(-1)
            vt = v[:, :, i, :]
            kt = k[:, :, i, :]
            if bt is not None and self.rule in ("delta", "gated_delta"):
                retrieved = torch.einsum("bhdm,bhd->bhm", state, kt)
                vt = bt[:, :, i, :] * (vt - retrieved)
            state = state + kt.unsqueeze(-1) * vt.unsqueeze(-2)
            read = state.repeat_interleave(group, dim=1) if group > 1 else state
            outs.append(scale * torch.einsum("bhd,bhdm->bhm", q[:, :, i, :], read))
        out = torch.stack(outs, dim=2).transpose(1, 2).reshape(b, t, hq * dv).to(query.dtype)
        present = state.to(past_state.dtype if past_state is not None else query.dtype)
        return out if self.n_outputs == 1 else (out, present)


def _linear_attention(node: OnnxNode, graph: OnnxGraph):
    rule = attr(node, "update_rule", "gated_delta")
    if rule not in ("linear", "gated", "delta", "gated_delta"):
        raise ConversionNotSupported(f"LinearAttention node {node.name!r}: update_rule={rule!r} "
                                     f"(valid: linear, gated, delta, gated_delta)")
    hq, hkv = attr(node, "q_num_heads"), attr(node, "kv_num_heads")
    if not hq or not hkv or hq % hkv:
        raise ConversionNotSupported(f"LinearAttention node {node.name!r}: q_num_heads={hq}, kv_num_heads={hkv} "
                                     f"(both required, q a multiple of kv)")
    return result(OnnxLinearAttention(hq, hkv, float(attr(node, "scale", 0.0)), rule, len(node.output_values)), node)


register_versions("LinearAttention", 27, _linear_attention)
