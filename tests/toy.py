"""Tiny models shared by the tests."""

from __future__ import annotations

import torch
from torch import nn


class Stack(nn.Module):
    """Two Linear layers in an nn.ModuleList: one stage-3 unit each (no root unit)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 8), nn.Linear(8, 2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x
