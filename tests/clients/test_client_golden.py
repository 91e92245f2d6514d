"""The shared golden vectors of ``step_key`` (clients/golden/step_keys.json).

The TypeScript client (clients/typescript/test/keys.test.mjs) is checked against the same
file, so ``run.key(...)`` is the same string in both languages: an agent may be rewritten
from Python to TypeScript (or run steps in both) and still meet its journal entries. A key
that changes here changes for every run in every journal.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from idemproxy_client import step_key

GOLDEN = json.loads((Path(__file__).resolve().parents[2] / "clients" / "golden" / "step_keys.json")
                    .read_text(encoding="utf-8"))


def decode(value: Any) -> Any:
    """A golden part as a Python value: ``{"$bigint"}`` an int, ``{"$float"}`` NaN or ±inf."""
    if isinstance(value, list):
        return [decode(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"$bigint"}:
            return int(value["$bigint"])
        if set(value) == {"$float"}:
            return float(value["$float"])
        return {k: decode(v) for k, v in value.items()}
    return value


@pytest.mark.parametrize("vector", GOLDEN["keys"], ids=[v["name"] for v in GOLDEN["keys"]])
def test_golden_keys(vector):
    assert step_key(vector["run_id"], vector["step"], *decode(vector["parts"])) == vector["key"]


@pytest.mark.parametrize("vector", GOLDEN["errors"], ids=[v["name"] for v in GOLDEN["errors"]])
def test_golden_errors(vector):
    with pytest.raises((TypeError, ValueError)):
        step_key(vector["run_id"], vector["step"], *decode(vector["parts"]))


def test_the_vectors_cover_what_both_clients_must_agree_on():
    names = {v["name"] for v in GOLDEN["keys"]} | {v["name"] for v in GOLDEN["errors"]}
    assert len(GOLDEN["keys"]) >= 20 and {"empty step", "NaN", "Infinity"} <= names
    floats = next(v for v in GOLDEN["keys"] if v["name"] == "floats as Python prints them")["parts"]
    assert all(isinstance(f, float) for f in floats)  # 1e+16, 9007199254740992.0: floats, as JSON reads them
    assert next(v for v in GOLDEN["keys"] if v["name"] == "minus zero is the integer 0")["parts"] == [0]
