"""Your own model with HiDup: plan it, predict it, train it with AdamW on 2 ranks.

    torchrun --nproc-per-node 2 examples/own_model.py
"""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import hidup
from simulator.predict import predict_plan


class MyModel(nn.Module):  # any module whose forward returns the loss
    def __init__(self, vocab=1024, dim=256):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mlp = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(),
                                 nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens, targets):
        h = self.emb(tokens)
        h = h + self.mlp(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


def batch(step):  # the global batch, the same on every rank (each takes its shard): 32
    # sequences counting up from random starts; the model learns to predict the next number
    start = torch.randint(0, 1024, (32, 1), generator=torch.Generator().manual_seed(step))
    tokens = (start + torch.arange(65)) % 1024
    return tokens[:, :-1], tokens[:, 1:]


dist.init_process_group("gloo")
torch.manual_seed(0)
model = MyModel()
plan = hidup.plan(model, batch(0), cluster="cpu-gloo-loopback", gpus=dist.get_world_size())
if dist.get_rank() == 0:
    print(plan.describe(), predict_plan(plan), sep="\n")
trainer = hidup.parallelize(
    model, plan, optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3),
    lr_scheduler=lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=20))
for step in range(20):
    loss = trainer.step(*batch(step))
    if dist.get_rank() == 0 and (step + 1) % 5 == 0:
        print(f"step {step + 1}: loss {loss.item():.4f}")
model.load_state_dict(trainer.full_state_dict())  # the trained weights, back in your module
dist.destroy_process_group()
