"""How long a plan's forwards take when copies overlap compute: the forward's schedule simulated from each layer's
measured compute time (`forward_seconds`; the times come from `time_layers`, layer_times.py), for the budget
planner's `compute_seconds` mode.

This module knows layer times, plans and the link's speed; it knows nothing about streams or hooks: the simulation
follows the engine's ordering rules ([Note: stream ordering] in runtime/engine.py) with numbers instead of events.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .placements import RingPlan

__all__ = ["forward_seconds"]


def forward_seconds(rings: Sequence[RingPlan], compute: Mapping[str, float], link_bytes_per_second: float) -> float:
    """Seconds per forward of `rings`' plan when forwards run back to back (a decoding or denoising loop): each
    layer computes for `compute[layer.path]` seconds, every copy crosses the link at `link_bytes_per_second`, and
    copies and compute follow the engine's rules:
    - one copy at a time, in the order the layers that start them finish queuing (one copy stream);
    - a streamed layer's next-in-slot copy starts after the layer computed (the fork) and the copy before it ended;
    - a streamed layer computes after the layer before it and after its copy landed (the join);
    - each ring's first layers are copied at the end of the forward before (its last layers start them), and a
      layer that owns its slot is never copied again.
    Two forwards are simulated, the first starting with every first layer in place; the second's duration is the
    answer. Compute outside the layer lists (embeddings, the head) is not modelled."""
    order = [(number, layer) for number, ring in enumerate(rings) for layer in ring.layers]
    owned = {(n, layer.position): 0.0 for n, layer in order if layer.owns_slot}
    landed = dict(owned)
    for n, ring in enumerate(rings):
        for layer in ring.streamed:
            if layer.next_in_slot is not None and layer.next_in_slot < layer.position:
                landed[n, layer.next_in_slot] = 0.0
    link_free = clock = 0.0
    ends = []
    for _ in range(2):
        following = dict(owned)
        for n, layer in order:
            start = clock if not layer.streamed else max(clock, landed[n, layer.position])
            clock = start + compute[layer.path]
            if layer.streamed and not layer.owns_slot:
                target = rings[n].streamed[layer.next_in_slot]
                link_free = max(link_free, clock) + target.host_bytes / link_bytes_per_second
                (following if layer.next_in_slot < layer.position else landed)[n, layer.next_in_slot] = link_free
        ends.append(clock)
        landed = following
    return ends[1] - ends[0]
