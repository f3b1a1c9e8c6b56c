"""The routing scores' names and arithmetic: which scorers exist, the named presets made
of them, and the normalisations that put every scorer in [0, 1], higher is better.

Pure (names and numbers, no proxy state): config.py checks a deployment file's
`routing:` against this one registry at start-up, and routing.py ranks instances with
it on every request. It lives apart from routing.py because routing imports state,
which imports config: config importing routing would be a cycle.

A policy is a weighted sum of scorers, `{scorer: weight}`; each scorer is normalised
against the candidates of the one decision, so weights compare like with like:
- least-loaded, size-weighted: `(least + own) / (load + own)`, the least-loaded
  candidate's load over this one's, both counting the hop being placed (`own`: one
  request, or its size). The least loaded scores 1 and so does an idle pool; twice the
  work scores 1/2. A ratio rather than `1 - load/max`, so one request on an otherwise
  idle pool is not "the most loaded" as fully as a hundred would be.
- hash-affinity: rendezvous rank, `2 ** -rank`: the key's own instance 1, the runner-up
  (where the key goes if the first leaves) 1/2, then 1/4... The owner's lead over the
  runner-up is half its weight whatever the pool size: under `{hash-affinity: A,
  least-loaded: L}` the owner keeps its key until its load is over 2L / (2L - A) times
  that of a least-loaded runner-up, both counting the hop (A = L: twice; L = 0.75 A:
  three times; L <= A / 2: never). Moving a key costs a cache miss, which pays only
  when the owner's queue costs more. No key (text): 0 for all, neutral.
- round-robin: 1 for all; the rotation decides, as it breaks every tie.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

# The scorers routing.py implements (each one must have an entry there).
SCORERS: dict[str, str] = {
    "least-loaded": "requests on the instance, the engine's own queue included",
    "size-weighted": "work on the instance by size: prompt tokens, image pixels for E",
    "hash-affinity": "rendezvous hash of the image key: the same image, the same encoder",
    "round-robin": "the same for every instance: the rotation decides",
}
# Routes by image content, so it means nothing for prefill or decode (config.py).
AFFINITY = "hash-affinity"
# What decides when no weighted scorer can tell the instances apart for lack of a key.
KEYLESS = {"least-loaded": 1.0}


@dataclasses.dataclass(frozen=True)
class Preset:
    weights: Mapping[str, float]
    two_choices: bool = False  # the better of two at random first, then the rest

    @property
    def affinity(self) -> bool:
        return self.weights.get(AFFINITY, 0.0) > 0


# The named policies a stage may give instead of weights.
PRESETS: dict[str, Preset] = {
    "round-robin": Preset({"round-robin": 1.0}),
    "least-loaded": Preset({"least-loaded": 1.0}),
    "size-weighted": Preset({"size-weighted": 1.0}),
    "power-of-two": Preset({"least-loaded": 1.0}, two_choices=True),
    "hash-affinity": Preset({"hash-affinity": 1.0}),
}


def resolve(spec: str | Mapping[str, float]) -> Preset:
    """A stage's policy as the deployment file gives it: a preset name or scorer
    weights. Raises ValueError naming what is wrong."""
    if isinstance(spec, str):
        if spec not in PRESETS:
            raise ValueError(f"unknown policy {spec!r}; presets: {', '.join(PRESETS)} "
                             f"(or scorer weights, e.g. {{least-loaded: 1}})")
        return PRESETS[spec]
    unknown = [name for name in spec if name not in SCORERS]
    if unknown:
        raise ValueError(f"unknown scorer {', '.join(map(repr, unknown))}; scorers: "
                         f"{', '.join(SCORERS)}")
    bad = {name: w for name, w in spec.items() if not (math.isfinite(w) and w >= 0)}
    if bad:
        raise ValueError(f"scorer weights must be finite and >= 0; got {bad}")
    if not any(w > 0 for w in spec.values()):
        raise ValueError("at least one scorer weight must be > 0")
    return Preset(dict(spec))


def describe(weights: Mapping[str, float]) -> str:
    """Weights as the deployment file writes them, for /status."""
    return "{" + ", ".join(f"{name}: {w:g}" for name, w in weights.items()) + "}"


def relative(loads: Sequence[float], own: float) -> list[float]:
    """Lower-is-better loads as scores: the least load over each, both plus `own`."""
    own = own if own > 0 else 1.0  # a hop of no size still counts as one
    least = min(loads)
    return [(least + own) / (load + own) for load in loads]


def by_rank(values: Sequence[float]) -> list[float]:
    """Highest value 1, the next 1/2, then 1/4...: a rank's score halves."""
    order = sorted(range(len(values)), key=lambda k: values[k], reverse=True)
    scores = [0.0] * len(values)
    for rank, k in enumerate(order):
        scores[k] = 2.0 ** -rank
    return scores
