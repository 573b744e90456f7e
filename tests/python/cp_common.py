"""Shared by test_context_parallel.py and cp_worker.py: the cases and how their tokens are split."""

import torch

from support import make_case


def make_cp_case(spec):
    return make_case(lens=spec["lens"], r=spec["r"], coff=spec["coff"], start_pos=spec.get("sp"),
                     seqused=spec.get("used"), th=spec["th"], H=spec.get("H", 16), D=spec.get("D", 4),
                     dtype=spec.get("dtype", "bf16"), seed=spec.get("seed", 0), S=spec.get("S"))


def token_rows(spec, rank, world):
    """Global flat rows (BSH: b*S + s; TH: packed row) of the tokens `rank` holds, in its local order."""
    lens, W = spec["lens"], world
    if not spec["th"]:
        B, S = len(lens), spec.get("S") or max(lens)
        if spec["split"] == "contiguous":
            cuts = spec["cuts"]  # S_k per rank
            lo = sum(cuts[:rank])
            ss = list(range(lo, lo + cuts[rank]))
        else:
            c = S // (2 * W)
            ss = list(range(rank * c, (rank + 1) * c)) + list(range((2 * W - 1 - rank) * c, (2 * W - rank) * c))
        return [b * S + s for b in range(B) for s in ss]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    if spec["split"] == "contiguous":
        cuts = spec["cuts"]
        lo = sum(cuts[:rank])
        return list(range(lo, lo + cuts[rank]))
    rows = []
    for b, n in enumerate(lens):
        c = n // (2 * W)
        rows += [cu[b] + s for s in list(range(rank * c, (rank + 1) * c)) +
                 list(range((2 * W - 1 - rank) * c, (2 * W - rank) * c))]
    return rows


def local_part(case, spec, rank, world):
    rows = torch.tensor(token_rows(spec, rank, world), dtype=torch.int64, device=case.x.device)
    H = case.x.shape[-1]
    flat = case.x.reshape(-1, H).index_select(0, rows)
    if spec["th"]:
        return flat
    return flat.view(len(spec["lens"]), -1, H)


def epilogue_of(case, spec):
    """(norm_weight fp32 [D] or None, rope_cos, rope_sin fp32 [positions, pairs] or None) of a case with
    ``epilogue=dict(norm=bool, pairs=int)``: fixed values from the case's seed, tables covering every
    position of its sequences."""
    ep = spec.get("epilogue")
    if not ep:
        return None, None, None
    D = case.wkv.shape[0] // case.coff
    g = torch.Generator().manual_seed(500 + spec.get("seed", 0))
    w = (1 + 0.25 * torch.randn(D, generator=g)) if ep.get("norm", True) else None
    pairs = ep.get("pairs", 0)
    if not pairs:
        return w, None, None
    positions = max(spec.get("sp") or [0]) + (spec.get("S") or max(spec["lens"])) + sum(spec["lens"]) + spec["r"]
    pos = torch.arange(positions, dtype=torch.float64)[:, None]
    freq = 10000.0 ** (-torch.arange(pairs, dtype=torch.float64) / pairs)
    return w, torch.cos(pos * freq).float(), torch.sin(pos * freq).float()
