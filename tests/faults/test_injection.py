"""`--inject` parsing and checks (pure)."""

from __future__ import annotations

import pytest

from elastic.records.injection import Injection, check_injections, parse_injection


def test_parses_every_kind() -> None:
    assert parse_injection("kill:node=2,step=8") == Injection(kind="kill", node=2, step=8)
    assert parse_injection("hang:step=3,node=0") == Injection(kind="hang", node=0, step=3)
    assert parse_injection("kill:node=3,when=reconfig") == Injection(kind="kill", node=3, when="reconfig")
    assert parse_injection("rejoin:node=2,step=15").name == "rejoin-node2-step15"
    inj = parse_injection("kill:node=1,when=reconfig")
    assert Injection.from_dict(inj.to_dict()) == inj
    mid = parse_injection("kill:node=2,step=8,at=0.5")
    assert mid == Injection(kind="kill", node=2, step=8, at=0.5) and mid.name == "kill-node2-step8-at0.5"
    assert Injection.from_dict(mid.to_dict()) == mid
    assert Injection.from_dict({"kind": "kill", "node": 1, "step": 2, "when": "step"}).at is None  # older configs


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("kill", "expected KIND:key=value"),
        ("explode:node=1,step=2", "KIND one of kill, hang, rejoin"),
        ("kill:node=1", "step must be given"),
        ("kill:step=3", "node=N is required"),
        ("kill:node=x,step=3", "must be integers"),
        ("kill:node=1,step=0", "numbered from 1"),
        ("kill:node=1,step=2,step=3", "step given twice"),
        ("kill:node=1,at=3", "step must be given"),
        ("kill:node=1,step=2,at=x", "at must be a number"),
        ("kill:node=1,step=2,at=-0.5", r"at must be a fraction in \[0, 10\]"),
        ("rejoin:node=1,step=2,at=0.5", "at must be a fraction"),
        ("kill:node=1,step=2,after=3", "unknown key"),
        ("kill:node=1,step=2,when=reconfig", "not both"),
        ("rejoin:node=1,when=reconfig", "rejoin cannot use when=reconfig"),
        ("hang:node=1,when=later", "when must be 'reconfig'"),
        ("kill:node=1,,step=2", "is not key=value"),
    ],
)
def test_bad_values_are_refused_clearly(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_injection(text)


def test_checks_against_the_run() -> None:
    check_injections(
        [parse_injection("kill:node=2,step=8"), parse_injection("rejoin:node=2,step=15")], nodes=4, steps=20
    )
    with pytest.raises(ValueError, match="node 4 is not in the run"):
        check_injections([parse_injection("kill:node=4,step=8")], nodes=4, steps=20)
    with pytest.raises(ValueError, match="past the last step 20"):
        check_injections([parse_injection("kill:node=1,step=21")], nodes=4, steps=20)
    with pytest.raises(ValueError, match="that no injection fails first"):
        check_injections([parse_injection("rejoin:node=1,step=5")], nodes=4, steps=20)
