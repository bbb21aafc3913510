"""Routed experts computed on the host's cores (`PrefetchConfig(cpu_experts=...)`): which layers do, the share of
their picks, the checks made before anything moves, and the speeds `"auto"` splits by.

A token needs each routed expert's bytes once: read by the host's cores from host memory, or copied over the link and
read by the GPU. Both read host memory, so beside each other each runs slower than alone; `"auto"` measures them
beside each other (`measure_host_speeds`) and gives the host the share of the picked experts that makes both finish
together: `share = host / (host + link)`. The runtime side is runtime/host_experts.py ([Note: experts on the host]).
"""

from __future__ import annotations

import inspect
import time
from dataclasses import replace

import torch
from torch import nn

from .offload_plan import OffloadPlan
from .placements import HostCompute, LayerPlan, Routing, host_layers

__all__ = [
    "HOST_DTYPES",
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


def split_share(host_gbps: float, link_gbps: float) -> float:
    """The share of the picked experts the host computes so that both sides finish together."""
    return host_gbps / (host_gbps + link_gbps)


def plan_host_compute(model: nn.Module, plan: OffloadPlan, device: torch.device) -> OffloadPlan:
    """`plan` with its `host_compute` for `PrefetchConfig.cpu_experts` (unchanged where it is False): checks every
    experts module of `host_layers(plan)` can run on the host and, for `"auto"` on a GPU, measures the speeds the
    split follows. Raises ValueError naming the module and the fix before anything moves."""
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
    return replace(plan, host_compute=HostCompute(False, share, host_gbps, link_gbps))


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
    elif not host_layers(plan.rings):
        why = (
            "no streamed layer has routed experts that take turns in a slot (routed layers alone in their slot "
            "keep their experts on the device)"
        )
    elif mode == "auto" and plan.routed_max_tokens == 0:
        why = 'with routed_max_tokens=0 no forward routes, and "auto" splits only forwards that route'
    else:
        return None
    return f"PrefetchConfig(cpu_experts={mode!r}) computes nothing on the host in this plan: {why}. Drop cpu_experts."


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
