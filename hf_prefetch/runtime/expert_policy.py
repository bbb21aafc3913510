"""Whether a routed layer fetches its previous forward's picks ahead of its router: measured per layer, online.

A fetch ahead (`experts.fetch_recent`) moves the rows of the experts a layer picked in its previous forward while the
layers before it compute, so that a pick made again is on the device before the router makes it; a row fetched that is
not picked again crossed the link for nothing. Whether that pays depends on the routing: nearly always on a layer whose
picks repeat from token to token, never on one whose picks vary (a random router fetches `top_k` rows to find `top_k**2
/ num_experts` of them picked again). So every layer with recent picks counts, on the device and whether it fetches or
not, the experts a fetch would bring (`CANDIDATES`: its previous picks that its expert cache does not hold) and the
picks among them (`CANDIDATE_HITS`), beside the picks its router copies from host memory; and every `WINDOW` routing
forwards, between two forwards, `decide` turns its fetch on where the rows it would waste stay under `ON_WASTE` of what
the router alone copies and off where they pass `OFF_WASTE`. Counts are decayed (half the old ones plus the new
window's), so a decision follows a change of routing (sampling) within a few windows and is not flipped by one window's
noise; a forward of many tokens (a new prompt's prefill) makes the counts so far weigh a quarter, so that the new
sequence's first windows decide, while windows keep counting across prompts (a generation shorter than a window still
counts towards a decision). A layer measures while its fetch is off, so it turns back on when its picks start to
repeat.

The decision is a flag on the device (`RecentPicks.enabled`), read by the fetch on the copy stream: a CUDA graph that
recorded the fetch follows the latest decision at every replay, with no host synchronisation in the forward. This
module holds the rule and its state; experts.py reads the counts and sets the flag.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RecentPolicy", "WINDOW", "ON_WASTE", "OFF_WASTE"]

WINDOW = 16  # routing forwards between two decisions (the expert cache re-ranks at the same reads)
# Rows fetched and not picked again, as a share of the picks the router copies from host memory: a fetch that wastes
# at most ON_WASTE turns on, one that wastes more than OFF_WASTE turns off. A layer that fetches moves at most
# 1 + OFF_WASTE times its router's bytes; between the two, a decision stays as it is.
ON_WASTE = 0.04
OFF_WASTE = 0.05


@dataclass
class RecentPolicy:
    """One layer's decision to fetch its recent picks ahead, and the decayed counts it was made from. `fixed` is the
    user's `recent_experts=True`: always on, still measured (so statistics say what it costs)."""

    fixed: bool = False
    on: bool = False
    # Decayed at each `decide`: experts a fetch ahead would bring, the router's picks that were among them, and the
    # router's picks not found in the expert cache (what the router alone copies from host memory).
    candidates: float = 0.0
    hits: float = 0.0
    router_picks: float = 0.0
    pending: tuple[int, int, int] = (0, 0, 0)  # the same, counted since the last decision
    decisions: int = 0  # times the counts were read
    switches: int = 0  # times the decision changed

    def add(self, candidates: int, hits: int, router_picks: int) -> None:
        """Counts read from the device (`experts.collect_tallies`), for the next decision."""
        c, h, r = self.pending
        self.pending = (c + candidates, h + hits, r + router_picks)

    def decide(self) -> bool:
        """Fold the counts since the last decision in and decide; True where the decision changed (the device's flag
        must follow)."""
        candidates, hits, router_picks = self.pending
        self.pending = (0, 0, 0)
        self.candidates = self.candidates / 2 + candidates
        self.hits = self.hits / 2 + hits
        self.router_picks = self.router_picks / 2 + router_picks
        self.decisions += 1
        if self.fixed or self.candidates == 0:  # no routing forward since, or every pick cached
            return False
        waste = self.wasted_share
        on = (waste <= ON_WASTE and self.hits > 0) if not self.on else waste <= OFF_WASTE
        changed, self.on = on != self.on, on
        self.switches += changed
        return changed

    def discount(self) -> None:
        """A new prompt: the decayed counts so far weigh a quarter, so that the new sequence's first windows decide
        (the decision is kept until then)."""
        self.candidates, self.hits, self.router_picks = self.candidates / 4, self.hits / 4, self.router_picks / 4

    @property
    def hit_rate(self) -> float:
        """Of the experts a fetch ahead brings, the share picked again."""
        return self.hits / self.candidates if self.candidates else 0.0

    @property
    def wasted_share(self) -> float:
        """Rows a fetch ahead brings for nothing, per pick the router alone would copy from host memory."""
        return (self.candidates - self.hits) / self.router_picks if self.router_picks else float(self.candidates > 0)

    @property
    def state(self) -> str:
        """"always" (`recent_experts=True`), "on" or "off"."""
        return "always" if self.fixed else ("on" if self.on else "off")

    def describe(self) -> str:
        """The decision and why, for `stats()`."""
        state = self.state
        if not self.decisions:
            return f"{state} (not measured yet)"
        return (
            f"{state}: {self.hit_rate:.0%} of fetched rows picked again, {self.wasted_share:.1%} extra rows "
            f"(on at <= {ON_WASTE:.0%}, off above {OFF_WASTE:.0%})"
        )
