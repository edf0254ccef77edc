"""A `transformers` model with HiDup: plan it and train it on 2 ranks.

    pip install transformers
    torchrun --nproc-per-node 2 examples/transformers_model.py
"""
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import hidup


class WithLoss(torch.nn.Module):  # HiDup takes a module whose forward returns the loss
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, labels):
        return self.model(input_ids=ids, labels=labels).loss


def batch(step):  # the global batch, the same on every rank; the last 3 labels are padding
    ids = torch.randint(0, 96, (8, 16), generator=torch.Generator().manual_seed(step % 4))
    labels = ids.clone()
    labels[:, -3:] = -100
    return ids, labels


dist.init_process_group("gloo")
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, use_cache=False)
model = WithLoss(LlamaForCausalLM(cfg))
plan = hidup.plan(model, batch(0), cluster="cpu-gloo-loopback", gpus=dist.get_world_size(),
                  strategy="megatron")
if dist.get_rank() == 0:
    print(plan.describe())
trainer = hidup.parallelize(model, plan,
                            optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2))
for step in range(20):
    loss = trainer.step(*batch(step))
    if dist.get_rank() == 0 and (step + 1) % 5 == 0:
        print(f"step {step + 1}: loss {loss.item():.4f}")
model.load_state_dict(trainer.full_state_dict())  # the trained weights, back in your module
dist.destroy_process_group()
