"""Property-based tests (hypothesis): random layouts, shapes, cmp_ratio, coff, start_pos, seqused,
cu_seqlens (empty segments included) and cache modes; kvcomp.torch.compressor's output, state cache
and four gradients against autograd through the float64 small-ops implementation, fp32 io. Bounded:
a fixed number of examples, derandomized so that CI runs are reproducible."""

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import kvcomp.torch as kt  # noqa: E402
from support import GRAD_NAMES, make_case, reference_grads  # noqa: E402


@st.composite
def cases(draw):
    th = draw(st.booleans())
    B = draw(st.integers(1, 3))
    r = draw(st.integers(1, 6))
    coff = draw(st.sampled_from([1, 2]))
    if th:
        lens = draw(st.lists(st.integers(0, 14), min_size=B, max_size=B))
        if sum(lens) == 0:
            lens[0] = 1  # the backward needs a non-empty x
        seqused = draw(st.one_of(st.none(), st.tuples(*[st.integers(0, n) for n in lens]).map(list)))
    else:
        S = draw(st.integers(1, 14))
        lens = [S] * B
        seqused = draw(st.one_of(st.none(), st.lists(st.integers(0, S), min_size=B, max_size=B)))
    start_pos = draw(st.one_of(st.none(), st.lists(st.integers(0, 12), min_size=B, max_size=B)))
    cache_mode = draw(st.sampled_from([1, 2]))
    D = draw(st.sampled_from([1, 3, 4]))
    H = draw(st.sampled_from([1, 5, 8]))
    seed = draw(st.integers(0, 2**16))
    return dict(
        lens=lens,
        th=th,
        r=r,
        coff=coff,
        start_pos=start_pos,
        seqused=seqused,
        cache_mode=cache_mode,
        D=D,
        H=H,
        seed=seed,
        zero_ids=0.2,
    )


def _close(a, truth, rel=2e-5):
    """Within `rel` of the output's scale. The scale is floored at 0.05 (inputs are O(1)): a gradient
    that is itself a cancelled difference (a near-uniform softmax over few rows) keeps the absolute
    fp32 error of its terms, ~1e-7, which says nothing about the implementation."""
    scale = max(truth.abs().max().item(), 0.05) if truth.numel() else 1.0
    return truth.numel() == 0 or (a.double() - truth.double()).abs().max().item() <= rel * scale


# database=None and no "explain" phase: nothing is written into the source tree.
@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate, Phase.shrink],
    suppress_health_check=[HealthCheck.too_slow],
)
@given(cases())
def test_matches_small_ops(spec):
    case = make_case(**spec)
    leaves = [t.clone().requires_grad_() for t in (case.x, case.wkv, case.wgate, case.ape)]
    cache = case.state_cache.clone()
    out = kt.compressor(*leaves[:3], cache, leaves[3], case.cmp_ratio, **case.kwargs())
    d = torch.randn(out.shape, generator=torch.Generator().manual_seed(spec["seed"]))
    out.backward(d)
    out_t, grads_t, cache_t = reference_grads(case, d, torch.float64)
    assert out.shape == out_t.shape
    assert _close(out.detach(), out_t)
    for leaf, n in zip(leaves, GRAD_NAMES):
        assert leaf.grad is not None and _close(leaf.grad, grads_t[n]), n
    assert _close(cache, cache_t)
    # Slots the reference did not write are bitwise untouched.
    untouched = (case.state_cache == cache_t).all(dim=-1)
    assert torch.equal(cache[untouched], case.state_cache[untouched])
