"""`OffloadPlan`, what a dispatch executes: its rings of layers with their placements, slots and bytes, and its one
renderer (a fixed-width table for `print(plan)`, HTML for Jupyter). It reads plans; it knows nothing about models or
devices."""

from __future__ import annotations

import html
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..alignment import LINK_SHARE_ALIGN_BYTES, round_up
from ..config import PrefetchConfig, UVAConfig
from .file_tier import READ, file_lines, host_arena_bytes, pinned_bytes
from .host_split import HostCompute, host_lines, host_seconds, host_share
from .links import STAGES
from .placements import (
    ROUTED_BREAK_EVEN,
    LayerPlan,
    RingPlan,
    Source,
    cache_bytes,
    caches_experts,
    format_bytes,
    host_layers,
    kept_plain,
    routed_bytes_per_token,
)
from .ranks import RankShare, rank_totals

if TYPE_CHECKING:
    from .memory import MemoryBudget

__all__ = [
    "OffloadPlan",
    "compresses_nothing",
    "host_arena_bytes",
    "no_saving",
    "render_text",
    "render_html",
    "format_bytes",
]


@dataclass(frozen=True)
class OffloadPlan:
    """What a dispatch does: every parameter's placement, the slots of streamed layers, and the bytes involved.

    `print(plan)` shows a table; Jupyter renders it as HTML. Bytes: `offloaded_bytes` of values live in pinned host
    memory, in a host arena of `host_bytes` (aligned, encoded where compressed), `pool_bytes` is the static device
    buffer pool, `resident_bytes` are the weights and buffers that stay on the execution device,
    `streamed_bytes_per_forward` is what crosses the link in each forward.
    """

    config: PrefetchConfig | UVAConfig
    rings: tuple[RingPlan, ...]
    resident_bytes: int
    source: Source = Source.STRIDE
    # The memory budget the streamed layers were chosen to fit (Source.BUDGET).
    budget: MemoryBudget | None = None
    # Host-to-device link speed (GB/s) for the transfer time per forward; None leaves that line out.
    link_gbps: float | None = None
    # Experts of each streamed layer's routed tensors kept on the device (capped at the layer's num_experts).
    cached_experts: int = 0
    # The CUDA devices whose host links carry the streamed bytes, the execution device's first; () for its link only.
    # Each link copies an equal share of every streamed layer (runtime/shared_links.py, [Note: shared links]).
    links: tuple[int, ...] = ()
    # Pipeline placement (`pipeline.py`): each GPU, in layer order, with the budget its layers were planned for; the
    # first is the execution device, which also holds everything outside the layer list. () on one device.
    gpus: tuple[tuple[int, MemoryBudget], ...] = ()
    # PrefetchConfig.cpu_experts: the routed experts computed on the host's cores (host_compute.py); None: none.
    host_compute: HostCompute | None = None
    # The disk's direct read speed (GB/s) the load measured, for the read time of the layers read from files.
    read_gbps: float | None = None
    ranks: tuple[RankShare, ...] = ()  # a tensor-parallel model's: every rank's share (ranks.py), this one's too

    @property
    def backend(self) -> str:
        """`"prefetch"` or `"uva"`."""
        return "uva" if isinstance(self.config, UVAConfig) else "prefetch"

    @property
    def offloaded_bytes(self) -> int:
        return sum(ring.offloaded_bytes for ring in self.rings)

    @property
    def host_bytes(self) -> int:
        """Pinned host memory the offloaded parameters take: the host arena (`file_tier.host_arena_bytes`), the staging
        buffers of layers read from the checkpoint's files, and the host expert caches of experts read from them."""
        return pinned_bytes(self.rings)

    @property
    def file_bytes(self) -> int:
        """Bytes of the layers read from the checkpoint's files (Placement.READ), read again for every copy."""
        return sum(p.nbytes for r in self.rings for layer in r.layers for p in layer.offloaded if p.placement is READ)

    @property
    def compressed_bytes(self) -> tuple[int, int]:
        """(values, encoded bytes) of the compressed parameters."""
        specs = [p for ring in self.rings for layer in ring.layers for p in layer.offloaded if p.compressed]
        return sum(p.nbytes for p in specs), sum(p.host_nbytes for p in specs)

    @property
    def kept_plain(self) -> dict[str, int]:
        """With `compress=True`: why streamed tensors are not kept compressed, and how many for each reason (empty
        without `compress`, and where every streamed tensor is compressed)."""
        if not getattr(self.config, "compress", False):
            return {}
        reasons = [kept_plain(layer, p) for ring in self.rings for layer in ring.streamed for p in layer.offloaded]
        return dict(Counter(reason for reason in reasons if reason is not None))

    @property
    def pool_bytes(self) -> int:
        return sum(ring.pool_bytes for ring in self.rings)

    @property
    def streamed_bytes_per_forward(self) -> int:
        """What crosses the link in a forward of many tokens (with `cpu_experts=True`, the routed experts computed on
        the host do not)."""
        total = sum(ring.bytes_per_forward for ring in self.rings)
        if self.host_always:
            total -= sum(spec.nbytes for layer in host_layers(self.rings) for spec in layer.routed)
        return total

    @property
    def routed_bytes(self) -> int:
        """Offloaded bytes of ROUTED parameters (expert tensors that copy only routed experts in small forwards)."""
        return sum(p.nbytes for ring in self.rings for layer in ring.layers for p in layer.routed)

    @property
    def streamed_bytes_per_token(self) -> int:
        """What crosses the link in a forward of one token; equals `streamed_bytes_per_forward` without ROUTED
        parameters or when no forward routes (`routed_max_tokens` 0). With an expert cache, its share of the experts
        is expected to hit (a router that picks every expert equally often); with `cpu_experts`, the host's share of
        the picks does not cross (all of them with True)."""
        if self.routed_max_tokens == 0:
            return self.streamed_bytes_per_forward
        total = sum(ring.bytes_per_token for ring in self.rings)
        if self.host_compute is not None:
            total -= int(routed_bytes_per_token(self.rings) * host_share(self.rings, self.host_compute))
        for ring in self.rings:
            for layer in ring.layers:
                if not caches_experts(layer) or self.cached_experts == 0:
                    continue
                for spec in layer.routed:
                    r = spec.routing
                    if r.top_k is not None:
                        hit = min(self.cached_experts, r.num_experts) / r.num_experts
                        total -= int(spec.nbytes * min(r.top_k, r.num_experts) // r.num_experts * hit)
        return total

    @property
    def cache_bytes(self) -> int:
        """Device bytes of the expert cache: `cached_experts` rows of every routed tensor of every streamed layer."""
        return cache_bytes(self.rings, self.cached_experts)

    @property
    def routed_max_tokens(self) -> int:
        """The most tokens a forward may have for its routed experts to be copied expert by expert (0: no routed
        parameters): the config's `routed_max_tokens`, else the smallest break-even point of the experts modules,
        `floor(ROUTED_BREAK_EVEN * num_experts / top_k)` tokens, at least 1."""
        routings = {spec.routing for ring in self.rings for layer in ring.layers for spec in layer.routed}
        if not routings:
            return 0
        if getattr(self.config, "routed_max_tokens", None) is not None:
            return self.config.routed_max_tokens
        return min(max(1, int(ROUTED_BREAK_EVEN * r.num_experts / (r.top_k or r.num_experts))) for r in routings)

    @property
    def device_bytes(self) -> int:
        return self.resident_bytes + self.pool_bytes + self.cache_bytes

    @property
    def longest_run(self) -> int:
        return max((ring.longest_run for ring in self.rings), default=0)

    @property
    def saves_device_memory(self) -> bool:
        """Whether the plan keeps fewer bytes on the device than the unmodified model (the pool and the expert cache
        are smaller than what it offloads)."""
        return self.pool_bytes + self.cache_bytes < self.offloaded_bytes

    def gpu_bytes(self, index: int) -> tuple[int, int]:
        """Pipeline placement: (resident bytes, pool and expert-cache bytes) on GPU `index`. The first GPU holds the
        weights outside the layer list as well."""
        first = self.gpus[0][0] if self.gpus else index
        mine = [ring for ring in self.rings if (ring.device if ring.device is not None else first) == index]
        in_rings = sum(layer.resident_bytes for ring in self.rings for layer in ring.layers)
        resident = sum(layer.resident_bytes for ring in mine for layer in ring.layers)
        if index == first:
            resident += self.resident_bytes - in_rings
        return resident, sum(ring.pool_bytes for ring in mine) + cache_bytes(tuple(mine), self.cached_experts)

    @property
    def num_links(self) -> int:
        """How many host links carry the streamed bytes (1: the execution device's own)."""
        return max(1, len(self.links))

    @property
    def staging_bytes(self) -> int:
        """Device bytes of staging buffers on each other GPU of `links` (0 without): `STAGES` buffers that each hold
        the largest share of a streamed layer."""
        if not self.links:
            return 0
        largest = max(
            (
                round_up(-(-layer.offloaded_bytes // self.num_links), LINK_SHARE_ALIGN_BYTES)
                + 2 * LINK_SHARE_ALIGN_BYTES * len(layer.offloaded)
                for ring in self.rings
                for layer in ring.streamed
            ),
            default=0,
        )
        return STAGES * largest

    @property
    def transfer_seconds_per_forward(self) -> float | None:
        """`streamed_bytes_per_forward` at `link_gbps` per link, over every link of `links` at once: the least time a
        forward can take; None without a link speed."""
        if self.link_gbps is None:
            return None
        return self.streamed_bytes_per_forward / (self.link_gbps * 1e9 * self.num_links)

    @property
    def host_always(self) -> bool:
        """`cpu_experts=True`: the routed experts of `host_layers` compute on the host in every forward."""
        return self.host_compute is not None and self.host_compute.always

    @property
    def host_seconds_per_token(self) -> float | None:
        """The host's compute time of its share of a one-token forward's experts (`host_split.host_seconds`)."""
        return host_seconds(self.rings, self.host_compute)

    def __str__(self) -> str:
        return render_text(self)

    def _repr_html_(self) -> str:
        return render_html(self)

    def __repr__(self) -> str:
        return (
            f"OffloadPlan(backend={self.backend!r}, rings={[r.path for r in self.rings]}, "
            f"resident_bytes={self.resident_bytes}, pool_bytes={self.pool_bytes}, "
            f"offloaded_bytes={self.offloaded_bytes})"
        )


def no_saving(plan: OffloadPlan) -> str | None:
    """Why a prefetch plan keeps as many bytes on the device as the model without it (None where it saves some): no
    layer streams, or the pool (and expert cache) is as large as what it offloads. `print(plan)` shows it, and a
    dispatch of the plan warns with it."""
    if plan.backend != "prefetch" or plan.saves_device_memory:
        return None
    size, config = format_bytes, plan.config
    if plan.offloaded_bytes:
        held = "buffer pool and expert cache" if plan.cache_bytes else "buffer pool"
        return (
            f"its {held} ({size(plan.pool_bytes + plan.cache_bytes)}) is as large as what it offloads "
            f"({size(plan.offloaded_bytes)}). Stream more layers than prefetch_step (or lower prefetch_step), or do "
            "not offload."
        )
    lists = " and ".join(f"{ring.path} has {len(ring.layers)}" for ring in plan.rings)
    if plan.source is Source.BUDGET and plan.budget is not None:
        why = (
            f"all of the model fits {plan.budget.source} = {size(plan.budget.device_bytes)} (with reserve_bytes = "
            f"{size(plan.budget.reserve_bytes)}), so every weight stays on the device. Run it without hf_prefetch, or "
            "give a smaller max_memory"
        )
    elif plan.source is Source.STRIDE and not any(
        layer.index % config.group_size >= config.group_size - config.num_in_group
        for ring in plan.rings
        for layer in ring.layers
    ):
        why = (
            f"group_size={config.group_size}, num_in_group={config.num_in_group} streams the last "
            f"{config.num_in_group} of every {config.group_size} layers, and {lists}: every weight stays on the "
            f"device. Lower group_size, or pass max_memory to stream what does not fit"
        )
    else:
        cannot = (
            "can leave the device (each is used under two names, as tied weights are, or replaced by its module's "
            "forward): every weight stays on the device"
        )
        if plan.source is Source.EXPLICIT:
            why = f"no layer was chosen, or no parameter of the chosen layers {cannot}"
        else:
            why = f"no parameter of the layers that {_choice(plan)} selects {cannot}"
    return f"no layer streams: {why}."


def compresses_nothing(plan: OffloadPlan) -> str | None:
    """Where `compress=True` keeps no streamed tensor compressed: how many stay plain, and why (None where one is
    compressed, where nothing streams, and without `compress`). `print(plan)` shows it, and the verbs warn with it."""
    plain = plan.kept_plain
    if not plain or plan.compressed_bytes[0]:
        return None
    reasons = "; ".join(f"{count} {why}" for why, count in plain.items())
    return f"all {sum(plain.values())} streamed tensors stay plain ({reasons})"


_HEADER = ("layer", "placement", "resident", "host", "slot", "next")


def _layer_row(ring: RingPlan, layer: LayerPlan) -> tuple[str, ...]:
    resident = format_bytes(layer.resident_bytes)
    if layer.streamed:
        host = format_bytes(layer.host_bytes)
        if layer.owns_slot:
            return (layer.path, "own slot", resident, host, str(layer.slot), "-")
        following = str(ring.streamed[layer.next_in_slot].index)
        return (layer.path, layer.streamed_kind, resident, host, str(layer.slot), following)
    if layer.mapped:
        placement = "mapped" if layer.resident_bytes == 0 else "partly mapped"
        return (layer.path, placement, resident, format_bytes(layer.offloaded_bytes), "-", "-")
    return (layer.path, "resident", resident, "-", "-", "-")


def _choice(plan: OffloadPlan) -> str:
    config = plan.config
    if isinstance(config, UVAConfig):
        chosen = f"cpu_offload_gb={config.cpu_offload_gb:g}"
        if config.cpu_offload_params:
            chosen += f", cpu_offload_params={sorted(config.cpu_offload_params)}"
        return chosen
    chosen = {
        Source.BUDGET: "to fit the budget",
        Source.EXPLICIT: "chosen layers",
        Source.STRIDE: f"group_size={config.group_size}, num_in_group={config.num_in_group}",
    }[plan.source]
    chosen += f", prefetch_step={config.prefetch_step}"
    if config.offload_params:
        chosen += f", offload_params={sorted(config.offload_params)}"
    return chosen


def _plain_pool(plan: OffloadPlan) -> int:
    return plan.pool_bytes - sum(ring.staging_bytes * ring.num_slots for ring in plan.rings)


def _totals(plan: OffloadPlan) -> list[tuple[str, str]]:
    size = format_bytes
    num_layers = sum(len(ring.layers) for ring in plan.rings)
    if plan.backend == "uva":
        num_mapped = sum(1 for ring in plan.rings for layer in ring.layers if layer.mapped)
        return [
            ("mapped layers", f"{num_mapped} of {num_layers} ({_choice(plan)})"),
            ("device bytes", f"{size(plan.device_bytes)} (no buffer pool)"),
            ("pinned host bytes", size(plan.host_bytes)),
            ("read per forward", f"{size(plan.streamed_bytes_per_forward)} over the bus, at least"),
        ]
    num_streamed = sum(len(ring.streamed) for ring in plan.rings)
    own = sum(1 for ring in plan.rings for layer in ring.streamed if layer.owns_slot)
    slots = "/".join(str(r.num_slots) for r in plan.rings)
    totals = [
        ("streamed layers", f"{num_streamed} of {num_layers}, longest run {plan.longest_run} ({_choice(plan)})"),
        ("resident bytes", size(plan.resident_bytes)),
        ("pool bytes", f"{size(plan.pool_bytes)} ({slots} slots)"),
        (
            "device bytes",
            f"{size(plan.device_bytes)} (resident + pool{' + expert cache' if plan.cache_bytes else ''})",
        ),
    ]
    unsaved = no_saving(plan)
    if unsaved is not None:
        totals.append(("saves nothing", unsaved))
    pinned = size(plan.host_bytes)
    values, encoded = plan.compressed_bytes
    if values:
        totals.append(
            (
                "compressed",
                f"{size(values)} of weights kept as {size(encoded)} ({encoded / values:.1%}), decoded on the device "
                f"from a staging buffer per slot ({size(plan.pool_bytes - _plain_pool(plan))} of the pool)",
            )
        )
    if (nothing := compresses_nothing(plan)) is not None:
        totals.append(("compressed", f"nothing: {nothing}"))
    elif plan.kept_plain:  # some are: as expected (norms, biases), shown without a warning
        reasons = "; ".join(f"{count} {why}" for why, count in plan.kept_plain.items())
        totals.append(("kept plain", f"{sum(plan.kept_plain.values())} streamed tensors: {reasons}"))
    for index, budget in plan.gpus:  # pipeline placement: each GPU's layers, bytes and budget
        rings = [ring for ring in plan.rings if ring.device == index]
        indices = [layer.index for ring in rings for layer in ring.layers]
        resident, pool = plan.gpu_bytes(index)
        streams = sum(ring.bytes_per_forward for ring in rings)
        spare = budget.device_bytes - budget.reserve_bytes - resident - pool
        totals.append(
            (
                f"cuda:{index}",
                f"layers {min(indices)}-{max(indices)}: resident {size(resident)}, pool {size(pool)}, streams "
                f"{size(streams)} per forward; budget {size(budget.device_bytes)} ({budget.source}), {size(spare)} "
                "spare",
            )
        )
    if plan.gpus and plan.gpus[0][1].host_bytes is not None:
        pinned += f" of {size(plan.gpus[0][1].host_bytes)} (max_memory['cpu'])"
    if (budget := plan.budget) is not None and not plan.gpus:
        spare = budget.device_bytes - budget.reserve_bytes - plan.device_bytes
        reserve = f"{size(budget.reserve_bytes)} reserved for activations and the KV cache"
        totals.append(
            ("device budget", f"{size(budget.device_bytes)} ({budget.source}): {reserve}, {size(spare)} spare")
        )
        if budget.host_bytes is not None:
            pinned += f" of {size(budget.host_bytes)} (max_memory['cpu'])"
    totals.append(("pinned host bytes", pinned))
    totals += file_lines(plan)
    per_forward = size(plan.streamed_bytes_per_forward)
    if own:
        per_forward += f" ({own} layer{'s own' if own > 1 else ' owns'} a slot: copied once)"
    totals.append(("streamed per forward", per_forward))
    if plan.links:
        share = size(plan.streamed_bytes_per_forward // plan.num_links)
        first, *others = plan.links
        totals.append(
            (
                f"cuda:{first}",
                f"resident {size(plan.resident_bytes)}, pool {size(plan.pool_bytes)}; its link copies {share} per "
                "forward into the slots",
            )
        )
        for index in others:
            passed = f"passed on to cuda:{first} over the peer link"
            totals.append((f"cuda:{index}", f"staging {size(plan.staging_bytes)}; its link copies {share}, {passed}"))
    totals += rank_totals(plan.ranks)
    if plan.link_gbps is not None:
        seconds = plan.transfer_seconds_per_forward
        speed = (
            f"{plan.link_gbps:.1f} GB/s" if plan.num_links == 1 else f"{plan.num_links} x {plan.link_gbps:.1f} GB/s"
        )
        totals.append(("transfer per forward", f"{seconds * 1e3:.2f} ms at {speed}"))
    if plan.routed_bytes and plan.routed_max_tokens == 0:
        totals.append(
            ("routed experts", f"{size(plan.routed_bytes)}, copied whole in every forward (routed_max_tokens=0)")
        )
    elif plan.routed_bytes:
        routings = {spec.routing for ring in plan.rings for layer in ring.layers for spec in layer.routed}
        picks = ", ".join(sorted({f"{r.top_k or '?'} of {r.num_experts}" for r in routings}))
        limit = plan.routed_max_tokens
        when = f"at most {limit} token{'s' if limit != 1 else ''}"
        when += " (the break-even point)" if plan.config.routed_max_tokens is None else ""
        per_token = f"{size(plan.streamed_bytes_per_token)} (routed experts: {picks} per token)"
        if plan.link_gbps is not None:
            per_token += f", {plan.streamed_bytes_per_token / (plan.link_gbps * 1e9) * 1e3:.2f} ms"
        if plan.host_always:
            how = "computed on the host's cores in every forward (cpu_experts=True), except in layers alone in a slot"
        else:
            how = f"copied expert by expert in forwards of {when}"
        totals.append(("routed experts", f"{size(plan.routed_bytes)}, {how}"))
        if plan.cache_bytes:
            cached = min(plan.cached_experts, max(r.num_experts for r in routings))
            totals.append(
                ("expert cache", f"{size(plan.cache_bytes)} on the device: {cached} experts per routed layer")
            )
        fetching = [layer for ring in plan.rings for layer in ring.streamed if caches_experts(layer)]
        fetching = [] if plan.host_always else fetching  # no recent picks to fetch
        recent = getattr(plan.config, "recent_experts", None)
        if fetching and recent is not False and plan.routed_max_tokens > 0:
            layers = f"{len(fetching)} layer{'s' if len(fetching) != 1 else ''}"
            what = (
                f"{layers} fetch the experts they picked in their previous forward with their copy"
                if recent
                else f"{layers} measure whether fetching the experts they picked in their previous forward with "
                "their copy pays, and fetch them where it does"
            )
            totals.append(("recent experts", what))
        totals.append(("streamed per token", per_token))
    totals += host_lines(plan.rings, plan.host_compute)
    return totals


def render_text(plan: OffloadPlan) -> str:
    """The plan as a fixed-width table: one row per layer, then the totals."""
    widths = (32, 13, 11, 11, 4, 5)
    rows = [[layer_row for layer_row in (_layer_row(ring, layer) for layer in ring.layers)] for ring in plan.rings]

    def line(cells: Sequence[str]) -> str:
        first, placement, *numbers = cells
        right = " ".join(f"{cell:>{width}}" for cell, width in zip(numbers, widths[2:], strict=True))
        return f"{first:<{widths[0]}} {placement:<{widths[1]}} {right}".rstrip()

    text = [line(_HEADER)] + [line(row) for ring_rows in rows for row in ring_rows] + [""]
    text += [f"{label:<22} {value}" for label, value in _totals(plan)]
    return "\n".join(text)


def render_html(plan: OffloadPlan) -> str:
    """The plan as two HTML tables (Jupyter's rich display)."""
    head = "".join(f"<th>{cell}</th>" for cell in _HEADER)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in _layer_row(ring, layer)) + "</tr>"
        for ring in plan.rings
        for layer in ring.layers
    )
    totals = "".join(
        f"<tr><th>{html.escape(label)}</th><td>{html.escape(value)}</td></tr>" for label, value in _totals(plan)
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table><table><tbody>{totals}</tbody></table>"
