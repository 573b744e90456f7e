"""Shared by test_distributed.py and dp_worker.py: the model and data of the data-parallel test."""

import torch

import kvcomp.torch as kt
from support import make_case


class CompressorLayer(torch.nn.Module):
    """wkv, wgate and ape as parameters around kvcomp.torch.compressor."""

    def __init__(self, case):
        super().__init__()
        self.cmp_ratio, self.coff = case.cmp_ratio, case.coff
        self.wkv = torch.nn.Parameter(case.wkv.clone())
        self.wgate = torch.nn.Parameter(case.wgate.clone())
        self.ape = torch.nn.Parameter(case.ape.clone())

    def forward(self, x, state_cache, **kw):
        return kt.compressor(
            x, self.wkv, self.wgate, state_cache, self.ape, self.cmp_ratio, coff=self.coff, **kw
        )


def make_dp_case():
    case = make_case(lens=[12] * 4, r=4, coff=2, start_pos=[5, 0, 3, 9], seqused=[12, 7, 12, 10], seed=41)
    weights = torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(42))
    return case, weights


def shard_kwargs(case, lo, hi):
    """Index tensors of batches [lo, hi)."""
    return dict(
        state_block_table=case.state_block_table[lo:hi],
        seqused=case.seqused[lo:hi],
        start_pos=case.start_pos[lo:hi],
        cache_mode=case.cache_mode,
    )
