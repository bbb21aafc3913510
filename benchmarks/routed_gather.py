"""How fast the GPU gathers routed experts' rows from pinned host memory, by the element width of the read. GPU only.

One Qwen3-30B-A3B-shaped experts module (128 experts; gate_up_proj [128, 1536, 2048] and down_proj [128, 2048, 768],
bf16) sits in a pinned `HostArena`. A decode token's gather (`hf_prefetch.runtime.experts.copy_routed_rows`) reads the
8 picked experts' rows through the arena's mapped (UVA) view with `index_select`, a kernel whose loads cross the bus:
its rate depends on how wide each load is. The rows are read as bf16 (2-byte loads) and reinterpreted as int32, int64
and 16-byte elements; the expert cache's Triton gather reads them as int64, with no pick cached and with half of them
cached (GB/s: of the bytes that crossed the bus); the copy engine's rate (8 host-indexed row copies, one batched
call of them, and the whole tensors) is the reference. End to end after a router-sized matmul: the device-selected
gather against host-selected copies, which wait for the picks to reach the host first.

    python benchmarks/routed_gather.py [--picks 8] [--repeats 20]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import device_seconds  # noqa: E402

from hf_prefetch.host.arena import HostArena  # noqa: E402

EXPERTS = 128
SHAPES = {"gate_up_proj": (EXPERTS, 1536, 2048), "down_proj": (EXPERTS, 2048, 768)}


def _contiguous_stride(shape):
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--picks", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    sizes = [torch.Size(s).numel() * 2 for s in SHAPES.values()]
    arena = HostArena(sizes)
    with torch.cuda.device(device):
        assert arena.pin()
        mapped = arena.map(device)
    hosts, sources, slots = {}, {}, {}
    for index, (name, shape) in enumerate(SHAPES.items()):
        hosts[name] = arena.view(index, shape, _contiguous_stride(shape), torch.bfloat16)
        hosts[name].copy_(torch.randn(shape, dtype=torch.bfloat16))
        sources[name] = arena.view(index, shape, _contiguous_stride(shape), torch.bfloat16, base=mapped)
        slots[name] = torch.empty(shape, dtype=torch.bfloat16, device=device)
    picks = torch.randperm(EXPERTS)[: args.picks]
    rows = picks.to(device)
    row_bytes = sum(s // EXPERTS for s in sizes)
    moved = args.picks * row_bytes
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{args.picks} of {EXPERTS} experts, {moved / 1e6:.1f} MB per gather, median of {args.repeats}")
    print(f"{'read as':<34} {'ms':>7} {'GB/s':>7}  identical")

    def gather(dtype):
        for name in SHAPES:
            src = sources[name].view(EXPERTS, -1).view(dtype)
            dst = slots[name].view(EXPERTS, -1).view(dtype)
            dst.index_copy_(0, rows, src.index_select(0, rows))

    def check() -> bool:
        return all(torch.equal(slots[n][rows].cpu(), hosts[n][picks]) for n in SHAPES)

    for label, dtype in (
        ("bf16 (2-byte loads)", torch.bfloat16),
        ("int32 (4-byte loads)", torch.int32),
        ("int64 (8-byte loads)", torch.int64),
        ("complex128 (16-byte loads)", torch.complex128),
    ):
        for slot in slots.values():
            slot.zero_()
        seconds = device_seconds(lambda dtype=dtype: gather(dtype), args.repeats)
        print(f"{'UVA index_select, ' + label:<34} {seconds * 1e3:>7.3f} {moved / seconds / 1e9:>7.1f}  {check()}")

    # The expert cache's gather (`hf_prefetch.runtime.experts.gather_looked_up`): one Triton kernel per tensor reads
    # each picked row from the cache when the lookup table has it, else from the mapped view. With no row cached it
    # moves the same bytes as index_select; with half the picks cached, half of them cross the bus.
    from hf_prefetch.runtime.expert_kernels import TALLIES, gather_kernel

    launch = gather_kernel()
    capacity = args.picks
    caches = {n: hosts[n][picks].to(device).view(capacity, -1).view(torch.int64) for n in SHAPES}
    tallies = torch.zeros(TALLIES, dtype=torch.long, device=device)
    counts = torch.zeros(EXPERTS, dtype=torch.long, device=device)
    for cached_picks in (0, args.picks // 2):
        slot_of = torch.full((EXPERTS,), -1, dtype=torch.long, device=device)
        slot_of[rows[:cached_picks]] = torch.arange(cached_picks, device=device)

        def kernel(slot_of=slot_of):
            for number, name in enumerate(SHAPES):
                src = sources[name].view(EXPERTS, -1).view(torch.int64)
                dst = slots[name].view(EXPERTS, -1).view(torch.int64)
                launch(rows, None, None, slot_of, src, caches[name], dst, counts, tallies, count=number == 0)

        for slot in slots.values():
            slot.zero_()
        seconds = device_seconds(kernel, args.repeats)
        crossed = moved * (args.picks - cached_picks) / args.picks
        label = f"Triton gather, {cached_picks}/{args.picks} cached"
        print(f"{label:<34} {seconds * 1e3:>7.3f} {crossed / seconds / 1e9:>7.1f}  {check()}")

    # Fetching a layer's recent picks ahead (`hf_prefetch.runtime.experts.fetch_recent`): a kernel of few programs on
    # the copy stream, each taking turns over the rows' blocks, so that the compute stream's kernels find SMs
    # meanwhile.
    from hf_prefetch.runtime.expert_kernels import fetch_kernel

    fetch = fetch_kernel()
    ready = torch.zeros(EXPERTS, dtype=torch.int32, device=device)
    chosen = torch.full((EXPERTS,), -1, dtype=torch.long, device=device)
    marked = torch.zeros(EXPERTS, dtype=torch.int32, device=device)
    enabled = torch.ones(1, dtype=torch.int32, device=device)  # the policy fetches
    pairs = [
        (sources[name].view(EXPERTS, -1).view(torch.int64), slots[name].view(EXPERTS, -1).view(torch.int64))
        for name in SHAPES
    ]
    for programs in (16, 32, 64, 132, 264):

        def fetched(programs=programs):  # both tensors: the choice, then one copy kernel
            fetch(rows, None, chosen, ready, marked, enabled, pairs, tallies, programs=programs)

        for slot in slots.values():
            slot.zero_()
        seconds = device_seconds(fetched, args.repeats)
        label = f"fetch ahead, {programs} programs"
        print(f"{label:<34} {seconds * 1e3:>7.3f} {moved / seconds / 1e9:>7.1f}  {check()}")

    def engine_rows():
        for name in SHAPES:
            for expert in picks.tolist():
                slots[name][expert].copy_(hosts[name][expert], non_blocking=True)

    seconds = device_seconds(engine_rows, args.repeats)
    print(f"{'copy engine, one copy per row':<34} {seconds * 1e3:>7.3f} {moved / seconds / 1e9:>7.1f}  {check()}")

    def engine_whole():
        for name in SHAPES:
            slots[name].copy_(hosts[name], non_blocking=True)

    seconds = device_seconds(engine_whole, max(3, args.repeats // 4))
    whole = sum(sizes)
    print(f"{'copy engine, whole tensors':<34} {seconds * 1e3:>7.3f} {whole / seconds / 1e9:>7.1f}")

    # Host-selected copies need the router's picks on the host: the end-to-end time of a decode layer's copies is the
    # picks' trip to the host (a synchronisation) plus the copies, against the device-selected gather that reads the
    # picks where the router wrote them. The copies as one row copy each, or as one batched call
    # (cudaMemcpyBatchAsync, CUDA 12.8+), which the driver may spread over several copy engines.
    batch = _memcpy_batch()
    side = torch.cuda.Stream(device)

    def batched(experts: list[int]):
        dsts = [slots[n][e].data_ptr() for n in SHAPES for e in experts]
        srcs = [hosts[n][e].data_ptr() for n in SHAPES for e in experts]
        lengths = [slots[n][e].nbytes for n in SHAPES for e in experts]
        batch(dsts, srcs, lengths, side.cuda_stream, device.index)

    if batch is not None:
        for slot in slots.values():
            slot.zero_()
        with torch.cuda.stream(side):
            seconds = device_seconds(lambda: batched(picks.tolist()), args.repeats)
        print(f"{'copy engine, one batched call':<34} {seconds * 1e3:>7.3f} {moved / seconds / 1e9:>7.1f}  {check()}")
    else:
        print("copy engine, one batched call: cudaMemcpyBatchAsync not found in this CUDA runtime")

    def host_selected(copy):
        def run():
            experts = rows.tolist()  # waits for the device: the router's picks come back to the host
            copy(experts)

        return run

    def per_row(experts: list[int]):
        for name in SHAPES:
            for expert in experts:
                slots[name][expert].copy_(hosts[name][expert], non_blocking=True)

    def device_selected():
        for number, name in enumerate(SHAPES):
            src = sources[name].view(EXPERTS, -1).view(torch.int64)
            dst = slots[name].view(EXPERTS, -1).view(torch.int64)
            launch(rows, None, None, none_cached, src, caches[name], dst, counts, tallies, count=number == 0)

    none_cached = torch.full((EXPERTS,), -1, dtype=torch.long, device=device)
    router = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    ends = [
        ("device-selected: Triton gather", device_selected),
        ("host-selected: picks, row copies", host_selected(per_row)),
    ]
    if batch is not None:
        ends.append(("host-selected: picks, batched call", lambda: _on(side, host_selected(batched))))
    for label, copies in ends:
        for slot in slots.values():
            slot.zero_()

        def layer(copies=copies):  # a router-sized matmul, then the layer's copies after its picks
            router @ router
            copies()

        seconds = device_seconds(layer, args.repeats) - device_seconds(lambda: router @ router, args.repeats)
        print(f"{label + ', end to end':<34} {seconds * 1e3:>7.3f} {moved / seconds / 1e9:>7.1f}  {check()}")


def _on(stream: torch.cuda.Stream, run) -> None:
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)


def _memcpy_batch():
    """cudaMemcpyBatchAsync of the CUDA runtime torch loaded, as `call(dsts, srcs, sizes, stream, device)` (host to
    device, stream order), or None where the runtime lacks it (before CUDA 12.8)."""
    import ctypes

    path = next((line.split()[-1] for line in open("/proc/self/maps") if "libcudart.so" in line), None)
    if path is None:
        return None
    runtime = ctypes.CDLL(path)
    if not hasattr(runtime, "cudaMemcpyBatchAsync"):
        return None
    version = ctypes.c_int()
    runtime.cudaRuntimeGetVersion(ctypes.byref(version))

    class Location(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]

    class Attributes(ctypes.Structure):
        _fields_ = [
            ("srcAccessOrder", ctypes.c_int),
            ("srcLocHint", Location),
            ("dstLocHint", Location),
            ("flags", ctypes.c_uint),
        ]

    def call(dsts, srcs, sizes, stream, device):
        count = len(dsts)
        pointers = ctypes.c_void_p * count
        attrs = Attributes(1, Location(2, 0), Location(1, device), 0)  # stream order; host to device
        index = (ctypes.c_size_t * 1)(0)
        args = [
            pointers(*dsts),
            pointers(*srcs),
            (ctypes.c_size_t * count)(*sizes),
            ctypes.c_size_t(count),
            ctypes.byref(attrs),
            index,
            ctypes.c_size_t(1),
        ]
        if version.value < 13000:  # CUDA 12.8-12.9 report the failing copy's index
            args.append(ctypes.byref(ctypes.c_size_t()))
        error = runtime.cudaMemcpyBatchAsync(*args, ctypes.c_void_p(stream))
        if error:
            raise RuntimeError(f"cudaMemcpyBatchAsync failed with error {error} (CUDA runtime {version.value})")

    return call


if __name__ == "__main__":
    main()
