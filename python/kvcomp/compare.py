"""Precision reports of the upstream CompressorGrad tests (spec sections 7.1 and 7.2).

three_way(a, b, c, dtype): A = the result under test (kvcomp, or an NPU run), B = the "same"
reference (fp32 arithmetic, d_new rounded to the io dtype, as the NPU), C = the float64 truth
rounded to the output dtype. A passes when it is not much worse than B, measured against C.

two_way(actual, expected, dtype): element-wise rtol/atol with a 99.5 % pass rate.

fp32_projection(a, b, c, dtype): the bound used instead of three_way for forward outputs whose accuracy is
that of the fp32 projection x.W^T (cmp_kv, kv).

These are the Python definition of the rules; src/reference/precision.hpp is the C++ one. Both must give
the verdicts of tests/precision/verdict_table.txt (tests/precision checks that for each).

Inputs may be torch tensors (bf16 included) or numpy arrays; everything is flattened and, as
upstream, converted to fp32 before any statistic is taken.
"""

import dataclasses
import sys

import numpy as np

# Spec 7.2: `err` splits large from small elements and floors the ratio denominators; `error` is the
# tolerance on small elements.
THREE_WAY_THRESHOLDS = {"bf16": (2e-8, 2e-16), "fp16": (2e-11, 2e-16), "fp32": (2e-14, 2e-30)}
# Spec 7.1: (rtol, atol) per dtype.
TWO_WAY_TOLERANCES = {"bf16": (0.0078125, 1e-4), "fp16": (0.005, 2.5e-5), "fp32": (0.005, 2.5e-5)}

_ALIASES = {
    "bf16": "bf16",
    "bfloat16": "bf16",
    "torch.bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "torch.float16": "fp16",
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "torch.float32": "fp32",
}


def dtype_key(dtype):
    """'bf16' | 'fp16' | 'fp32' from a torch dtype, numpy dtype or name."""
    key = _ALIASES.get(str(dtype))
    if key is None:
        try:
            key = _ALIASES.get(np.dtype(dtype).name)
        except TypeError:
            key = None
    if key is None:
        raise ValueError(f"no precision thresholds for dtype {dtype}")
    return key


def as_f32(a):
    """Flattened float64 array of the fp32-rounded values of a torch tensor or array-like."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(a, torch.Tensor):
        a = a.detach().cpu().to(torch.float32).numpy()
    return np.asarray(a, dtype=np.float32).astype(np.float64).ravel()


@dataclasses.dataclass
class ThreeWayResult:
    passed: bool = True
    why: str = ""
    n: int = 0
    n_large: int = 0
    mare_a: float = 0.0
    mere_a: float = 0.0
    rmse_a: float = 0.0
    mare_b: float = 0.0
    mere_b: float = 0.0
    rmse_b: float = 0.0
    small_bad_a: int = 0
    small_bad_b: int = 0
    mare_ratio: float = 0.0
    mere_ratio: float = 0.0
    rmse_ratio: float = 0.0
    small_ratio: float = 0.0
    nonfinite_mismatch: int = 0

    def summary(self):
        return (
            f"{'PASS' if self.passed else 'FAIL'} n={self.n} large={self.n_large} | "
            f"A: MARE {self.mare_a:.3g} MERE {self.mere_a:.3g} RMSE {self.rmse_a:.3g} | "
            f"B: MARE {self.mare_b:.3g} MERE {self.mere_b:.3g} RMSE {self.rmse_b:.3g} | "
            f"ratios {self.mare_ratio:.3g}/{self.mere_ratio:.3g}/{self.rmse_ratio:.3g} (<10/<2/<2) | "
            f"small bad A {self.small_bad_a} B {self.small_bad_b} ratio {self.small_ratio:.3g} (<2) | "
            f"nonfinite mismatch {self.nonfinite_mismatch}" + (f" | {self.why}" if self.why else "")
        )


def _same_nonfinite(a, e):
    """Both NaN, or the same Inf (spec 7.1: those positions count as matches)."""
    return (np.isnan(a) & np.isnan(e)) | (np.isinf(a) & (a == e))


def three_way(a, b, c, dtype):
    """Spec 7.2 three-party check of A (under test) against B (the "same" reference), both measured
    against C (the float64 truth rounded to the output dtype)."""
    a, b, c = as_f32(a), as_f32(b), as_f32(c)
    res = ThreeWayResult()
    if not (a.size == b.size == c.size):
        return dataclasses.replace(res, passed=False, why="size mismatch")
    res.n = a.size
    if res.n == 0:
        return res
    err, error = THREE_WAY_THRESHOLDS[dtype_key(dtype)]
    finite = np.isfinite(a) & np.isfinite(c)
    res.nonfinite_mismatch = int(np.count_nonzero(~finite & ~_same_nonfinite(a, c)))
    a, b, c = a[finite], b[finite], c[finite]
    da = np.abs(a - c)
    # A non-finite B is infinitely wrong, so A is never blamed for it.
    with np.errstate(invalid="ignore"):
        db = np.where(np.isfinite(b), np.abs(b - c), np.inf)
    large = np.abs(c) >= err
    res.n_large = int(np.count_nonzero(large))
    if res.n_large:
        denom = np.maximum(np.abs(c[large]), 1e-7)
        ra, rb = da[large] / denom, db[large] / denom
        res.mare_a, res.mare_b = float(ra.max()), float(rb.max())
        res.mere_a, res.mere_b = float(ra.mean()), float(rb.mean())
        res.rmse_a = float(np.sqrt(np.mean(da[large] ** 2)))
        res.rmse_b = float(np.sqrt(np.mean(db[large] ** 2)))
        res.mare_ratio = res.mare_a / max(res.mare_b, err)
        res.mere_ratio = res.mere_a / max(res.mere_b, err)
        res.rmse_ratio = res.rmse_a / max(res.rmse_b, err)
    small = ~large
    res.small_bad_a = int(np.count_nonzero(da[small] > error))
    res.small_bad_b = int(np.count_nonzero(db[small] > error))
    res.small_ratio = res.small_bad_a / max(res.small_bad_b, 1)
    checks = [
        (res.nonfinite_mismatch == 0, "NaN/Inf in A where C differs"),
        (res.n_large == 0 or res.mare_ratio < 10, "MARE ratio >= 10"),
        (res.n_large == 0 or res.mere_ratio < 2, "MERE ratio >= 2"),
        (res.n_large == 0 or res.rmse_ratio < 2, "RMSE ratio >= 2"),
        (res.small_ratio < 2, "small-element error count ratio >= 2"),
    ]
    for ok, why in checks:
        if not ok:
            res.passed, res.why = False, why
            break
    return res


@dataclasses.dataclass
class TwoWayResult:
    passed: bool = True
    why: str = ""
    n: int = 0
    n_fail: int = 0
    nonfinite_mismatch: int = 0
    fail_fraction: float = 0.0
    max_rel_fail: float = 0.0

    def summary(self):
        return (
            f"{'PASS' if self.passed else 'FAIL'} n={self.n} fail={self.n_fail} "
            f"({100 * self.fail_fraction:.4g}%) "
            f"max rel err of failing points {self.max_rel_fail:.3g} (<10) | "
            f"nonfinite mismatch {self.nonfinite_mismatch}" + (f" | {self.why}" if self.why else "")
        )


def two_way(actual, expected, dtype, pct_thd=0.005, rtol=None, atol=None):
    """Spec 7.1 two-party check: a point passes if |a-e| <= atol + rtol*|e|; at most `pct_thd` of the
    points may fail, and none by a relative error >= 10."""
    a, e = as_f32(actual), as_f32(expected)
    res = TwoWayResult()
    if a.size != e.size:
        return dataclasses.replace(res, passed=False, why="size mismatch")
    res.n = a.size
    if res.n == 0:
        return res
    d_rtol, d_atol = TWO_WAY_TOLERANCES[dtype_key(dtype)]
    rtol = d_rtol if rtol is None else rtol
    atol = d_atol if atol is None else atol
    finite = np.isfinite(a) & np.isfinite(e)
    bad_nonfinite = ~finite & ~_same_nonfinite(a, e)
    res.nonfinite_mismatch = int(np.count_nonzero(bad_nonfinite & ~np.isfinite(a)))
    with np.errstate(invalid="ignore"):
        diff = np.abs(a - e)
        fail = finite & (diff > atol + rtol * np.abs(e))
    rel_floor = (1.0 / 16384.0) / 0.005
    rel = diff[fail] / (np.maximum(np.maximum(np.abs(a[fail]), np.abs(e[fail])), rel_floor) + 2e-9)
    res.n_fail = int(np.count_nonzero(fail) + np.count_nonzero(bad_nonfinite))
    res.max_rel_fail = float(np.inf if bad_nonfinite.any() else (rel.max() if rel.size else 0.0))
    res.fail_fraction = res.n_fail / res.n
    if res.nonfinite_mismatch:
        res.passed, res.why = False, "NaN/Inf in actual where expected differs"
    elif res.fail_fraction > pct_thd:
        res.passed, res.why = False, "too many points outside tolerance"
    elif not res.max_rel_fail < 10:
        res.passed, res.why = False, "a failing point has relative error >= 10"
    return res


@dataclasses.dataclass
class ProjectionResult:
    passed: bool = True
    why: str = ""

    def summary(self):
        return ("PASS" if self.passed else "FAIL") + (f" | {self.why}" if self.why else "")


def fp32_projection(a, b, c, dtype):
    """For forward outputs whose accuracy is that of the fp32 projection x.W^T (kvcomp, like the NPU and
    the fp32 golden, accumulates it in fp32): A cannot be systematically better than B there, and the max
    statistic of the three-way rule becomes a coin toss on the rare elements that sit on an io-dtype
    rounding midpoint. Instead:
      io dtypes: |A - C| <= one io ulp of C + 2^-18 max|C| everywhere (the second term covers elements
        that are cancelled sums), and no more rounding flips (A != C) than 2 x B's + 3;
      fp32: the three-way MERE and RMSE ratios < 2, each element's error relative to max(|C|, rms C)
        (a sum's rounding error follows the size of its terms, not of the result: relative to |C| alone
        one cancelled sum can outweigh the other elements of a small output), and
        max |A - C| <= 10 max |B - C| (absolute).
    NaN/Inf as in the three-way rule: positions where A and C are the same NaN/Inf are skipped, any other
    non-finite A or C fails; a non-finite B is infinitely wrong."""
    a, b, c = as_f32(a), as_f32(b), as_f32(c)
    if not (a.size == b.size == c.size):
        return ProjectionResult(False, "size mismatch")
    key = dtype_key(dtype)
    finite = np.isfinite(a) & np.isfinite(c)
    mismatch = int(np.count_nonzero(~finite & ~_same_nonfinite(a, c)))
    if mismatch:
        return ProjectionResult(False, f"{mismatch} NaN/Inf in A where C differs")
    a, b, c = a[finite], b[finite], c[finite]
    if a.size == 0:
        return ProjectionResult()
    if key != "fp32":
        frac, emin = (7, -126) if key == "bf16" else (10, -14)
        scale = np.ldexp(np.max(np.abs(c)), -18)
        _, exp = np.frexp(c)  # c = m * 2^exp with 0.5 <= |m| < 1: ilogb(c) = exp - 1
        e = np.where(c == 0, emin, np.maximum(exp - 1, emin))
        over = ~(np.abs(a - c) <= np.ldexp(1.0, e - frac) + scale)
        if over.any():
            i = int(np.argmax(over))
            why = f"element {i}: {a[i]:.9g} vs truth {c[i]:.9g} is more than one {key} ulp off"
            return ProjectionResult(False, why)
        flips_a, flips_b = int(np.count_nonzero(a != c)), int(np.count_nonzero(b != c))
        if flips_a > 2 * flips_b + 3:
            return ProjectionResult(False, f"{flips_a} rounding flips vs {flips_b} for the fp32 golden")
        return ProjectionResult()
    # Errors relative to max(|C|, rms C); the ratio floors are the three-way rule's (err).
    den = np.maximum(np.maximum(np.abs(c), np.sqrt(np.mean(c * c))), 1e-30)
    with np.errstate(invalid="ignore"):
        ea, eb = np.abs(a - c), np.where(np.isfinite(b), np.abs(b - c), np.inf)
    mere_a, mere_b = float(np.mean(ea / den)), float(np.mean(eb / den))
    rmse_a, rmse_b = float(np.sqrt(np.mean(ea * ea))), float(np.sqrt(np.mean(eb * eb)))
    tiny = THREE_WAY_THRESHOLDS["fp32"][0]
    if not (mere_a / max(mere_b, tiny) < 2 and rmse_a / max(rmse_b, tiny) < 2):
        which = "RMSE" if mere_a / max(mere_b, tiny) < 2 else "MERE"
        why = (
            f"{which} ratio >= 2 (MERE {mere_a:.3g} vs {mere_b:.3g}, RMSE {rmse_a:.3g} vs {rmse_b:.3g}"
            " for the fp32 golden)"
        )
        return ProjectionResult(False, why)
    max_a = float(np.max(np.abs(a - c)))
    with np.errstate(invalid="ignore"):
        max_b = float(np.max(np.where(np.isfinite(b), np.abs(b - c), np.inf)))
    if max_a > 10 * max_b + 1e-30:
        return ProjectionResult(False, f"max abs error {max_a:.3g} vs {max_b:.3g} for the fp32 golden")
    return ProjectionResult()


def report(results):
    """One line per output of a {name: ThreeWayResult | TwoWayResult | ProjectionResult} dict, and an overall verdict."""
    width = max((len(n) for n in results), default=0)
    lines = [f"{name:<{width}}  {r.summary()}" for name, r in results.items()]
    lines.append("overall: " + ("PASS" if all(r.passed for r in results.values()) else "FAIL"))
    return "\n".join(lines)


def valid_rows(x_shape, cmp_ratio, cu_seqlens=None, seqused=None, start_pos=None):
    """Boolean mask over the leading dims of cmp_kv / softmax_score / kv: True for rows that hold a
    compressed block (spec 1.7), False for padding rows, which the NPU leaves unwritten.

    x_shape: BSH (B, S, H) or TH (T, H); the index tensors as given to the operator (None: absent).
    """
    r = int(cmp_ratio)
    if len(x_shape) == 3:
        B, S = int(x_shape[0]), int(x_shape[1])
        lens = [S] * B
    else:
        cu = [int(v) for v in as_f32(cu_seqlens)]
        B = len(cu) - 1
        lens = [cu[b + 1] - cu[b] for b in range(B)]
    used = [int(v) for v in as_f32(seqused)] if seqused is not None else lens
    sps = [int(v) for v in as_f32(start_pos)] if start_pos is not None else [0] * B
    counts = []
    for sp, u in zip(sps, used):
        limit = (sp + u) // r * r
        counts.append(-(-(limit - sp) // r) if limit > sp else 0)
    if len(x_shape) == 3:
        rows = -(-S // r)
        return np.array([[i < n for i in range(rows)] for n in counts], dtype=bool).reshape(B, rows)
    T = int(x_shape[0])
    rows = min(T, T // r + B)
    return np.arange(rows) < sum(counts)
