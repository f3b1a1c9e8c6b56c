"""Which layers travel together: the transfer modes and the group plan.

Pure Python, no torch or vLLM: imported by the prefill worker's sender and by the unit
tests. A prefill step computes layer after layer; the sender ships the KV of a group
of adjacent layers as soon as the group's last layer is written, so the transfer runs
while later layers compute (paper 004, section 3.3):
- `whole`: one group of every layer, sent after the forward pass (what vLLM does);
- `layer`: every layer on its own;
- `group`: `fitted_groups` below, from a cost model of the link (learned from the
  writes themselves) and of the per-layer compute; or groups of a fixed size.
The last layer always travels alone: after it nothing is left to hide a bigger group.
"""

from __future__ import annotations

import dataclasses

MODES = ("whole", "layer", "group")


@dataclasses.dataclass(frozen=True)
class LinkModel:
    """Cost of one batch write on the transfer engine: a fixed overhead plus bytes at
    a bandwidth; measured at start-up (`Link.calibrate`)."""

    overhead_s: float
    bytes_per_s: float

    def transfer_s(self, nbytes: int) -> float:
        return self.overhead_s + nbytes / self.bytes_per_s


class LinkEstimator:
    """The link's cost as the writes of real transfers see it: a least-squares fit of
    seconds against bytes over the last `window` completed writes. It starts from the
    start-up calibration, taken on an idle engine; under load (compute threads and
    other engines on the same cores) the per-write overhead is often ten times that."""

    def __init__(self, prior: LinkModel, window: int = 32, min_samples: int = 8):
        self.model = prior
        self.window = window
        self.min_samples = min_samples
        self._samples: list[tuple[int, float]] = []

    def observe(self, nbytes: int, seconds: float) -> None:
        self._samples = [*self._samples[-(self.window - 1):], (nbytes, seconds)]
        if len(self._samples) < self.min_samples:
            return
        n = len(self._samples)
        mean_x = sum(x for x, _ in self._samples) / n
        mean_y = sum(y for _, y in self._samples) / n
        var_x = sum((x - mean_x) ** 2 for x, _ in self._samples)
        if var_x > 0:
            slope = sum((x - mean_x) * (y - mean_y) for x, y in self._samples) / var_x
            intercept = mean_y - slope * mean_x
            if slope > 0 and intercept >= 0:
                self.model = LinkModel(overhead_s=intercept, bytes_per_s=1 / slope)
                return
        # All writes the same size (or a fit that makes no sense): keep the overhead,
        # take the bandwidth from what is left of the time.
        rest = sum(y for _, y in self._samples) - n * self.model.overhead_s
        if rest > 0:
            self.model = LinkModel(self.model.overhead_s, sum(x for x, _ in self._samples) / rest)


class ComputeModel:
    """Seconds one layer takes per token in the step, learned from the gaps between
    consecutive per-layer save hooks (an exponentially weighted mean)."""

    def __init__(self, smoothing: float = 0.3):
        self.smoothing = smoothing
        self.layer_s_per_token: float | None = None

    def observe(self, layer_gap_s: float, num_tokens: int) -> None:
        if num_tokens <= 0 or layer_gap_s <= 0:
            return
        sample = layer_gap_s / num_tokens
        if self.layer_s_per_token is None:
            self.layer_s_per_token = sample
        else:
            self.layer_s_per_token += self.smoothing * (sample - self.layer_s_per_token)

    def layer_s(self, num_tokens: int) -> float | None:
        if self.layer_s_per_token is None:
            return None
        return self.layer_s_per_token * num_tokens


def fitted_groups(num_layers: int, layer_bytes: int, link: LinkModel,
                  layer_compute_s: float | None, slack: float = 0.5) -> list[tuple[int, int]]:
    """The `group` plan, built from the last layer backwards. The last layer travels
    alone. Each earlier group is the largest whose write, together with the writes of
    every later group but the last, fits in `slack` of the compute still to come after
    the group's last layer: the link drains before the forward pass ends. So writes are
    few and large early, where much compute is left to hide them (less per-write
    overhead, more bandwidth), and small near the end. Compute time not measured yet:
    taken as equal to the wire time, which gives one layer per write until it is."""
    if num_layers <= 0:
        return []
    wire = layer_bytes / link.bytes_per_s
    compute = layer_compute_s if layer_compute_s else wire
    groups = [(num_layers - 1, num_layers - 1)]
    committed = 0.0  # link time of the later groups (the last layer's write comes after)
    end = num_layers - 2
    while end >= 0:
        room = slack * (num_layers - 1 - end) * compute - committed - link.overhead_s
        size = min(end + 1, max(1, int(room / wire) if wire > 0 else end + 1))
        groups.insert(0, (end - size + 1, end))
        committed += link.transfer_s(size * layer_bytes)
        end -= size
    return groups


def plan_groups(num_layers: int, mode: str, group_size: int = 1) -> list[tuple[int, int]]:
    """Layer groups as (first, last) inclusive, in forward order."""
    if mode not in MODES:
        raise ValueError(f"unknown KV transfer mode {mode!r}; choose one of {', '.join(MODES)}")
    if num_layers <= 0:
        return []
    if mode == "whole":
        return [(0, num_layers - 1)]
    if mode == "layer" or group_size <= 1 or num_layers == 1:
        return [(i, i) for i in range(num_layers)]
    body = num_layers - 1
    groups = [(start, min(start + group_size, body) - 1) for start in range(0, body, group_size)]
    return groups + [(num_layers - 1, num_layers - 1)]
