"""How the routed experts' picks of a forward split between the host's cores and the link
(`PrefetchConfig(cpu_experts=...)`): `HostCompute`, the plan's record of it, the counts it gives, and the plan's
bytes, time and lines that follow from them. The measurements are planning/host_compute.py's; the runtime side is
runtime/host_experts.py ([Note: experts on the host])."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from .placements import RingPlan, Routing, format_bytes, host_layers, routed_bytes_per_token

__all__ = [
    "HostCompute",
    "host_count",
    "best_host_count",
    "expected_picks",
    "never_splits",
    "host_seconds",
    "host_share",
    "host_lines",
]


@dataclass(frozen=True)
class HostCompute:
    """Where the routed experts of `host_layers(rings)` are computed: `always` (True) every forward's picks on the
    host; otherwise (`"auto"`) in forwards that route, `count(n)` of a forward's n distinct picks.

    `share`: `host / (host + link)`, the speeds measured beside each other (1.0 on a CPU device: no link). Beside a
    GPU, `times`: the host's seconds of one token through 1, 2, ... experts of `row_bytes` bytes each (fixed cost
    included, beside pinned copies), and `sync_seconds` what a split adds, which `count` weighs against the link
    (`host_compute.measure_host_times`)."""

    always: bool
    share: float
    host_gbps: float | None = None  # expert bytes per second the host's compute reads, beside the link's copies
    link_gbps: float | None = None  # the link's copies beside the host's compute
    times: tuple[float, ...] | None = None
    sync_seconds: float = 0.0
    row_bytes: int = 0

    def count(self, n: int, row_bytes: int | None = None) -> int:
        """Of a forward's n distinct picks of experts of `row_bytes` bytes each, how many the host computes. Experts
        of another size than the measured ones take the measured times scaled by their bytes."""
        if self.always:
            return n
        if not self.times or not self.link_gbps:
            return host_count(n, self.share)
        row = (row_bytes or self.row_bytes) / (self.link_gbps * 1e9)
        return best_host_count(n, self.times, row, self.sync_seconds, self._floor(), self._scale(row_bytes))

    def host_time(self, k: int, row_bytes: int | None = None) -> float:
        """The host seconds of one token through k experts (0 for none): the measured times made non-decreasing, and
        past them one more expert at a time at the measured times' average step, at least one expert's bytes at the
        host's measured speed."""
        if not self.times or k == 0:
            return 0.0
        return _extended(self.times, k, self._floor()) * self._scale(row_bytes)

    def _scale(self, row_bytes: int | None) -> float:
        return (row_bytes or self.row_bytes) / self.row_bytes if self.row_bytes else 1.0

    def _floor(self) -> float:
        return self.row_bytes / (self.host_gbps * 1e9) if self.host_gbps and self.row_bytes else 0.0


def host_count(n: int, share: float) -> int:
    """Of n experts, how many the host computes when it reads at `share / (1 - share)` times the link's speed: the k
    whose slower side, `max(k / share, (n - k) / (1 - share))`, is fastest (n * share rounded down or up, whichever
    is; the lower on a tie)."""
    if share >= 1.0 or share <= 0.0:
        return n if share >= 1.0 else 0
    low = int(n * share)
    candidates = [k for k in (low, low + 1) if k <= n]
    return min(candidates, key=lambda k: (max(k / share, (n - k) / (1 - share)), k))


def best_host_count(
    n: int,
    times: tuple[float, ...],
    link_row_seconds: float,
    sync_seconds: float,
    floor: float = 0.0,
    scale: float = 1.0,
) -> int:
    """The k of n picked experts that the host computes to finish soonest: `sync + max(host(k), (n - k) * row)`, with
    `host(k)` the measured `times[k - 1]` times `scale` (extended past them as `_extended` does, at least `floor` an
    expert), against `n * row` over the link alone for k = 0; the lower on a tie."""
    if not times:
        return 0

    def finish(k: int) -> float:
        if k == 0:
            return n * link_row_seconds
        return sync_seconds + max(_extended(times, k, floor) * scale, (n - k) * link_row_seconds)

    return min(range(n + 1), key=lambda k: (finish(k), k))


def _extended(times: Sequence[float], k: int, floor: float = 0.0) -> float:
    # Non-decreasing (a noisy sample never makes more experts cheaper), and past the measured times at their average
    # step per expert (one time alone: itself), at least `floor`.
    steady = list(itertools.accumulate(times, max))
    if k <= len(steady):
        return steady[k - 1]
    step = (steady[-1] - steady[0]) / (len(steady) - 1) if len(steady) > 1 else steady[0]
    return steady[-1] + (k - len(steady)) * max(step, floor)


def expected_picks(num_experts: int, top_k: int | None, tokens: int) -> int:
    """The distinct experts that `tokens` tokens' independent picks of `top_k` (unknown: every expert, as the plan's
    bytes count them) of `num_experts` reach."""
    top_k = min(top_k or num_experts, num_experts)
    return max(1, round(num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)))


def never_splits(rings: tuple[RingPlan, ...], compute: HostCompute, max_tokens: int) -> bool:
    """Whether by the host's measured times no forward that routes (1 .. `max_tokens` tokens) gives the host a pick."""
    if compute.always or not compute.times or not compute.link_gbps:
        return False
    for routing, _, row in _token_picks(rings):
        # Each distinct count of picks once, up to every expert.
        picks = set()
        for tokens in range(1, max_tokens + 1):
            picks.add(expected_picks(routing.num_experts, routing.top_k, tokens))
            if max(picks) >= routing.num_experts:
                break
        if any(compute.count(n, row) > 0 for n in picks):
            return False
    return True


def host_seconds(rings: tuple[RingPlan, ...], compute: HostCompute | None) -> float | None:
    """With `cpu_experts` and the host measured at planning (`"auto"` beside a GPU): the host's compute time of its
    part of a one-token forward's picked experts; None otherwise."""
    if compute is None:
        return None
    if compute.times:
        return sum(compute.host_time(compute.count(top_k, row), row) for _, top_k, row in _token_picks(rings))
    if compute.host_gbps is None:
        return None
    return routed_bytes_per_token(rings) * compute.share / (compute.host_gbps * 1e9)


def host_share(rings: tuple[RingPlan, ...], compute: HostCompute) -> float:
    """The share of a one-token forward's picked experts (of the layers of `host_layers`) the host computes."""
    picks = _token_picks(rings)
    total = sum(top_k for _, top_k, _ in picks)
    if compute.always or not total:
        return 1.0 if compute.always else compute.share
    return sum(compute.count(top_k, row) for _, top_k, row in picks) / total


def _token_picks(rings: tuple[RingPlan, ...]) -> list[tuple[Routing, int, int]]:
    # (routing, top_k, bytes of one expert) of every experts module of `host_layers`.
    found = []
    for layer in host_layers(rings):
        for routing in dict.fromkeys(spec.routing for spec in layer.routed):
            row = sum(s.nbytes for s in layer.routed if s.routing == routing) // routing.num_experts
            found.append(
                (routing, min(routing.top_k or routing.num_experts, routing.num_experts), row)
            )  # as picked_bytes
    return found


def host_lines(rings: tuple[RingPlan, ...], compute: HostCompute | None) -> list[tuple[str, str]]:
    """The plan's lines on experts computed on the host (none without them)."""
    if compute is None:
        return []
    layers = host_layers(rings)
    if not layers:
        return []
    routed = routed_bytes_per_token(rings)
    on_host = int(routed * host_share(rings, compute))
    count = f"{len(layers)} layer{'s' if len(layers) != 1 else ''}"
    if compute.always:
        what = f"{count} compute their routed experts on the host's cores in every forward"
    elif compute.times and compute.link_gbps:
        _, top_k, row = _token_picks(rings)[0]
        took = compute.count(top_k, row)
        what = (
            f"{count} split the picked experts of forwards that route: of a token's {top_k} picks the host computes "
            f"{took} (one token through 1..{len(compute.times)} experts took the host "
            + "/".join(f"{t * 1e3:.2f}" for t in compute.times)
            + f" ms, one expert crosses the link in {row / (compute.link_gbps * 1e9) * 1e3:.2f} ms, a split adds "
            f"{compute.sync_seconds * 1e3:.2f} ms)"
        )
    else:
        what = (
            f"{count} compute {compute.share:.0%} of the picked experts on the host's cores, the rest over the link, "
            "in forwards that route"
        )
    lines = [("experts on host", what)]
    per_token = (
        f"host reads {format_bytes(on_host)}, the link copies {format_bytes(routed - on_host)} of routed experts"
    )
    if compute.host_gbps is not None and compute.link_gbps is not None:
        host = host_seconds(rings, compute) or 0.0
        splits = sum(1 for _, top_k, row in _token_picks(rings) if compute.count(top_k, row) > 0)
        seconds = max(host, (routed - on_host) / (compute.link_gbps * 1e9)) + splits * compute.sync_seconds
        per_token += f"; {seconds * 1e3:.2f} ms predicted (link {compute.link_gbps:.1f} GB/s beside the host)"
    lines.append(("host experts/token", per_token))
    return lines
