"""ViT with mixture-of-experts layers (vit-sgmoe, vit-switch): patch embedding (a convolution with
stride = kernel), class token, learned position embedding, the alternating layers, and a
classification head on the class token. Trained here on synthetic images (timing only)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hidup.models.transformer import moe_stack, run_stack


class VitMoE(nn.Module):
    def __init__(self, image, patch, channels, classes, dim, heads, hidden, layers, experts,
                 top_k, capacity, dropout=0.0, aux_weight=0.0):
        super().__init__()
        n_patches = (image // patch) ** 2
        self.embed = nn.Conv2d(channels, dim, kernel_size=patch, stride=patch)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, n_patches + 1, dim) * 0.02)
        self.layers = moe_stack(dim, heads, hidden, layers, experts, top_k, capacity, dropout,
                                aux_weight)
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, images, labels):
        x = self.embed(images).flatten(2).transpose(1, 2)  # (b, patches, dim)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        x, aux = run_stack(self.layers, x)
        loss = F.cross_entropy(self.head(self.ln(x[:, 0])), labels)
        return loss if aux is None else loss + aux


def random_inputs(image: int, channels: int, classes: int):
    def inputs(batch, gen):
        return (torch.randn(batch, channels, image, image, generator=gen),
                torch.randint(0, classes, (batch,), generator=gen))
    return inputs
