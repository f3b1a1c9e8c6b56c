"""The fingerprint of an answer, and the one rule for "the same answer".

An answer's text says little: a tiny random-weight model, or a real one on a short
prompt, can give the same words for different inputs. Its tokens and their top log-
probabilities do not: a feature taken from another image, a KV block written by another
request or two requests' answers crossed move them by tenths of a nat or more. Every
check in the tests and benchmarks that says "same answer" or "right answer" asks for the
log-probs (`ask_for_fingerprint`), reads them (`fingerprint`, `fingerprint_of_stream`)
and compares them here (`compare`).

Two answers computed by the same weights on different instances, batched differently,
can still differ in the last bits of a logit. So log-probs are compared within
`TOLERANCE` (measured: E-P-D against one instance, tests/e2e/test_fingerprint.py), and
where a greedy token differs because two candidates were tied within that tolerance, the
answers are `TIED`: both are right, and nothing after that token can be compared.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

TOP = 5  # log-probs of the five likeliest tokens at every step
DECIMALS = 3  # log-probs rounded to 1e-3 in a fingerprint
# Two log-probs of the same token differ by more than this only when the computation
# differed: another feature, another KV, another request.
TOLERANCE = 0.01
# One bf16 step of a logit between 4 and 8 (2**-5), and a little: how far an answer to a
# long prompt (~1,200 tokens and more) moves with the batch shape it is computed in, on
# CPU bf16 kernels: one instance's own answer alone and in a batch of 8 (0.030-0.032,
# benchmarks/chaos_soak.py), decode's own first step of a prompt it was handed against
# one instance's (0.031 on an AVX2 host). A KV block lost or written by another request
# moves it by far more (tests/e2e/test_fingerprint.py).
ROUNDING_STEP_TOLERANCE = 0.04


@dataclass(frozen=True)
class Step:
    """One generated token: its identity, log-prob and the top `TOP` alternatives."""

    token: str  # "token_id:N" where the request asked for ids, else its text (and bytes)
    logprob: float
    top: tuple[tuple[str, float], ...]  # likeliest first

    def logprob_of(self, token: str) -> float | None:
        return dict(self.top).get(token)


# One tuple of steps per choice, in the order of the choices' `index`.
Fingerprint = tuple[tuple[Step, ...], ...]


class Verdict(enum.Enum):
    SAME = "same"  # every token equal, every log-prob within TOLERANCE
    TIED = "tied"  # equal up to a greedy choice between candidates tied within TOLERANCE
    DIFFERENT = "different"


@dataclass(frozen=True)
class Comparison:
    verdict: Verdict
    where: str = ""  # the first difference or tie: choice, step, what

    @property
    def agrees(self) -> bool:
        """Both answers are right answers to the same request."""
        return self.verdict is not Verdict.DIFFERENT


class NoFingerprint(ValueError):
    """The answer carries no log-probs to fingerprint (the request did not ask)."""


def ask_for_fingerprint(body: dict) -> dict:
    """`body` (chat or completions) asking for what a fingerprint needs: the top `TOP`
    log-probs of every generated token, as token ids."""
    asked = {**body, "return_tokens_as_token_ids": True}
    if "messages" in body:
        asked.update(logprobs=True, top_logprobs=TOP)
    else:
        asked["logprobs"] = TOP
    return asked


def _rounded(value: float) -> float:
    return round(float(value), DECIMALS)


def _chat_token(entry: dict) -> str:
    # Byte-level tokens that are not whole characters all read "\ufffd": their bytes
    # tell them apart where the request did not ask for ids.
    token = entry["token"]
    if token.startswith("token_id:") or entry.get("bytes") is None:
        return token
    return f"{token}|{bytes(entry['bytes']).hex()}"


def _chat_steps(content: list[dict]) -> tuple[Step, ...]:
    return tuple(
        Step(_chat_token(c), _rounded(c["logprob"]),
             tuple((_chat_token(t), _rounded(t["logprob"])) for t in c.get("top_logprobs") or ()))
        for c in content)


def _completion_steps(logprobs: dict) -> tuple[Step, ...]:
    tops = logprobs.get("top_logprobs") or [None] * len(logprobs["tokens"])
    return tuple(
        Step(token, _rounded(logprob),
             tuple(sorted(((t, _rounded(v)) for t, v in (top or {}).items()),
                          key=lambda tv: -tv[1])))
        for token, logprob, top in zip(logprobs["tokens"], logprobs["token_logprobs"], tops)
        if logprob is not None)  # echoed prompt tokens: the first has no log-prob


def _steps_of(choice: dict) -> tuple[Step, ...]:
    logprobs = choice.get("logprobs")
    if not logprobs:
        raise NoFingerprint(f"choice {choice.get('index', 0)} has no log-probs: send the "
                            "request through ask_for_fingerprint")
    if "content" in logprobs:  # chat
        return _chat_steps(logprobs["content"] or [])
    return _completion_steps(logprobs)


def fingerprint(answer: dict) -> Fingerprint:
    """The fingerprint of a whole (not streamed) chat or completions answer."""
    choices = sorted(answer["choices"], key=lambda c: c.get("index", 0))
    return tuple(_steps_of(choice) for choice in choices)


def fingerprint_of_stream(chunks: Iterable[dict]) -> Fingerprint:
    """The fingerprint of a streamed answer, from its parsed `data:` chunks in order."""
    steps: dict[int, list[Step]] = {}
    for chunk in chunks:
        for choice in chunk.get("choices") or ():
            logprobs = choice.get("logprobs")
            if logprobs:
                steps.setdefault(choice.get("index", 0), []).extend(_steps_of(choice))
    return tuple(tuple(steps[i]) for i in sorted(steps))


def _tie(got: Step, want: Step, tolerance: float) -> bool:
    """Whether each answer's token was, in the other's own step, within `tolerance` of
    the token chosen there: a greedy choice that rounding may decide either way."""
    got_in_want, want_in_got = want.logprob_of(got.token), got.logprob_of(want.token)
    return (got_in_want is not None and want_in_got is not None
            and abs(want.logprob - got_in_want) <= tolerance
            and abs(got.logprob - want_in_got) <= tolerance)


def _compare_step(got: Step, want: Step, tolerance: float) -> Verdict:
    if got.token != want.token:
        return Verdict.TIED if _tie(got, want, tolerance) else Verdict.DIFFERENT
    if abs(got.logprob - want.logprob) > tolerance:
        return Verdict.DIFFERENT
    want_top = dict(want.top)
    # Tokens in both top lists must agree; one only in one list must sit at that list's
    # edge (within tolerance of the other's last), where rounding may swap it out.
    got_floor = got.top[-1][1] if got.top else 0.0
    want_floor = want.top[-1][1] if want.top else 0.0
    for token, logprob in got.top:
        if token in want_top:
            if abs(logprob - want_top[token]) > tolerance:
                return Verdict.DIFFERENT
        elif logprob > want_floor + tolerance:
            return Verdict.DIFFERENT
    got_top = dict(got.top)
    if any(token not in got_top and logprob > got_floor + tolerance for token, logprob in want.top):
        return Verdict.DIFFERENT
    return Verdict.SAME


def compare(got: Fingerprint, want: Fingerprint, tolerance: float = TOLERANCE) -> Comparison:
    """`got` against `want`, choice by choice, step by step, up to the first difference
    (or a tie, after which the two answers may go separate ways)."""
    if len(got) != len(want):
        return Comparison(Verdict.DIFFERENT, f"{len(got)} choices, expected {len(want)}")
    tied = ""
    for index, (got_steps, want_steps) in enumerate(zip(got, want)):
        for step, (g, w) in enumerate(zip(got_steps, want_steps)):
            verdict = _compare_step(g, w, tolerance)
            if verdict is Verdict.DIFFERENT:
                return Comparison(verdict, f"choice {index} step {step}: {g.token!r} "
                                           f"{g.logprob} against {w.token!r} {w.logprob}"
                                           f" (top {list(g.top)} against {list(w.top)})")
            if verdict is Verdict.TIED:
                tied = tied or f"choice {index} step {step}: {g.token!r} and {w.token!r} tied"
                break
        else:
            if len(got_steps) != len(want_steps):
                return Comparison(Verdict.DIFFERENT, f"choice {index}: {len(got_steps)} "
                                                     f"tokens, expected {len(want_steps)}")
    return Comparison(Verdict.TIED, tied) if tied else Comparison(Verdict.SAME)
