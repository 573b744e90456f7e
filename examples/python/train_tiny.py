#!/usr/bin/env python3
"""A short training loop with kvcomp.torch.compressor on CPU.

The model: token embedding -> compressor (C4A-style: coff 2, cmp_ratio 4, bf16 io by default) ->
linear head predicting, for each compressed row, the most frequent token of its block. The script
is the shape of an NPU training script: only the import differs
(``import kvcomp.torch as cann_ops_transformer`` instead of ``import cann_ops_transformer``).

  python3 examples/python/train_tiny.py [--steps 50] [--dtype bf16|fp16|fp32] [--compile]
"""

import argparse

import torch
from torch import nn

import kvcomp.torch as cann_ops_transformer  # on the NPU: import cann_ops_transformer


class TinyCompressedLM(nn.Module):
    def __init__(self, vocab=32, hidden=64, head_dim=16, cmp_ratio=4, coff=2):
        super().__init__()
        self.cmp_ratio, self.coff = cmp_ratio, coff
        self.emb = nn.Embedding(vocab, hidden)
        self.wkv = nn.Parameter(torch.randn(coff * head_dim, hidden) / hidden**0.5)
        self.wgate = nn.Parameter(torch.randn(coff * head_dim, hidden) / hidden**0.5)
        self.ape = nn.Parameter(torch.zeros(cmp_ratio, coff * head_dim))  # fp32, as on the NPU
        self.head = nn.Linear(head_dim, vocab)

    def forward(self, tokens, state_cache, block_table):
        x = self.emb(tokens)
        cmp_kv = cann_ops_transformer.compressor(
            x,
            self.wkv,
            self.wgate,
            state_cache,
            self.ape,
            self.cmp_ratio,
            state_block_table=block_table,
            coff=self.coff,
        )
        return self.head(cmp_kv.float())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--compile", action="store_true", help="torch.compile the training step's forward")
    a = p.parse_args()
    torch.manual_seed(0)
    io = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]

    batch, seq, vocab, block_size = 8, 32, 32, 16
    model = TinyCompressedLM(vocab=vocab)
    # The projections and the embedding run in the io dtype; ape and the head stay fp32.
    model.emb.to(io)
    model.wkv.data = model.wkv.data.to(io)
    model.wgate.data = model.wgate.data.to(io)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)

    # Paged state cache: block ids 1.. for each sequence's positions (id 0 = "do not write").
    blocks_per_seq = -(-seq // block_size)
    block_table = torch.arange(1, batch * blocks_per_seq + 1, dtype=torch.int32).reshape(
        batch, blocks_per_seq
    )
    state_cache = torch.zeros(batch * blocks_per_seq + 1, block_size, 2 * model.coff * 16)

    tokens = torch.randint(0, vocab, (batch, seq))
    target = tokens.view(batch, seq // model.cmp_ratio, model.cmp_ratio).mode(dim=-1).values

    def loss_fn(tokens, target):
        logits = model(tokens, state_cache, block_table)
        return nn.functional.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1))

    step_fn = torch.compile(loss_fn, fullgraph=True) if a.compile else loss_fn
    first = None
    for step in range(a.steps):
        loss = step_fn(tokens, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = loss.item() if first is None else first
        if step % 10 == 0 or step == a.steps - 1:
            print(f"step {step:3d}  loss {loss.item():.4f}")
    print(f"loss {first:.4f} -> {loss.item():.4f}")


if __name__ == "__main__":
    main()
