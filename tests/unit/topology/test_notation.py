"""Deployment notation: parsing, co-location, canonical round-trip, errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from epd_serve.topology import notation

# notation -> (canonical, [(roles, devices), ...])
CASES = {
    "E-P-D": ("E-P-D", [("E", (0,)), ("P", (1,)), ("D", (2,))]),
    "EP-D": ("EP-D", [("EP", (0,)), ("D", (1,))]),
    "E-PD": ("E-PD", [("E", (0,)), ("PD", (1,))]),
    "(E-P)-D": ("(E-P)-D", [("E", (0,)), ("P", (0,)), ("D", (1,))]),
    "(E-D)-P": ("(E-D)-P", [("E", (0,)), ("D", (0,)), ("P", (1,))]),
    "(E-PD)": ("(E-PD)", [("E", (0,)), ("PD", (0,))]),
    "TP1": ("TP1", [("EPD", (0,))]),
    "TP2": ("TP2", [("EPD", (0, 1))]),
    "EPD": ("TP1", [("EPD", (0,))]),
    "2E1P1D": ("2E-P-D", [("E", (0,)), ("E", (1,)), ("P", (2,)), ("D", (3,))]),
    "2E-1P-1D": ("2E-P-D", [("E", (0,)), ("E", (1,)), ("P", (2,)), ("D", (3,))]),
    "(E-PD)x2": ("(E-PD)x2", [("E", (0,)), ("PD", (0,)), ("E", (1,)), ("PD", (1,))]),
    "(E-P)x2-2D": ("(E-P)x2-2D", [("E", (0,)), ("P", (0,)), ("E", (1,)), ("P", (1,)),
                                  ("D", (2,)), ("D", (3,))]),
    " e - p - d ": ("E-P-D", [("E", (0,)), ("P", (1,)), ("D", (2,))]),
    "P-D": ("P-D", [("P", (0,)), ("D", (1,))]),
}


@pytest.mark.parametrize("text", CASES)
def test_parse_gives_roles_devices_and_canonical_form(text):
    canonical, expected = CASES[text]
    plan = notation.parse(text)
    assert [(i.roles, i.devices) for i in plan.instances] == expected
    assert plan.to_notation() == canonical
    assert notation.parse(canonical) == plan  # round trip


def test_colocation_is_explicit_in_the_plan():
    plan = notation.parse("(E-P)-D")
    assert {d: [i.name for i in insts] for d, insts in plan.colocated().items()} == {0: ["e0", "p0"]}
    assert plan.num_devices == 2
    assert notation.parse("E-P-D").colocated() == {}


def test_instance_names_count_per_role_set():
    plan = notation.parse("2E-P-PD-D")
    assert [i.name for i in plan.instances] == ["e0", "e1", "p0", "pd0", "d0"]


@pytest.mark.parametrize("text, position, fragment", [
    ("E--P-D", 2, "expected a stage or '('"),
    ("(E-P", 4, "')' closing"),
    ("X-P-D", 0, "unknown stage 'X'"),
    ("E-Q-D", 2, "unknown stage 'Q'"),
    ("E-P", 3, "no decode stage"),
    ("E-D", 3, "no prefill stage"),
    ("", 0, "empty"),
    ("ED-P", 0, "not a valid merged instance"),
    ("EE-P-D", 0, "stage repeated"),
    ("0E-P-D", 0, "at least 1"),
    ("E-P-D)", 5, "'-' between devices"),
    ("(E-P)x-D", 6, "a count after 'x'"),
    ("E-P-D!", 5, "unexpected character"),
])
def test_malformed_notation_names_the_position(text, position, fragment):
    with pytest.raises(notation.NotationError) as info:
        notation.parse(text)
    assert info.value.position == position
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


def test_cli_prints_the_plan_as_json():
    out = subprocess.run([sys.executable, "-m", "epd_serve.cli", "topology", "(E-P)-D", "--json"],
                         capture_output=True, text=True, check=True).stdout
    plan = json.loads(out)
    assert plan["notation"] == "(E-P)-D"
    assert plan["num_devices"] == 2
    assert [(i["name"], i["roles"], i["devices"]) for i in plan["instances"]] == [
        ("e0", ["E"], [0]), ("p0", ["P"], [0]), ("d0", ["D"], [1])]
    assert plan["colocated"] == {"0": ["e0", "p0"]}


def test_cli_reports_bad_notation_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "epd_serve.cli", "topology", "E--P"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert "position 2" in proc.stderr


def test_a_tilde_marks_an_instance_that_may_switch_role():
    plan = notation.parse("2E~1P2D~")
    assert [(i.name, i.roles, i.switchable) for i in plan.instances] == [
        ("e0", "E", True), ("e1", "E", True), ("p0", "P", False), ("d0", "D", True),
        ("d1", "D", True)]
    assert plan.to_notation() == "2E~-P-2D~" and notation.parse(plan.to_notation()) == plan
    assert notation.parse("(E~-P)-D").to_notation() == "(E~-P)-D"
    assert not any(i.switchable for i in notation.parse("E-P-D").instances)


@pytest.mark.parametrize("text, says", [
    ("EP~-D", "only a single-stage instance"),
    ("P-D~~", "unexpected character '~'"),
    ("~P-D", "unexpected character '~'"),
])
def test_a_tilde_anywhere_else_is_refused(text, says):
    with pytest.raises(notation.NotationError, match=says):
        notation.parse(text)
