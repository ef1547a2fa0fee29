"""Converters for the recurrent ops: ONNX ``LSTM``, ``GRU``, ``RNN`` and ``com.microsoft::DynamicQuantizeLSTM``.

Semantics follow the ONNX operator spec (LSTM-7/14/22, GRU-7/14/22, RNN-7/14/22; ``layout`` from 14),
with every attribute: ``direction`` (forward / reverse / bidirectional), ``layout`` 0 / 1,
``activations`` / ``activation_alpha`` / ``activation_beta`` (all eleven spec activations),
``clip``, ``input_forget`` (LSTM), ``linear_before_reset`` (GRU), ``hidden_size`` (inferred from R when
absent), and every input and output (``sequence_lens``, ``initial_h``, ``initial_c``, peepholes ``P``;
``Y``, ``Y_h``, ``Y_c``). Where the spec leaves room, ONNX Runtime's CPU kernels (``deep_cpu_lstm``,
``deep_cpu_gru``, ``rnn``, ``rnn_helpers``) decide, since they are what lifted models are checked
against:

* ``clip`` bounds the pre-activation of every gate (bias and peephole terms included), not the cell
  state fed to ``h``.
* ``activation_alpha`` / ``activation_beta`` are consumed in activation order, each only by the
  activations that take that parameter (Affine, LeakyRelu, ThresholdedRelu, ScaledTanh, HardSigmoid,
  Elu); names are case-insensitive. Missing values take the default of the ONNX operator of the same
  name (Affine 1/0, LeakyRelu 0.01, ThresholdedRelu 1.0, ScaledTanh 1/1, HardSigmoid 0.2/0.5, Elu 1.0;
  ONNX Runtime uses 0 for Affine/ScaledTanh/ThresholdedRelu instead, so give them explicitly).
  ThresholdedRelu is ``x if x > alpha else 0`` (the ThresholdedRelu operator's definition).
* ``sequence_lens``: a batch entry of length ``L`` is processed over its first ``L`` steps only (the
  reverse direction runs from step ``L - 1`` down to 0); ``Y`` is zero beyond ``L``; ``Y_h`` / ``Y_c``
  hold the state after step ``L`` (zeros for ``L == 0``, as ONNX Runtime does).
* ``input_forget=1``: the forget gate is ``1 - i``.
* A bidirectional node given one direction's activations (3 for LSTM) uses them for both directions.

Weights (W, R, B, P) that are initializers become ``nn.Parameter`` s of the module in their ONNX layout
(so gradients reach them and quantizers can sit on them; the lifter maps them through the module's
``onnx_initializer_attrs``); other initializers become buffers; non-constant inputs are module
arguments.

Execution: torch's fused ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` kernels (through ``torch.func.functional_call``
on a meta-device template, with the ONNX weights re-ordered on the fly: differentiable) where they are
exactly the ONNX computation (default activations, no clip, no peepholes, no ``input_forget``, GRU only
with ``linear_before_reset=1``, and every sequence full length at run time; on CUDA not for float32 while
``torch.backends.cudnn.allow_tf32`` is set, since cuDNN would then compute in TF32); otherwise an
explicit per-step loop.

``DynamicQuantizeLSTM`` (ONNX Runtime contrib op, domain ``com.microsoft``): LSTM whose W
``[num_directions, input_size, 4*hidden]`` and R ``[num_directions, hidden, 4*hidden]`` are int8/uint8
with per-direction (``[num_directions]``) or per-column (``[num_directions, 4*hidden]``) scales and zero
points. As ONNX Runtime's kernel computes it (``rnn_helpers.cc`` quantized ``ComputeGemm``,
``qmath.h`` ``GetQuantizationParameter``): each GEMM's float operand ``A`` (all time steps of X at
once, then H_{t-1} of the whole batch at every step) is quantized to uint8 with
``scale = (max(A, 0) - min(A, 0)) / 255`` (1 when the range is empty),
``zero_point = round_half_even(clamp(-min / scale, 0, 255))``, ``q = clamp(round_half_even(A / scale) +
zero_point, 0, 255)``; the product ``(q - zero_point) @ (W_q - W_zero_point)`` is exact integer
arithmetic, converted to float32 and multiplied by ``scale * W_scale``. ONNX Runtime splits the batch
across threads when ``batch > 4`` (or ``2 <= batch`` and ``hidden <= 256``) with several intra-op
threads, which changes its grouping of H_{t-1}; the emulation matches it for batch 1 or one thread.
"""
from __future__ import annotations

from typing import Callable, Sequence

import onnx
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OnnxMapping, OnnxToTorchModule, OperationConverterResult

from ..errors import DataError, ModelError
from .converters import register_converter

__all__ = ["OnnxRecurrent", "ACTIVATIONS", "parse_activations", "dynamic_quantize_uint8"]


# ============================================================================ activations
def _thresholded_relu(x, a, b):
    return torch.where(x > a, x, torch.zeros_like(x))


#: lower-case name -> (function(x, alpha, beta), takes alpha, takes beta, default alpha, default beta).
#: Definitions from the ONNX RNN/GRU/LSTM spec's activation list; defaults from the ONNX operators of
#: the same name (Affine-1, LeakyRelu, ThresholdedRelu, ScaledTanh-1, HardSigmoid, Elu).
ACTIVATIONS: dict[str, tuple[Callable, bool, bool, float, float]] = {
    "relu": (lambda x, a, b: torch.relu(x), False, False, 0.0, 0.0),
    "tanh": (lambda x, a, b: torch.tanh(x), False, False, 0.0, 0.0),
    "sigmoid": (lambda x, a, b: torch.sigmoid(x), False, False, 0.0, 0.0),
    "affine": (lambda x, a, b: a * x + b, True, True, 1.0, 0.0),
    "leakyrelu": (lambda x, a, b: torch.where(x >= 0, x, a * x), True, False, 0.01, 0.0),
    "thresholdedrelu": (_thresholded_relu, True, False, 1.0, 0.0),
    "scaledtanh": (lambda x, a, b: a * torch.tanh(b * x), True, True, 1.0, 1.0),
    "hardsigmoid": (lambda x, a, b: torch.clamp(a * x + b, 0.0, 1.0), True, True, 0.2, 0.5),
    "elu": (lambda x, a, b: torch.where(x >= 0, x, a * torch.expm1(x)), True, False, 1.0, 0.0),
    "softsign": (lambda x, a, b: x / (1 + torch.abs(x)), False, False, 0.0, 0.0),
    "softplus": (lambda x, a, b: F.softplus(x), False, False, 0.0, 0.0),
}
_SPEC_NAMES = ("Relu", "Tanh", "Sigmoid", "Affine", "LeakyRelu", "ThresholdedRelu", "ScaledTanh", "HardSigmoid",
               "Elu", "Softsign", "Softplus")

#: per op: (gates, default activations per direction, number of activations per direction)
_KINDS = {
    "LSTM": (4, ("Sigmoid", "Tanh", "Tanh")),
    "GRU": (3, ("Sigmoid", "Tanh")),
    "RNN": (1, ("Tanh",)),
}


def parse_activations(names: Sequence[str] | None, alphas: Sequence[float] | None, betas: Sequence[float] | None,
                      kind: str, num_directions: int, node_name: str) -> list[tuple[str, float, float]]:
    """Resolve ``activations`` / ``activation_alpha`` / ``activation_beta`` into one
    ``(lower-case name, alpha, beta)`` per activation slot (``num_directions * per_direction``).

    Alphas and betas are consumed in order, each only by an activation that takes it (ONNX Runtime's
    ``ActivationFuncs``); missing ones take the ONNX operator defaults (see :data:`ACTIVATIONS`).

    Raises:
        ModelError: unknown activation name, or a count that is neither one direction's nor all
            directions' worth (names the node and the valid names).
    """
    per_dir = len(_KINDS[kind][1])
    names = list(names) if names else list(_KINDS[kind][1]) * num_directions
    if num_directions == 2 and len(names) == per_dir:
        names = names * 2
    if len(names) != per_dir * num_directions:
        raise ModelError(f"{kind} node {node_name!r}: {len(names)} activations given; expected {per_dir} per direction "
                         f"({per_dir * num_directions} for {num_directions} direction(s))")
    alphas, betas = list(alphas or []), list(betas or [])
    out = []
    for name in names:
        key = name.lower() if isinstance(name, str) else str(name)
        if key not in ACTIVATIONS:
            raise ModelError(f"{kind} node {node_name!r}: unknown activation {name!r}; valid: {', '.join(_SPEC_NAMES)}")
        _, takes_a, takes_b, da, db = ACTIVATIONS[key]
        a = float(alphas.pop(0)) if takes_a and alphas else da
        b = float(betas.pop(0)) if takes_b and betas else db
        out.append((key, a, b))
    return out


def _act(entry: tuple[str, float, float], x: torch.Tensor) -> torch.Tensor:
    name, a, b = entry
    return ACTIVATIONS[name][0](x, a, b)


# ============================================================================ dynamic uint8 quantization
def dynamic_quantize_uint8(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ONNX Runtime's dynamic uint8 quantization of a float tensor (``qmath.h`` ``GetQuantizationParameter``
    + ``MlasQuantizeLinear``), in float32.

    Args:
        a: float tensor, any shape.

    Returns:
        ``(q, scale, zero_point)``: ``q`` float32 tensor of integers in [0, 255] shaped like ``a``;
        ``scale`` and ``zero_point`` float32 scalars. ``scale = (max(a, 0) - min(a, 0)) / 255`` (1.0 when
        that range is 0), ``zero_point = round_half_even(clamp(0 - min / scale, 0, 255))``,
        ``q = clamp(round_half_even(a / scale) + zero_point, 0, 255)``.
    """
    a32 = a.to(torch.float32)
    zero = a32.new_zeros(())
    mn = torch.minimum(a32.min(), zero) if a32.numel() else zero
    mx = torch.maximum(a32.max(), zero) if a32.numel() else zero
    scale = torch.where(mx == mn, torch.ones_like(mx), (mx - mn) / 255.0)
    zp = torch.round(torch.clamp(0.0 - mn / scale, 0.0, 255.0))
    q = torch.clamp(torch.round(a32 / scale) + zp, 0.0, 255.0)
    return q, scale, zp


def _integer_weight(w_q: torch.Tensor, w_zp: torch.Tensor) -> torch.Tensor:
    """``W_q - W_zero_point`` as float64 (exact): the integer GEMM operand."""
    return w_q.to(torch.float64) - w_zp.to(torch.float64)


def _quantized_gemm(a: torch.Tensor, w_int: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """``A @ W`` as ONNX Runtime's quantized RNN GEMM computes it (see module docstring).

    a: float [M, K]; w_int: float64 [K, N], ``W_q - W_zero_point`` (:func:`_integer_weight`); w_scale:
    float32 [] or [N]. Returns float32 [M, N]. Integer products are summed in float64 (exact below
    2**53), then converted to float32 as the int32 accumulator is, then scaled.
    """
    q, scale, zp = dynamic_quantize_uint8(a)
    acc = (q.to(torch.float64) - zp.to(torch.float64)) @ w_int
    mult = (scale * w_scale.to(torch.float32)).to(torch.float32)
    return acc.to(torch.float32) * mult


# ============================================================================ module
_INPUT_NAMES = {
    "LSTM": ("X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P"),
    "GRU": ("X", "W", "R", "B", "sequence_lens", "initial_h"),
    "RNN": ("X", "W", "R", "B", "sequence_lens", "initial_h"),
    "DynamicQuantizeLSTM": ("X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P", "W_scale",
                            "W_zero_point", "R_scale", "R_zero_point"),
}
_TRAINABLE = frozenset({"W", "R", "B", "P"})

# gate order permutations ONNX -> torch: LSTM iofc -> ifco(=i,f,g,o); GRU zrh -> rzn; RNN: single
_TORCH_ORDER = {"LSTM": (0, 2, 3, 1), "GRU": (1, 0, 2), "RNN": (0,)}


class OnnxRecurrent(nn.Module, OnnxToTorchModule):
    """One ONNX LSTM / GRU / RNN (or ``com.microsoft::DynamicQuantizeLSTM``) node.

    Call with the node's non-constant inputs, in ONNX input order (the constant ones live in the
    module: float W/R/B/P as ``nn.Parameter`` in ONNX layout, the rest as buffers).

    Tensors (layout 0 / layout 1; ``D`` = num_directions, ``G`` = gates: 4 LSTM, 3 GRU, 1 RNN):
        X: [seq, batch, input] / [batch, seq, input], float32/float64 (float16 computed in float32).
        W: [D, G*hidden, input]; R: [D, G*hidden, hidden]; B: [D, 2*G*hidden] (Wb then Rb); P: [D, 3*hidden]
            (DynamicQuantizeLSTM: W [D, input, 4*hidden] and R [D, hidden, 4*hidden], int8/uint8, with
            scales / zero points [D] or [D, 4*hidden]).
        sequence_lens: int32/int64 [batch], values in [0, seq].
        initial_h / initial_c: [D, batch, hidden] / [batch, D, hidden].
    Returns the node's outputs (a tensor when the node has one output, else a tuple in ONNX order):
        Y: [seq, D, batch, hidden] / [batch, seq, D, hidden]; Y_h, Y_c: [D, batch, hidden] / [batch, D, hidden].

    Raises (at run time):
        DataError: inputs whose shapes do not fit the weights, or sequence lengths out of range (names the
            node and the input).
    """

    def __init__(self, kind: str, node_name: str, hidden_size: int | None, direction: str, layout: int,
                 activations: list[tuple[str, float, float]], clip: float | None, input_forget: bool,
                 linear_before_reset: bool, n_outputs: int, arg_slots: Sequence[int],
                 constants: dict[int, torch.Tensor]):
        super().__init__()
        self.kind = kind
        self.quantized = kind == "DynamicQuantizeLSTM"
        self.cell = "LSTM" if self.quantized else kind
        self.node_name = node_name
        self.hidden_size = hidden_size
        self.direction = direction
        self.num_directions = 2 if direction == "bidirectional" else 1
        self.layout = int(layout)
        self.activations = [tuple(a) for a in activations]
        self.clip = None if clip is None else float(clip)
        self.input_forget = bool(input_forget)
        self.linear_before_reset = bool(linear_before_reset)
        self.n_outputs = int(n_outputs)
        self.arg_slots = tuple(int(s) for s in arg_slots)
        names = _INPUT_NAMES[kind]
        self.const_slots: dict[int, str] = {}
        for slot, value in sorted(constants.items()):
            attr = names[slot]
            if attr in _TRAINABLE and value.is_floating_point():
                self.register_parameter(attr, nn.Parameter(value.clone()))
            else:
                self.register_buffer(attr, value.clone())
            self.const_slots[slot] = attr
        # torch's fused kernels compute exactly this node when it uses the default activations (RNN: all
        # Tanh or all Relu), no clip, no peepholes, no input_forget and (GRU) linear_before_reset=1
        names_used = [a[0] for a in self.activations]
        defaults = [n.lower() for n in _KINDS[self.cell][1]] * self.num_directions
        self._rnn_nonlinearity = "relu" if self.cell == "RNN" and set(names_used) == {"relu"} else "tanh"
        acts_ok = names_used == defaults or self._rnn_nonlinearity == "relu"
        self._fusable = (not self.quantized and self.clip is None and not self.input_forget
                         and 7 not in self._present_slots() and acts_ok
                         and (self.cell != "GRU" or self.linear_before_reset))
        self._templates: tuple = ()  # meta-device torch modules for the fused path, built lazily

    def _present_slots(self) -> set[int]:
        return set(self.arg_slots) | set(self.const_slots)

    def extra_repr(self) -> str:  # noqa: D102
        return (f"{self.kind}, hidden_size={self.hidden_size}, direction={self.direction}, layout={self.layout}, "
                f"clip={self.clip}, activations={[a[0] for a in self.activations]}")

    # ------------------------------------------------------------------ helpers
    def _inputs(self, args) -> list:
        n = len(_INPUT_NAMES[self.kind])
        vals: list = [None] * n
        if len(args) != len(self.arg_slots):
            raise DataError(f"{self.kind} node {self.node_name!r}: expected {len(self.arg_slots)} inputs, got {len(args)}")
        for slot, a in zip(self.arg_slots, args):
            vals[slot] = a
        for slot, attr in self.const_slots.items():
            vals[slot] = getattr(self, attr)
        return vals

    def _err(self, what: str) -> DataError:
        return DataError(f"{self.kind} node {self.node_name!r}: {what}")

    def _check(self, name: str, t: torch.Tensor | None, shape: tuple) -> None:
        if t is not None and tuple(t.shape) != tuple(shape):
            raise self._err(f"input {name} has shape {tuple(t.shape)}, expected {tuple(shape)}")

    # ------------------------------------------------------------------ forward
    def forward(self, *args):  # noqa: D102  (documented on the class)
        vals = self._inputs(args)
        x, W, R, B, lens = vals[0], vals[1], vals[2], vals[3], vals[4]
        h0 = vals[5]
        c0 = vals[6] if self.cell == "LSTM" else None
        P = vals[7] if self.cell == "LSTM" else None
        if x.dim() != 3:
            raise self._err(f"input X must have rank 3, got shape {tuple(x.shape)}")
        out_dtype = x.dtype
        compute = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        if self.layout:
            x = x.transpose(0, 1)
            h0 = h0.transpose(0, 1) if h0 is not None else None
            c0 = c0.transpose(0, 1) if c0 is not None else None
        x = x.to(compute)
        T, N, I = x.shape
        D = self.num_directions
        G = 4 if self.cell == "LSTM" else 3 if self.cell == "GRU" else 1
        H = int(R.shape[1] if self.quantized else R.shape[-1])
        if self.hidden_size is not None and H != self.hidden_size:
            raise self._err(f"R has hidden size {H} but the hidden_size attribute is {self.hidden_size}")
        if self.quantized:
            self._check("W", W, (D, I, G * H))
            self._check("R", R, (D, H, G * H))
        else:
            self._check("W", W, (D, G * H, I))
            self._check("R", R, (D, G * H, H))
            W, R = W.to(compute), R.to(compute)
        self._check("B", B, (D, 2 * G * H))
        self._check("initial_h", h0, (D, N, H))
        self._check("initial_c", c0, (D, N, H))
        self._check("P", P, (D, 3 * H))
        B = B.to(compute) if B is not None else None
        P = P.to(compute) if P is not None else None
        h0 = h0.to(compute) if h0 is not None else x.new_zeros((D, N, H))
        if self.cell == "LSTM":
            c0 = c0.to(compute) if c0 is not None else x.new_zeros((D, N, H))
        if lens is not None:
            if tuple(lens.shape) != (N,):
                raise self._err(f"input sequence_lens has shape {tuple(lens.shape)}, expected ({N},)")
            lens = lens.to(device=x.device, dtype=torch.int64)
            if N and (bool((lens < 0).any()) or bool((lens > T).any())):
                raise self._err(f"sequence_lens {lens.tolist()} out of range [0, {T}]")
            if N and bool((lens == T).all()):
                lens = None  # every sequence full length: nothing to mask
        # cuDNN would run float32 RNNs in TF32 when torch allows it (its default): keep float32 exact there
        tf32 = x.device.type == "cuda" and x.dtype == torch.float32 and torch.backends.cudnn.allow_tf32
        if self._fusable and lens is None and T > 0 and not tf32:
            y, hs, cs = self._fused(x, W, R, B, h0, c0)
        else:
            y, hs, cs = self._loop(x, W, R, B, P, h0, c0, lens, vals)
        outs = [y, hs, cs][: self.n_outputs]
        if self.layout:
            outs = [outs[0].permute(2, 0, 1, 3)] + [o.transpose(0, 1) for o in outs[1:]]
        outs = [o.to(out_dtype) if o is not None else None for o in outs]
        return outs[0] if self.n_outputs == 1 else tuple(outs)

    # ------------------------------------------------------------------ fused path
    def _template(self, I: int, H: int):
        key = (I, H)
        for k, t in self._templates:
            if k == key:
                return t
        cls = {"LSTM": nn.LSTM, "GRU": nn.GRU}.get(self.cell)
        if cls is not None:
            t = cls(I, H, bidirectional=self.num_directions == 2, device="meta")
        else:
            t = nn.RNN(I, H, nonlinearity=self._rnn_nonlinearity, bidirectional=self.num_directions == 2, device="meta")
        self._templates = self._templates + ((key, t),)
        return t

    def _fused(self, x, W, R, B, h0, c0):
        T, N, I = x.shape
        D, H = self.num_directions, h0.shape[-1]
        G = W.shape[1] // H
        order = _TORCH_ORDER[self.cell]
        idx = torch.cat([torch.arange(g * H, (g + 1) * H, device=W.device) for g in order])
        params = {}
        for d in range(D):
            sfx = "_reverse" if d == 1 else ""
            params[f"weight_ih_l0{sfx}"] = W[d].index_select(0, idx)
            params[f"weight_hh_l0{sfx}"] = R[d].index_select(0, idx)
            if B is not None:
                params[f"bias_ih_l0{sfx}"] = B[d, : G * H].index_select(0, idx)
                params[f"bias_hh_l0{sfx}"] = B[d, G * H:].index_select(0, idx)
            else:
                params[f"bias_ih_l0{sfx}"] = x.new_zeros(G * H)
                params[f"bias_hh_l0{sfx}"] = x.new_zeros(G * H)
        template = self._template(I, H)
        reverse_only = self.direction == "reverse"
        xin = x.flip(0) if reverse_only else x
        hx = (h0.contiguous(), c0.contiguous()) if self.cell == "LSTM" else h0.contiguous()
        y, hn = functional_call(template, params, (xin, hx))
        if reverse_only:
            y = y.flip(0)
        y = y.reshape(T, N, D, H).permute(0, 2, 1, 3)
        if self.cell == "LSTM":
            return y, hn[0], hn[1]
        return y, hn, None

    # ------------------------------------------------------------------ explicit loop
    def _loop(self, x, W, R, B, P, h0, c0, lens, vals):
        T, N, I = x.shape
        D, H = self.num_directions, h0.shape[-1]
        G = {"LSTM": 4, "GRU": 3, "RNN": 1}[self.cell]
        per_dir = len(_KINDS[self.cell][1])
        steps = T if lens is None else int(lens.max().item()) if N else 0
        ys, hs, cs = [], [], []
        t_idx = torch.arange(T, device=x.device)
        for d in range(D):
            reverse = self.direction == "reverse" or d == 1
            acts = self.activations[d * per_dir:(d + 1) * per_dir]
            if reverse:
                if lens is None:
                    perm = (T - 1 - t_idx)[:, None].expand(T, N)
                else:  # reverse each sequence within its own length; the padding stays in place
                    perm = torch.where(t_idx[:, None] < lens[None, :], lens[None, :] - 1 - t_idx[:, None],
                                       t_idx[:, None])
                xd = torch.gather(x, 0, perm[:, :, None].expand(T, N, I))
            else:
                perm, xd = None, x
            y_d, h_d, c_d = self._direction(d, xd, W, R, B, P, h0[d], c0[d] if c0 is not None else None, lens,
                                            steps, acts, vals, G)
            if perm is not None:
                y_d = torch.gather(y_d, 0, perm[:, :, None].expand(T, N, H))
            ys.append(y_d)
            hs.append(h_d)
            cs.append(c_d)
        y = torch.stack(ys, 1) if ys else x.new_zeros((T, D, N, H))
        return y, torch.stack(hs, 0), (torch.stack(cs, 0) if self.cell == "LSTM" else None)

    def _input_projection(self, d, xd, W, vals, steps):
        """X_t @ W^T for all steps: [steps, N, G*H]."""
        T, N, I = xd.shape
        if self.quantized:
            w_scale, w_zp = self._qparams(vals[8], vals[9], d)
            flat = xd[:steps].reshape(steps * N, I)
            return _quantized_gemm(flat, _integer_weight(W[d], w_zp), w_scale).reshape(steps, N, -1).to(xd.dtype)
        return torch.matmul(xd[:steps], W[d].transpose(0, 1))

    def _recurrent_projection(self, d, h, R, vals, rows: slice | None = None):
        """H_{t-1} @ R^T: [N, G*H] (``rows`` selects a column block of R for GRU's h gate). For
        DynamicQuantizeLSTM, ``R`` is the ``(integer weight, scale)`` pair prepared per direction."""
        if self.quantized:
            r_int, r_scale = R
            return _quantized_gemm(h, r_int, r_scale).to(h.dtype)
        Rd = R[d] if rows is None else R[d][rows]
        return torch.matmul(h, Rd.transpose(0, 1))

    def _qparams(self, scale, zp, d):
        s = scale[d].to(torch.float32)
        z = zp[d]
        if z.dim() == 1:  # per-column zero points: ONNX Runtime requires them constant (or 0 for int8)
            if bool((z != z[0]).any()):
                raise self._err("per-column zero points must all be equal (ONNX Runtime's DynamicQuantizeLSTM)")
            z = z[0]
        return s, z

    def _clip(self, v):
        return v if self.clip is None else torch.clamp(v, -self.clip, self.clip)

    def _direction(self, d, xd, W, R, B, P, h, c, lens, steps, acts, vals, G):
        T, N, _ = xd.shape
        H = h.shape[-1]
        gx = self._input_projection(d, xd, W, vals, steps)  # [steps, N, G*H]
        if self.quantized:  # the integer recurrent weight once per direction, not per step
            r_scale, r_zp = self._qparams(vals[10], vals[11], d)
            R = (_integer_weight(R[d], r_zp), r_scale)
        if B is not None:
            wb, rb = B[d, : G * H], B[d, G * H:]
        else:
            wb = rb = None
        if self.cell in ("LSTM", "RNN") and B is not None:
            bias = wb + rb
        else:
            bias = None
        ys = []
        active_prev = None
        for t in range(steps):
            active = None if lens is None else (t < lens)[:, None]
            h_in = h
            if self.quantized and active_prev is not None:
                # ONNX Runtime reads H_{t-1} from Y, where rows past their length were zeroed
                h_in = torch.where(active_prev, h, torch.zeros_like(h))
            if self.cell == "LSTM":
                g = gx[t] + self._recurrent_projection(d, h_in, R, vals)
                gi, go, gf, gc = g.split(H, dim=-1)
                if P is not None:
                    pi, po, pf = P[d].split(H)
                    gi = gi + pi * c
                    if not self.input_forget:
                        gf = gf + pf * c
                if bias is not None:
                    bi, bo, bf, bc = bias.split(H)
                    gi, go, gf, gc = gi + bi, go + bo, gf + bf, gc + bc
                i = _act(acts[0], self._clip(gi))
                f = (1.0 - i) if self.input_forget else _act(acts[0], self._clip(gf))
                cc = _act(acts[1], self._clip(gc))
                c_new = f * c + i * cc
                if P is not None:
                    go = go + po * c_new
                o = _act(acts[0], self._clip(go))
                h_new = o * _act(acts[2], c_new)
            elif self.cell == "GRU":
                gz, gr, gh = gx[t].split(H, dim=-1)
                rzr = self._recurrent_projection(d, h, R, vals, slice(0, 2 * H))
                hz, hr = rzr.split(H, dim=-1)
                z_pre, r_pre = gz + hz, gr + hr
                if B is not None:
                    wbz, wbr, wbh = wb.split(H)
                    rbz, rbr, rbh = rb.split(H)
                    z_pre = z_pre + (wbz + rbz)
                    r_pre = r_pre + (wbr + rbr)
                z = _act(acts[0], self._clip(z_pre))
                r = _act(acts[0], self._clip(r_pre))
                if self.linear_before_reset:
                    hh = self._recurrent_projection(d, h, R, vals, slice(2 * H, 3 * H))
                    if B is not None:
                        hh = hh + rbh
                    h_pre = gh + r * hh
                else:
                    h_pre = gh + self._recurrent_projection(d, r * h, R, vals, slice(2 * H, 3 * H))
                    if B is not None:
                        h_pre = h_pre + rbh
                if B is not None:
                    h_pre = h_pre + wbh
                hh_t = _act(acts[1], self._clip(h_pre))
                h_new = (1.0 - z) * hh_t + z * h
                c_new = None
            else:  # RNN
                g = gx[t] + self._recurrent_projection(d, h, R, vals)
                if bias is not None:
                    g = g + bias
                h_new = _act(acts[0], self._clip(g))
                c_new = None
            if active is None:
                h = h_new
                c = c_new
                y_t = h_new
            else:
                h = torch.where(active, h_new, h)
                if c_new is not None:
                    c = torch.where(active, c_new, c)
                y_t = torch.where(active, h_new, torch.zeros_like(h_new))
            active_prev = active
            ys.append(y_t)
        y = torch.stack(ys, 0) if ys else xd.new_zeros((0, N, H))
        if steps < T:
            y = torch.cat([y, y.new_zeros((T - steps, N, H))], 0)
        if lens is not None:
            empty = (lens == 0)[:, None]
            h = torch.where(empty, torch.zeros_like(h), h)
            if c is not None:
                c = torch.where(empty, torch.zeros_like(c), c)
        return y, h, c


# ============================================================================ converters
def _node_float(node: OnnxNode, key: str, default=None):
    v = node.attributes.get(key, default)
    return None if v is None else float(v)


def _initializer(graph: OnnxGraph, name: str) -> torch.Tensor | None:
    if name and name in graph.initializers:
        return graph.initializers[name].to_torch()
    return None


def _recurrent_converter(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    kind = node.operation_type
    a = node.attributes
    name = node.name or node.unique_name
    direction = a.get("direction", "forward")
    if direction not in ("forward", "reverse", "bidirectional"):
        raise ModelError(f"{kind} node {name!r}: direction={direction!r}; valid: forward, reverse, bidirectional")
    layout = int(a.get("layout", 0))
    if layout not in (0, 1):
        raise ModelError(f"{kind} node {name!r}: layout={layout}; valid: 0, 1")
    cell = "LSTM" if kind == "DynamicQuantizeLSTM" else kind
    num_directions = 2 if direction == "bidirectional" else 1
    acts = parse_activations(a.get("activations"), a.get("activation_alpha"), a.get("activation_beta"), cell,
                             num_directions, name)
    clip = _node_float(node, "clip")
    if clip is not None and not clip > 0:
        raise ModelError(f"{kind} node {name!r}: clip={clip}; it must be a positive threshold")
    hidden = a.get("hidden_size")
    hidden = int(hidden) if hidden is not None else None
    input_forget = bool(a.get("input_forget", 0))
    lbr = bool(a.get("linear_before_reset", 0))
    if kind == "GRU" and "linear_before_reset" in a and int(a["linear_before_reset"]) not in (0, 1):
        raise ModelError(f"GRU node {name!r}: linear_before_reset={a['linear_before_reset']}; valid: 0, 1")
    if cell == "LSTM" and int(a.get("input_forget", 0)) not in (0, 1):
        raise ModelError(f"{kind} node {name!r}: input_forget={a['input_forget']}; valid: 0, 1")
    names = _INPUT_NAMES[kind]
    inputs = list(node.input_values)
    if len(inputs) > len(names):
        raise ModelError(f"{kind} node {name!r}: {len(inputs)} inputs; at most {len(names)} ({', '.join(names)})")
    for req in (0, 1, 2) + ((8, 9, 10, 11) if kind == "DynamicQuantizeLSTM" else ()):
        if req >= len(inputs) or not inputs[req]:
            raise ModelError(f"{kind} node {name!r}: required input {names[req]} (index {req}) is missing")
    constants: dict[int, torch.Tensor] = {}
    arg_slots: list[int] = []
    arg_names: list[str] = []
    init_attrs: dict[str, tuple[str, ...]] = {}
    for slot, value in enumerate(inputs):
        if not value:
            continue
        t = _initializer(graph, value)
        if t is not None and slot != 0:
            constants[slot] = t
            init_attrs[value] = init_attrs.get(value, ()) + (names[slot],)  # one initializer may fill two slots
        else:
            arg_slots.append(slot)
            arg_names.append(value)
    outputs = list(node.output_values)
    max_out = 3 if cell == "LSTM" else 2
    if len(outputs) > max_out:
        raise ModelError(f"{kind} node {name!r}: {len(outputs)} outputs; at most {max_out}")
    if hidden is None and 2 in constants:
        hidden = int(constants[2].shape[1] if kind == "DynamicQuantizeLSTM" else constants[2].shape[-1])
    module = OnnxRecurrent(kind, name, hidden, direction, layout, acts, clip, input_forget, lbr, max(1, len(outputs)),
                           arg_slots, constants)
    module.onnx_initializer_attrs = dict(init_attrs)
    return OperationConverterResult(torch_module=module,
                                    onnx_mapping=OnnxMapping(inputs=tuple(arg_names), outputs=tuple(outputs)))


def _since_versions(op_type: str, domain: str = "") -> list[int]:
    versions = sorted({s.since_version for s in onnx.defs.get_all_schemas_with_history()
                       if s.name == op_type and s.domain == domain})
    return [v for v in versions if v >= 7]


for _op in ("LSTM", "GRU", "RNN"):
    register_converter(_op, _since_versions(_op))(_recurrent_converter)
register_converter("DynamicQuantizeLSTM", [1], domain="com.microsoft")(_recurrent_converter)
