"""Deployment notation -> typed plan of instances and devices.

Pure Python; imported by the CLI, the launcher, the proxy and the tests. Grammar:

    deployment := "TP" N | group ("-" group)*
    group      := "(" member ("-" member)* ")" ["x" N]     # members share one device
                | [N] roles ["x" N]                        # N copies, one device each
                | counted+                                 # "2E1P1D": each counted part
    roles      := a contiguous run of "E", "P", "D": E, P, D, EP, PD, EPD, then "~"
                  for an instance that may switch role while serving (E~, P~, D~)

`-` separates devices, `()` co-locates instances on one device as separate processes
(logical isolation), and letters written together (`EP`) are one merged instance.
A `~` instance is a full engine whatever it starts as (an E~ loads the language model
too) with both ends of each hand-off, so the proxy can move it between E, P and D
(proxy/roles.py); only single-stage instances switch.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections import Counter


class Role(str, enum.Enum):
    ENCODE = "E"
    PREFILL = "P"
    DECODE = "D"


ROLE_ORDER = "EPD"
# Merged instances must cover a contiguous run of the pipeline: "ED" would skip prefill.
VALID_ROLE_SETS = {"E", "P", "D", "EP", "PD", "EPD"}


class NotationError(ValueError):
    """A deployment notation that cannot be parsed; the message names the position."""

    def __init__(self, notation: str, position: int, problem: str):
        self.notation = notation
        self.position = position
        self.problem = problem
        super().__init__(
            f"bad deployment notation {notation!r} at position {position}: {problem}"
        )


@dataclasses.dataclass(frozen=True)
class Instance:
    """One engine process: the stages it runs and the devices it owns or shares."""

    name: str
    roles: str  # e.g. "E", "PD", "EPD", always in pipeline order
    devices: tuple[int, ...]
    group: int  # index of the device group (co-located instances share one)
    switchable: bool = False  # may switch between E, P and D while serving ("~")

    @property
    def tensor_parallel(self) -> int:
        return len(self.devices)

    def has(self, role: Role) -> bool:
        return role.value in self.roles

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "roles": list(self.roles),
            "devices": list(self.devices),
            "group": self.group,
            "tensor_parallel": self.tensor_parallel,
            "switchable": self.switchable,
        }

    @property
    def written(self) -> str:
        """How the notation writes it: its roles, "~" if it may switch."""
        return self.roles + ("~" if self.switchable else "")


@dataclasses.dataclass(frozen=True)
class Plan:
    """The parsed deployment: which instance runs which stages on which devices."""

    instances: tuple[Instance, ...]

    @property
    def num_devices(self) -> int:
        return 1 + max(d for inst in self.instances for d in inst.devices)

    def with_role(self, role: Role) -> list[Instance]:
        return [inst for inst in self.instances if inst.has(role)]

    def colocated(self) -> dict[int, list[Instance]]:
        """Device index -> instances sharing it (only devices shared by two or more)."""
        by_device: dict[int, list[Instance]] = {}
        for inst in self.instances:
            for device in inst.devices:
                by_device.setdefault(device, []).append(inst)
        return {d: insts for d, insts in by_device.items() if len(insts) > 1}

    def groups(self) -> list[list[Instance]]:
        grouped: dict[int, list[Instance]] = {}
        for inst in self.instances:
            grouped.setdefault(inst.group, []).append(inst)
        return [grouped[g] for g in sorted(grouped)]

    def to_notation(self) -> str:
        """Canonical notation; `parse(plan.to_notation()) == plan` holds."""
        if len(self.instances) == 1 and self.instances[0].roles == "EPD":
            return f"TP{self.instances[0].tensor_parallel}"
        parts: list[str] = []
        for group in self.groups():
            if len(group) > 1:
                part = "(" + "-".join(inst.written for inst in group) + ")"
            else:
                part = group[0].written
            parts.append(part)
        return "-".join(_compress_repeats(parts))

    def to_dict(self) -> dict:
        return {
            "notation": self.to_notation(),
            "num_devices": self.num_devices,
            "instances": [inst.to_dict() for inst in self.instances],
            "colocated": {str(d): [i.name for i in insts] for d, insts in self.colocated().items()},
        }


def _compress_repeats(parts: list[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(parts):
        j = i
        while j < len(parts) and parts[j] == parts[i]:
            j += 1
        count = j - i
        if count == 1:
            out.append(parts[i])
        elif parts[i].startswith("("):
            out.append(f"{parts[i]}x{count}")
        else:
            out.append(f"{count}{parts[i]}")
        i = j
    return out


@dataclasses.dataclass
class _Token:
    kind: str  # "(", ")", "-", "x", "num", "roles"
    text: str
    pos: int


_TOKEN_RE = re.compile(r"\s*(?:(?P<num>\d+)|(?P<roles>[A-Za-z]+~?)|(?P<punct>[()\-]))")


def _tokenize(notation: str) -> list[_Token]:
    tokens: list[_Token] = []
    pos = 0
    while pos < len(notation):
        if notation[pos].isspace():
            pos += 1
            continue
        m = _TOKEN_RE.match(notation, pos)
        if not m:
            raise NotationError(notation, pos, f"unexpected character {notation[pos]!r}")
        start = m.start(m.lastindex or 0)
        if m.group("num"):
            tokens.append(_Token("num", m.group("num"), start))
        elif m.group("punct"):
            tokens.append(_Token(m.group("punct"), m.group("punct"), start))
        else:
            tokens.extend(_split_letters(notation, m.group("roles"), start))
        pos = m.end()
    return tokens


def _split_letters(notation: str, word: str, start: int) -> list[_Token]:
    """'EPx2' -> roles 'EP', x, (the number follows as its own token)."""
    upper = word.upper()
    if upper.endswith("X") and len(upper) > 1 and upper[:-1].isalpha() and "X" not in upper[:-1]:
        return [_Token("roles", upper[:-1], start), _Token("x", "x", start + len(word) - 1)]
    if upper == "X":
        return [_Token("x", "x", start)]
    return [_Token("roles", upper, start)]


def _check_roles(notation: str, token: _Token) -> str:
    """The token's roles in pipeline order, "~" kept at the end for a switchable one."""
    switchable = token.text.endswith("~")
    letters = token.text.removesuffix("~")
    if switchable and len(letters) != 1:
        raise NotationError(notation, token.pos + len(letters),
                            f"only a single-stage instance (E, P or D) may switch, not {letters!r}")
    for offset, letter in enumerate(letters):
        if letter not in ROLE_ORDER:
            raise NotationError(
                notation, token.pos + offset, f"unknown stage {letter!r} (use E, P or D)"
            )
    counts = Counter(letters)
    if any(c > 1 for c in counts.values()):
        raise NotationError(notation, token.pos, f"stage repeated in {token.text!r}")
    roles = "".join(r for r in ROLE_ORDER if r in counts)
    if roles not in VALID_ROLE_SETS:
        raise NotationError(
            notation,
            token.pos,
            f"{token.text!r} is not a valid merged instance (one of {sorted(VALID_ROLE_SETS)})",
        )
    return roles + ("~" if switchable else "")


class _Parser:
    def __init__(self, notation: str):
        self.notation = notation
        self.tokens = _tokenize(notation)
        self.i = 0
        # Each group: (list of role strings sharing a device, tensor_parallel)
        self.groups: list[list[str]] = []

    def peek(self) -> _Token | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self, kind: str, what: str) -> _Token:
        tok = self.peek()
        if tok is None:
            raise NotationError(self.notation, len(self.notation), f"expected {what}, got the end")
        if tok.kind != kind:
            raise NotationError(self.notation, tok.pos, f"expected {what}, got {tok.text!r}")
        self.i += 1
        return tok

    def parse(self) -> list[list[str]]:
        if not self.tokens:
            raise NotationError(self.notation, 0, "empty notation")
        self.parse_group()
        while self.peek() is not None:
            self.take("-", "'-' between devices")
            self.parse_group()
        return self.groups

    def parse_multiplier(self) -> int:
        tok = self.peek()
        if tok is not None and tok.kind == "x":
            self.i += 1
            return self.positive(self.take("num", "a count after 'x'"))
        return 1

    def positive(self, tok: _Token) -> int:
        value = int(tok.text)
        if value < 1:
            raise NotationError(self.notation, tok.pos, "a count must be at least 1")
        return value

    def parse_group(self) -> None:
        tok = self.peek()
        if tok is None:
            raise NotationError(self.notation, len(self.notation), "expected a device, got the end")
        if tok.kind == "(":
            self.i += 1
            members = [_check_roles(self.notation, self.take("roles", "a stage (E, P, D)"))]
            while (nxt := self.peek()) is not None and nxt.kind == "-":
                self.i += 1
                members.append(_check_roles(self.notation, self.take("roles", "a stage (E, P, D)")))
            self.take(")", "')' closing the co-located group")
            for _ in range(self.parse_multiplier()):
                self.groups.append(list(members))
            return
        if tok.kind == "x":
            raise NotationError(self.notation, tok.pos, f"unknown stage {self.notation[tok.pos]!r} (use E, P or D)")
        if tok.kind not in ("num", "roles"):
            raise NotationError(self.notation, tok.pos, f"expected a stage or '(', got {tok.text!r}")
        # One or more counted parts written together: "2E1P1D", "E", "3PD", "EPx2".
        while (tok := self.peek()) is not None and tok.kind in ("num", "roles"):
            count = 1
            if tok.kind == "num":
                count = self.positive(tok)
                self.i += 1
            roles = _check_roles(self.notation, self.take("roles", "a stage after the count"))
            count *= self.parse_multiplier()
            for _ in range(count):
                self.groups.append([roles])


def parse(notation: str) -> Plan:
    """Parse deployment notation into a Plan, or raise NotationError."""
    text = notation.strip()
    tp = re.fullmatch(r"TP(\d+)", text, flags=re.IGNORECASE)
    if tp:
        size = int(tp.group(1))
        if size < 1:
            raise NotationError(notation, 2, "tensor parallel size must be at least 1")
        return Plan((Instance("epd0", "EPD", tuple(range(size)), 0),))

    groups = _Parser(notation).parse()
    counters: Counter[str] = Counter()
    instances = []
    for device, members in enumerate(groups):
        for written in members:
            roles = written.removesuffix("~")
            name = f"{roles.lower()}{counters[roles]}"
            counters[roles] += 1
            instances.append(Instance(name, roles, (device,), device,
                                      switchable=written.endswith("~")))
    plan = Plan(tuple(instances))
    for role, word in ((Role.PREFILL, "prefill"), (Role.DECODE, "decode")):
        if not plan.with_role(role):
            raise NotationError(notation, len(notation), f"the plan has no {word} stage")
    return plan
