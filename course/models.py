"""Small models shared by lessons: made on the spot, seeded, never downloaded.

``SmallResNet`` is a ResNet-like image classifier small enough for a 2-core CPU: a stem in an
``nn.Sequential``, residual blocks whose conv/BatchNorm pairs hide inside a wrapper module
(``ConvBN``), convolutions with and without bias, and, on request, a *tap*: a convolution whose
output feeds its BatchNorm and something else as well (a graph pass must leave that pair alone).
"""

from __future__ import annotations

import torch
from torch import nn

from course.devices import pick_device
from course.remote import recipe

__all__ = ["BasicBlock", "ConvBN", "SmallResNet", "small_resnet"]


class ConvBN(nn.Module):
    """A convolution followed by BatchNorm, kept as two sub-modules (``conv``, ``bn``)."""

    def __init__(self, c_in: int, c_out: int, kernel: int = 3, stride: int = 1, bias: bool = False):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=kernel // 2, bias=bias)
        self.bn = nn.BatchNorm2d(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x))


class BasicBlock(nn.Module):
    """Two 3x3 ConvBN with a residual connection (a 1x1 ConvBN when the shape changes)."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1):
        super().__init__()
        self.first = ConvBN(c_in, c_out, 3, stride)
        self.second = ConvBN(c_out, c_out, 3)
        self.shortcut = ConvBN(c_in, c_out, 1, stride) if (stride != 1 or c_in != c_out) else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.second(torch.relu(self.first(x))) + self.shortcut(x))


class TapBlock(nn.Module):
    """A conv whose output is used twice: by its BatchNorm and by a gate beside it."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=True)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return torch.relu(self.bn(y)) * torch.sigmoid(y.mean(dim=(2, 3), keepdim=True))


class SmallResNet(nn.Module):
    def __init__(self, width: int = 16, blocks: tuple[int, ...] = (1, 1, 1), num_classes: int = 10,
                 in_channels: int = 3, tap: bool = False):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, stride=2, padding=1, bias=True),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        layers, c = [], width
        for stage, n in enumerate(blocks):
            c_out = width * 2 ** stage
            for i in range(n):
                layers.append(BasicBlock(c, c_out, stride=2 if (i == 0 and stage > 0) else 1))
                c = c_out
        self.stages = nn.Sequential(*layers)
        self.tap = TapBlock(c) if tap else nn.Identity()
        self.head = nn.Linear(c, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.tap(self.stages(self.stem(x)))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


@recipe
def small_resnet(*, seed: int, width: int = 16, blocks: tuple[int, ...] = (1, 1, 1), tap: bool = False,
                 device=None, dtype: torch.dtype = torch.float32, eval_mode: bool = True,
                 randomize_bn: bool = True, train_bn: str | None = None) -> SmallResNet:
    """A seeded ``SmallResNet``. BatchNorm statistics and affine parameters are randomised
    (``randomize_bn``) so that a fold that forgets one of them cannot pass by luck (fresh BN
    layers hold mean 0, variance 1, weight 1, bias 0). ``train_bn`` names one sub-module left in
    training mode (lesson 2: a BatchNorm that must not be folded)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = SmallResNet(width=width, blocks=blocks, tap=tap)
        if randomize_bn:
            for m in model.modules():
                if isinstance(m, nn.BatchNorm2d):
                    n = m.num_features
                    m.running_mean.copy_(torch.randn(n) * 0.2)
                    m.running_var.copy_(torch.rand(n) * 1.5 + 0.5)
                    with torch.no_grad():
                        m.weight.copy_(torch.rand(n) + 0.5)
                        m.bias.copy_(torch.randn(n) * 0.2)
    model = model.to(pick_device(device), dtype)
    model = model.eval() if eval_mode else model
    if train_bn is not None:
        model.get_submodule(train_bn).train()
    return model


@recipe
def small_resnet_channels(*, seed: int, in_channels: int, width: int = 16, device=None,
                          dtype: torch.dtype = torch.float32, **kwargs) -> SmallResNet:
    """``small_resnet`` for images with ``in_channels`` channels (1: grayscale). Lesson 3 uses
    it because a conv weight of shape ``(width, 1, 3, 3)`` and an input ``(N, 1, H, W)`` are
    exactly the shapes whose memory format is ambiguous. The stem convolution is drawn from
    ``seed + 1``; everything else equals ``small_resnet(seed=seed, ...)``."""
    model = small_resnet(seed=seed, width=width, device="cpu", **kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        stem = nn.Conv2d(in_channels, width, 3, stride=2, padding=1, bias=True)
    model.stem[0] = stem.train(model.training)
    return model.to(pick_device(device), dtype)


__all__ += ["small_resnet_channels"]


#: How ``exported_resnet`` writes out one BatchNorm: (constant, operation), in order.
EXPORTED_BN = (("mean", "sub"), ("inv_std", "mul"), ("weight", "mul"), ("bias", "add"))


@recipe
def exported_resnet(*, seed: int, width: int = 16, blocks: tuple[int, ...] = (1, 1, 1), tap: bool = False,
                    device=None, dtype: torch.dtype = torch.float32) -> torch.fx.GraphModule:
    """``small_resnet(seed=seed, ...)`` as an exporter hands it back (lesson 2, Exercise 6): a
    ``GraphModule`` in which every eval-mode BatchNorm is written out as its arithmetic,
    ``(x - mean) * inv_std * weight + bias``: four elementwise operations, each with a
    per-channel constant of shape ``(C, 1, 1)`` read by a ``get_attr`` node (named
    ``<bn path with _>_<constant>``). The weight's multiply puts the constant first in every
    other BatchNorm (``weight * x``), as exporters do not promise an order. Equal to the model
    (float64: to rounding)."""
    import operator

    from torch import fx

    ops = {"sub": operator.sub, "mul": operator.mul, "add": operator.add}
    model = small_resnet(seed=seed, width=width, blocks=blocks, tap=tap, device="cpu", dtype=torch.float64)
    gm = fx.symbolic_trace(model)
    graph = gm.graph
    bns = [n for n in graph.nodes if n.op == "call_module" and isinstance(gm.get_submodule(n.target), nn.BatchNorm2d)]
    for i, node in enumerate(bns):
        bn = gm.get_submodule(node.target)
        constants = {"mean": bn.running_mean, "inv_std": torch.rsqrt(bn.running_var + bn.eps),
                     "weight": bn.weight.detach(), "bias": bn.bias.detach()}
        prefix, value = node.target.replace(".", "_"), node.args[0]
        with graph.inserting_before(node):
            for name, op in EXPORTED_BN:
                gm.register_buffer(f"{prefix}_{name}", constants[name].reshape(-1, 1, 1).to(dtype).clone())
                constant = graph.get_attr(f"{prefix}_{name}")
                flipped = name == "weight" and i % 2 == 1
                value = graph.call_function(ops[op], (constant, value) if flipped else (value, constant))
        node.replace_all_uses_with(value)
        graph.erase_node(node)
    gm.delete_all_unused_submodules()
    graph.lint()
    gm.recompile()
    return gm.to(pick_device(device), dtype).eval()


__all__ += ["EXPORTED_BN", "exported_resnet"]
