"""python/kvcomp/compare.py must give the verdict of every row of verdict_table.txt (the C++ rules are
held to the same table by test_verdict_table.cpp)."""

import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "support"))
from verdict_rules import compare  # noqa: E402


@dataclass
class Row:
    line: int
    name: str
    rule: str
    dtype: str
    options: dict = field(default_factory=dict)
    passed: bool = True
    reason: str = ""
    a: np.ndarray = None
    b: np.ndarray = None
    c: np.ndarray = None


def parse_values(text: str) -> np.ndarray:
    text = text.strip()
    if text == "-":
        return np.zeros(0)
    values = []
    for token in text.split():
        value, _, count = token.partition("*")
        values += [float(value)] * (int(count) if count else 1)
    return np.array(values, dtype=np.float64)


def load_table(path: Path = HERE / "verdict_table.txt") -> list[Row]:
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split(" | ")
        assert len(fields) == 6, f"verdict_table.txt:{number}: {len(fields)} fields, expected 6"
        name, how, verdict, a, b, c = fields
        rule, dtype, *opts = how.split()
        options = {k: float(v) for k, v in (o.split("=") for o in opts)}
        passed = verdict.strip() == "PASS"
        reason = verdict.strip().partition(":")[2].strip()
        assert passed or verdict.strip().startswith("FAIL"), f"verdict_table.txt:{number}: verdict {verdict}"
        rows.append(Row(number, name.strip(), rule, dtype, options, passed, reason, parse_values(a),
                        parse_values(b), parse_values(c)))
    return rows


ROWS = load_table()


def verdict(row: Row):
    if row.rule == "three_way":
        return compare.three_way(row.a, row.b, row.c, row.dtype)
    if row.rule == "two_way":
        assert row.b.size == 0, "two_way rows have no B"
        return compare.two_way(row.a, row.c, row.dtype, **row.options)
    if row.rule == "fp32_projection":
        return compare.fp32_projection(row.a, row.b, row.c, row.dtype)
    raise ValueError(f"verdict_table.txt:{row.line}: unknown rule {row.rule}")


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_row(row):
    res = verdict(row)
    where = f"verdict_table.txt:{row.line} ({row.name}): {res.summary()}"
    assert res.passed == row.passed, where
    assert res.why.startswith(row.reason), where


def test_table_covers_every_rule_both_ways():
    for rule in ("three_way", "two_way", "fp32_projection"):
        verdicts = {r.passed for r in ROWS if r.rule == rule}
        assert verdicts == {True, False}, f"{rule}: the table needs PASS and FAIL rows"
