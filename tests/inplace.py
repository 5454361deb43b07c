"""Models whose forward modifies tensors in place, as torchvision's and many hand-written ones do: ResNets of
torchvision's ``BasicBlock`` (``ReLU(inplace=True)``, the residual ``out += identity``; a toy one and ``resnet18``'s
layout) and blocks whose forward starts by modifying its input in place (``F.relu(x, inplace=True)``,
``x.mul_(...)``, ``x += ...``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class BasicBlock(nn.Module):
    """torchvision's ResNet block, written out: conv-bn-relu(in place)-conv-bn, ``out += identity``, relu (in place)."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride=stride, bias=False),
                                            nn.BatchNorm2d(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class TinyResNet(nn.Module):
    """torchvision's ResNet layout at toy size: a stem (conv, bn, ``ReLU(inplace=True)``), two stages of
    ``BasicBlock`` in ``nn.Sequential`` (the second with stride 2 and a downsample), pooling and a linear head.
    Input ``(N, 3, 8, 8)``. Not seeded: seed before building."""

    def __init__(self, width: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = nn.Sequential(BasicBlock(width, width), BasicBlock(width, width))
        self.layer2 = nn.Sequential(BasicBlock(width, 2 * width, stride=2), BasicBlock(2 * width, 2 * width))
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class ResNet18(nn.Module):
    """torchvision's ``resnet18`` written out at a width of choice: a 7x7 stride-2 stem (conv, bn,
    ``ReLU(inplace=True)``), 3x3 stride-2 max pooling, four stages of two :class:`BasicBlock` (stages 2-4 with stride
    2 and a downsample), average pooling and a linear head. Input ``(N, 3, 64, 64)`` at toy size. Not seeded."""

    def __init__(self, width: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        widths = [width, 2 * width, 4 * width, 8 * width]
        stages, inplanes = [], width
        for i, planes in enumerate(widths):
            stride = 1 if i == 0 else 2
            stages.append(nn.Sequential(BasicBlock(inplanes, planes, stride), BasicBlock(planes, planes)))
            inplanes = planes
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = nn.Linear(widths[-1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class InplaceFirstBlock(nn.Module):
    """A block whose first use of its input modifies it in place (``how``: "relu", "mul" or "add")."""

    def __init__(self, width: int, how: str) -> None:
        super().__init__()
        self.how = how
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "relu":
            x = F.relu(x, inplace=True)
        elif self.how == "mul":
            x.mul_(0.5)
        else:
            x += 0.25
        return self.fc(x)


class InplaceNet(nn.Module):
    """An input layer, then an ``nn.ModuleList`` of :class:`InplaceFirstBlock` (stage 3's units by default), each
    modifying its input in place first, and a head. Input ``(N, 6)``; returns a scalar loss. Not seeded."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.blocks = nn.ModuleList(InplaceFirstBlock(width, how) for how in ("relu", "mul", "add", "relu"))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


def resnet_batch(step: int, rows: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """Images and labels for :class:`TinyResNet` (6 rows: divisible by world sizes 1, 2 and 3)."""
    gen = torch.Generator().manual_seed(step)
    return torch.randn(rows, 3, 8, 8, generator=gen), torch.randint(0, 10, (rows,), generator=gen)


def resnet_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)
