"""Routed experts computed on the host's cores (`PrefetchConfig(cpu_experts=...)`): which layers do, the checks
made before anything moves, what `"auto"` splits by, and the rules of a forward's split (which picks, which inputs)
that the runtime applies.

A token needs each routed expert's bytes once: read by the host's cores from host memory, or copied over the link and
read by the GPU. Both read host memory, so beside each other each runs slower than alone; `"auto"` measures them
beside each other (`measure_host_speeds`: `share = host / (host + link)`), then times the experts module's own
forward on a twin of it, one token through 1 .. top_k experts, beside pinned copies (`measure_host_times`): its fixed
cost included, these times decide each forward's split (`host_split.HostCompute.count`). The runtime side is
runtime/host_experts.py ([Note: experts on the host]).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import statistics
import time
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from ..config import warn_at_caller
from .host_split import HostCompute, never_splits
from .offload_plan import OffloadPlan
from .placements import INNER_SEP, LayerPlan, Routing, host_layers

__all__ = [
    "HOST_DTYPES",
    "HOST_IMPLEMENTATION",
    "host_twin",
    "measure_host_times",
    "pick_host_experts",
    "split_inputs",
    "plan_host_compute",
    "measure_host_speeds",
    "split_share",
    "host_unused",
]

HOST_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""Expert weights the host computes from: plain floating tensors, read by torch's CPU matmuls."""

# transformers' experts implementations that run on CPU tensors (`@use_experts_implementation`; None: a module
# without the decorator, its own forward). Others (deepgemm, sonicmoe) are CUDA kernels.
_HOST_IMPLEMENTATIONS = (None, "eager", "grouped_mm", "batched_mm")

SPEED_BYTES = 128 * 2**20
"""Expert bytes each side moves per timed round when `"auto"` measures the host's and the link's speeds."""


HOST_IMPLEMENTATION = "grouped_mm"
"""The experts implementation a twin beside a GPU computes with, where the experts module takes one: of transformers'
three, the fastest measured on the host ([Note: experts on the host], step 4)."""

# transformers' implementations a module with `@use_experts_implementation` takes on the host.
_SETTABLE = ("eager", "grouped_mm", "batched_mm")


def split_share(host_gbps: float, link_gbps: float) -> float:
    """The share of the picked experts the host computes so that both sides finish together."""
    return host_gbps / (host_gbps + link_gbps)


def plan_host_compute(model: nn.Module, plan: OffloadPlan, device: torch.device) -> OffloadPlan:
    """`plan` with its `host_compute` for `PrefetchConfig.cpu_experts` (unchanged where it is False): checks every
    experts module of `host_layers(plan)` can run on the host and, for `"auto"` on a GPU, measures the speeds and the
    host's times the split follows. Raises ValueError naming the module and the fix before anything moves."""
    mode = getattr(plan.config, "cpu_experts", False)
    if mode is False or plan.backend != "prefetch":
        return plan
    given = f"PrefetchConfig(cpu_experts={mode!r})"
    if not any(spec.routing is not None for ring in plan.rings for layer in ring.layers for spec in layer.params):
        raise ValueError(
            f"{given}: the model has no routed experts (no mixture-of-experts experts module that hf_prefetch "
            "streams expert by expert was found in its layer lists). Drop cpu_experts."
        )
    if plan.links or plan.gpus:
        raise ValueError(
            f"{given} computes experts beside one GPU's link; with links= or a max_memory naming several GPUs it is "
            "not supported yet. Drop cpu_experts, or dispatch to one GPU."
        )
    layers = host_layers(plan.rings)
    for layer in layers:
        for routing in dict.fromkeys(spec.routing for spec in layer.routed):
            _check_module(model, layer, routing, given)
    if not layers or (mode == "auto" and plan.routed_max_tokens == 0):
        return plan  # nothing computes on the host (`host_unused` says why)
    if mode is True:
        # Their bytes never cross the link: no expert cache to fill.
        return replace(plan, host_compute=HostCompute(always=True, share=1.0), cached_experts=0)
    if device.type != "cuda":
        return replace(plan, host_compute=HostCompute(always=False, share=1.0))  # no link: all on the host
    spec = max(layers[0].routed, key=lambda s: s.nbytes)
    shapes = [tuple(s.shape[1:]) for s in layers[0].routed]
    try:
        host_gbps, link_gbps = measure_host_speeds(device, shapes, spec.dtype)
    except torch.cuda.OutOfMemoryError:  # a device too full for the measurement's buffer: a smaller one
        host_gbps, link_gbps = measure_host_speeds(device, shapes, spec.dtype, SPEED_BYTES // 8)
    share = split_share(host_gbps, link_gbps)
    routing = layers[0].routed[0].routing
    measured = measure_host_times(model, layers[0], routing, device)
    if measured is None:  # no input width runs the module (a warning said why): each forward's count follows the share
        return replace(plan, host_compute=HostCompute(False, share, host_gbps, link_gbps))
    times, sync, row_bytes = measured
    return replace(plan, host_compute=HostCompute(False, share, host_gbps, link_gbps, times, sync, row_bytes))


def host_unused(plan: OffloadPlan) -> str | None:
    """Why `cpu_experts` computes nothing on the host in `plan` (None where it does)."""
    mode = getattr(plan.config, "cpu_experts", False)
    if mode is False or plan.backend != "prefetch":
        return None
    if not plan.routed_bytes:
        why = (
            "no streamed parameter is routed (PrefetchConfig(routed_experts=False) streams expert tensors whole, "
            "or no experts module streams)"
        )
    elif not (computing := host_layers(plan.rings)) and any(
        layer.experts_from_files for ring in plan.rings for layer in ring.streamed
    ):
        why = (
            "the routed experts of every streamed layer that could compute them on the host are read from the "
            "checkpoint's files (they do not fit max_memory['cpu']), and the host computes only experts it holds "
            "in pinned memory (raise max_memory['cpu'] to pin them)"
        )
    elif not computing:
        why = (
            "no streamed layer has routed experts that take turns in a slot (routed layers alone in their slot "
            "keep their experts on the device)"
        )
    elif mode == "auto" and plan.routed_max_tokens == 0:
        why = 'with routed_max_tokens=0 no forward routes, and "auto" splits only forwards that route'
    elif mode == "auto" and never_splits(plan.rings, plan.host_compute, plan.routed_max_tokens):
        why = (
            "by the host's times measured beside this link, no forward that routes finishes sooner with the host's "
            "help, so every pick crosses the link (the plan's 'experts on host' line gives the times)"
        )
    else:
        return None
    return f"PrefetchConfig(cpu_experts={mode!r}) computes nothing on the host in this plan: {why}. Drop cpu_experts."


def measure_host_times(
    model: nn.Module, layer: LayerPlan, routing: Routing, device: torch.device, rounds: int = 3
) -> tuple[tuple[float, ...], float, int] | None:
    """The host's seconds of one token through k = 1 .. top_k distinct experts of `layer`'s experts module (the median
    of `rounds`, while pinned copies run to `device` as a split's copies do), the seconds a split adds (the router's
    choice read on the host, its picks split), and one expert's bytes; None where no input width found among the
    config's `hidden_size` and the parameters' dimensions runs the module (the split then follows the share).

    Measured on a twin of the module (its class, its forward, the host's experts implementation) whose parameters are
    fresh host tensors of the stored shapes and dtypes, of which only the experts timed are written (the others stay
    untouched virtual memory): the model's own weights may still be on the meta device, and nothing of it changes."""
    module = model.get_submodule(f"{layer.path}.{routing.module}")
    specs = {s.name.partition(INNER_SEP)[0]: s for s in layer.routed if s.routing == routing}
    top_k = min(routing.top_k or 8, routing.num_experts)  # unknown: 8 timed, the rest extended
    used = min(2 * top_k, routing.num_experts)  # two sets of experts taken in turns: read from memory, not caches
    params = {}
    for name, _ in module.named_parameters():
        spec = specs[f"{routing.module}.{name}"]
        params[name] = torch.empty(spec.shape, dtype=spec.dtype)
        params[name][:used].fill_(0.01)
    row_bytes = sum(t.nbytes for t in params.values()) // routing.num_experts
    twin = host_twin(module, params, HOST_IMPLEMENTATION)
    forward = type(module).forward
    dtype = next(iter(params.values())).dtype
    hidden = _input_of(twin, forward, module, params, top_k, dtype)
    if hidden is None:
        return None
    cuda = device.type == "cuda"  # on another device the same forwards, without copies beside them
    if cuda:
        pinned = torch.empty(64 * 2**20, dtype=torch.uint8, pin_memory=True)
        try:
            dest = torch.empty(pinned.shape, dtype=torch.uint8, device=device)
        except torch.cuda.OutOfMemoryError:  # a device too full: copies of a smaller buffer, as many more of them
            pinned = pinned[: 8 * 2**20]
            dest = torch.empty(pinned.shape, dtype=torch.uint8, device=device)
        stream = torch.cuda.Stream(device)
        copies = 8
    times, turn = [], 0
    with torch.no_grad(), torch.cuda.device(device) if cuda else contextlib.nullcontext():
        for k in range(1, top_k + 1):
            seconds = []
            for _ in range(rounds + 1):  # the first round warms the kernels up
                first = (turn % 2) * top_k if used >= 2 * top_k else 0
                turn += 1
                experts = [first + j for j in range(k)]
                index = torch.tensor([experts + experts[:1] * (top_k - k)])
                weights = torch.tensor([[1.0 / k] * k + [0.0] * (top_k - k)], dtype=dtype)
                if cuda:
                    with torch.cuda.stream(stream):
                        for _ in range(copies):  # the link busy throughout the forward
                            dest.copy_(pinned, non_blocking=True)
                begin = time.perf_counter()
                forward(twin, hidden, index, weights)
                seconds.append(time.perf_counter() - begin)
                if cuda:
                    stream.synchronize()
            times.append(statistics.median(seconds[1:]))
            if cuda:  # enough copies to outlast the next k's forwards at a fast link's speed (64 GB/s)
                copies = max(8, int(2 * (times[-1] + times[-1] / k) * 64e9 / pinned.numel()) + 1)
        index = torch.tensor([list(range(top_k))], device=device)
        syncs = []
        for _ in range(rounds + 1):  # the first round allocates the pinned buffer the others reuse
            begin = time.perf_counter()
            index_h = index
            if cuda:
                torch.cuda.current_stream(device).synchronize()
                index_h = torch.empty(index.shape, dtype=index.dtype, pin_memory=True).copy_(index, non_blocking=True)
                torch.cuda.current_stream(device).synchronize()
            on_host = pick_host_experts(index_h, routing.num_experts, lambda n: n // 2)
            split_inputs(index_h, torch.ones(index_h.shape), on_host, routing.num_experts)
            syncs.append(time.perf_counter() - begin)
    return tuple(times), statistics.median(syncs[1:]), row_bytes


def _input_of(twin, forward, module, params, top_k, dtype) -> torch.Tensor | None:
    # One token's input to the experts module: of the widths the config's `hidden_size` and the parameters'
    # dimensions offer, the first the module's forward takes (experts that compute in a latent width take that).
    config = getattr(module, "config", None)
    widths = [int(getattr(config, "hidden_size", 0) or 0)]
    widths += sorted({size for t in params.values() for size in t.shape[1:]}, reverse=True)
    index = torch.zeros((1, top_k), dtype=torch.long)
    weights = torch.full((1, top_k), 1.0 / top_k, dtype=dtype)
    first = None
    with torch.no_grad():
        for width in dict.fromkeys(w for w in widths if w > 0):
            hidden = torch.full((1, width), 0.5, dtype=dtype)
            try:
                out = forward(twin, hidden, index, weights)
            except (RuntimeError, ValueError, IndexError) as error:  # a shape the module's matrices do not take
                first = first or error
                continue
            if isinstance(out, torch.Tensor) and out.shape[-1] == width:
                return hidden
    warn_at_caller(
        f'PrefetchConfig(cpu_experts="auto") could not time the host\'s forward of {type(module).__name__} on one '
        f"token of any width among {list(dict.fromkeys(w for w in widths if w > 0))} ({first!r}): each forward's "
        "split follows the host's and the link's speeds instead of the host's times."
    )
    return None


def host_twin(module: nn.Module, host_params: dict[str, torch.Tensor], implementation: str | None = None) -> nn.Module:
    """A copy of the experts module (same class, same attributes) whose parameters are the host tensors and whose
    buffers are host copies, with no hooks: the model's module keeps its slot buffers and its hooks. With
    `implementation`, a module that takes one of transformers' experts implementations computes with it, from a
    configuration of its own (a shallow copy); otherwise the twin shares the module's configuration."""
    twin = module.__class__.__new__(module.__class__)
    state = {k: v for k, v in module.__dict__.items() if k not in ("forward", "_hf_hook", "_old_forward")}
    twin.__dict__.update(copy.copy(state))
    for name in list(twin.__dict__):
        if name.startswith("_") and name.endswith("hooks") and isinstance(twin.__dict__[name], dict):
            twin.__dict__[name] = type(twin.__dict__[name])()  # no torch hooks of the model's module
    twin._parameters = {name: nn.Parameter(tensor, requires_grad=False) for name, tensor in host_params.items()}
    twin._buffers = {
        name: torch.zeros(b.shape, dtype=b.dtype) if b.is_meta else b.detach().to("cpu", copy=True)
        for name, b in module._buffers.items()
        if b is not None
    }
    twin._modules = dict(module._modules)  # parameterless (an activation): experts modules own every parameter
    config = getattr(module, "config", None)
    if implementation is not None and getattr(config, "_experts_implementation", None) in _SETTABLE:
        twin.config = copy.copy(config)
        twin.config._experts_implementation = implementation
    return twin


def pick_host_experts(index: torch.Tensor, num_experts: int, count: Callable[[int], int]) -> set[int]:
    """Which picked experts the host computes ([Note: experts on the host] in runtime/host_experts.py, step 2): of
    the n distinct experts in `index` (a host tensor), `count(n)` of them, those picked by the fewest tokens, ties to
    the highest index."""
    flat = [e for e in index.reshape(-1).tolist() if 0 <= e < num_experts]
    counts: dict[int, int] = {}
    for expert in flat:
        counts[expert] = counts.get(expert, 0) + 1
    return set(sorted(counts, key=lambda e: (counts[e], -e))[: count(len(counts))])


Side = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def split_inputs(
    index: torch.Tensor, weights: torch.Tensor, on_host: set[int], num_experts: int
) -> tuple[Side | None, Side | None]:
    """For host tensors `index` and `weights` (tokens, top_k): each side's (rows, index, weights), the rows being the
    tokens with a pick on that side, the other side's picks replaced by one of the token's picks on this side with
    weight 0 (None for a side with no pick)."""
    host_mask = torch.isin(index, torch.tensor(sorted(on_host), dtype=index.dtype))
    valid = (index >= 0) & (index < num_experts)
    device_mask = valid & ~host_mask
    return _side(index, weights, host_mask), _side(index, weights, device_mask)


def _side(index: torch.Tensor, weights: torch.Tensor, mine: torch.Tensor):
    rows = mine.any(dim=-1).nonzero().reshape(-1)
    if rows.numel() == 0:
        return None
    index, weights, mine = index[rows], weights[rows], mine[rows]
    first = mine.to(torch.int8).argmax(dim=-1, keepdim=True)  # a pick of this side in each row
    filler = index.gather(-1, first).expand_as(index)
    return rows, torch.where(mine, index, filler), torch.where(mine, weights, torch.zeros_like(weights))


def _check_module(model: nn.Module, layer: LayerPlan, routing: Routing, given: str) -> None:
    path = f"{layer.path}.{routing.module}"
    module = model.get_submodule(path)
    routed = {spec.name for spec in layer.routed if spec.routing == routing}
    for name, param in module.named_parameters():
        full = f"{routing.module}.{name}"
        spec = next((s for s in layer.params if s.name.partition(":")[0] == full), None)
        if spec is not None and spec.inner:
            raise ValueError(
                f"{given}: {path}.{name} is stored as a quantized tensor subclass ({type(param).__name__}), which has "
                "no host kernel here. Load the experts unquantized (bf16), or drop cpu_experts."
            )
        if full not in routed:
            raise ValueError(
                f"{given}: {path}.{name} stays on the device (PrefetchConfig.offload_params leaves it out), and the "
                f"host computes {path} from host memory. Offload all of its tensors (offload_params=['experts'] or "
                "empty), or drop cpu_experts."
            )
        if param.dtype not in HOST_DTYPES and param.dtype.is_floating_point and param.dtype.itemsize > 1:
            raise ValueError(
                f"{given}: {path}.{name} is stored as {param.dtype}; the host computes from bf16, fp16 or fp32 "
                "weights. Cast the model (e.g. model.to(torch.bfloat16)), or drop cpu_experts."
            )
        if param.dtype not in HOST_DTYPES:
            raise ValueError(
                f"{given}: {path}.{name} is stored as {param.dtype} ({_format_of(module, param)}), which has no host "
                "kernel here: the host computes from bf16, fp16 or fp32 weights. Load the experts dequantized, or "
                "drop cpu_experts."
            )
    implementation = getattr(getattr(module, "config", None), "_experts_implementation", None)
    if implementation not in _HOST_IMPLEMENTATIONS:
        raise ValueError(
            f"{given}: {path} runs experts_implementation={implementation!r}, a CUDA kernel that cannot compute on "
            "the host. Load with experts_implementation='grouped_mm' (or 'eager'), or drop cpu_experts."
        )
    names = list(inspect.signature(type(module).forward).parameters)[1:]
    if len(names) != 3 or names[1] != routing.index_arg:
        raise ValueError(
            f"{given}: {path}'s forward takes ({', '.join(names)}); the host computes experts modules called as "
            f"(hidden_states, {routing.index_arg}, routing weights), as transformers' are. Drop cpu_experts."
        )


def _format_of(module: nn.Module, param: torch.Tensor) -> str:
    names = [n for n, _ in module.named_parameters()]
    if any(n.endswith("_blocks") for n in names) and any(n.endswith("_scales") for n in names):
        return "MXFP4 blocks and scales"
    if param.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return "FP8"
    return "a packed or quantized format"


def measure_host_speeds(
    device: torch.device, shapes: list[tuple[int, ...]], dtype: torch.dtype, nbytes: int = SPEED_BYTES
) -> tuple[float, float]:
    """(host, link) in GB/s beside each other, measured now: the host's matmuls of one token through expert matrices
    of `shapes` and `dtype` (about `nbytes` of them, each read once a round) while pinned copies of as many bytes
    run to `device` on a stream of their own, for as long as the host's rounds take."""
    matrices = [(s[0], max(1, torch.Size(s[1:]).numel())) for s in shapes if len(s) >= 1]
    one = sum(rows * cols for rows, cols in matrices) * dtype.itemsize
    copies = max(1, nbytes // max(one, 1))
    weights = [torch.full(s, 0.01, dtype=dtype) for _ in range(copies) for s in matrices]
    inputs = {s[1]: torch.full((1, s[1]), 0.5, dtype=dtype) for s in matrices}
    nbytes = sum(w.numel() for w in weights) * dtype.itemsize

    def host_round() -> float:
        begin = time.perf_counter()
        for w in weights:
            torch.nn.functional.linear(inputs[w.shape[1]], w)
        return time.perf_counter() - begin

    host_round()  # warm-up
    rounds = 3
    alone = host_round()
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dest = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)
    with torch.cuda.device(device):
        dest.copy_(pinned, non_blocking=True)
        torch.cuda.synchronize(device)
        # Enough copies to last the host's rounds at a fast link's speed (64 GB/s), so that both run throughout.
        count = max(rounds, int(rounds * alone * 64e9 / nbytes) + 1)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            begin.record()
            for _ in range(count):
                dest.copy_(pinned, non_blocking=True)
            end.record()
        host = sorted(host_round() for _ in range(rounds))[rounds // 2]
        end.synchronize()
        link = begin.elapsed_time(end) / 1e3 / count
    return nbytes / host / 1e9, nbytes / link / 1e9
