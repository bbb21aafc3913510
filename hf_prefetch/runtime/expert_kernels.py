"""The routed experts' row copies as Triton kernels (`experts.py` decides what they copy and when): the gather at
the router, which reads each pick from the slot, the expert cache or host memory, and the fetch of a layer's recent
picks ahead of its router. Each is built on first use, so that importing hf_prefetch imports no Triton, and is None
where Triton is missing.
"""

from __future__ import annotations

import functools

__all__ = [
    "FETCH_PROGRAMS",
    "FOUND_RECENT",
    "FOUND_CACHED",
    "FROM_HOST",
    "FETCHED",
    "CANDIDATES",
    "CANDIDATE_HITS",
    "TALLIES",
    "gather_kernel",
    "fetch_kernel",
]

# How many programs `fetch_kernel` runs: enough loads in flight to keep the link busy, few enough SMs that the
# compute stream's kernels, which run meanwhile, find theirs free (benchmarks/routed_gather.py: 64 read the most).
FETCH_PROGRAMS = 64

# The entries of a layer's `tallies` (`LayerTransfer.tallies`): picks found fetched ahead, found in the cache, copied
# from host memory at the router; rows fetched ahead; and what the recent-experts policy measures whether the rows are
# fetched or not (`expert_policy.py`): the experts a fetch ahead would bring (the previous forward's picks that the
# cache does not hold, `RecentPicks.marked`), and the picks that were among them.
FOUND_RECENT, FOUND_CACHED, FROM_HOST, FETCHED, CANDIDATES, CANDIDATE_HITS = range(6)
TALLIES = 6


@functools.cache
def gather_kernel():
    """The gather at the router (`gather_looked_up`) as one Triton kernel per routed tensor, or None where Triton is
    missing. Built on first use, so that importing hf_prefetch imports no Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def gather_rows(
        experts,
        ready,
        marked,
        slot_of,
        source,
        cache,
        out,
        picks,
        tallies,
        row_len,
        RECENT: tl.constexpr,
        CACHED: tl.constexpr,
        COUNT: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # Program (block, pick): one BLOCK of one picked expert's row, left alone if the slot holds it (fetched
        # ahead), else read from its cache row if it has one, else from the host (through the mapped view). The first
        # block of each pick counts it, and whether a fetch ahead would have brought it (`marked`).
        block = tl.program_id(0)
        pick = tl.program_id(1)
        expert = tl.load(experts + pick)
        in_slot = tl.full([], 0, tl.int32)
        if RECENT:
            in_slot = tl.load(ready + expert)
        slot = tl.full([], -1, tl.int64)
        if CACHED:
            slot = tl.load(slot_of + expert)
        offsets = block * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < row_len
        if in_slot == 0:
            if slot >= 0:
                values = tl.load(cache + slot * row_len + offsets, mask=inside)
            else:
                values = tl.load(source + expert * row_len + offsets, mask=inside)
            tl.store(out + expert * row_len + offsets, values, mask=inside)
        if COUNT:
            if block == 0:
                if CACHED:
                    tl.atomic_add(picks + expert, 1)
                kind = tl.where(in_slot != 0, 0, tl.where(slot >= 0, 1, 2))  # FOUND_RECENT, FOUND_CACHED, FROM_HOST
                tl.atomic_add(tallies + kind, 1)
                if RECENT:  # a marked expert counts once however many tokens pick it: 1 -> 2 the first time
                    if tl.atomic_cas(marked + expert, 1, 2) == 1:
                        tl.atomic_add(tallies + 5, 1)  # CANDIDATE_HITS

    block = 2048

    def launch(experts, ready, marked, slot_of, source, cache, out, picks, tallies, count):
        row_len = out.shape[1]
        grid = (triton.cdiv(row_len, block), experts.numel())
        gather_rows[grid](
            experts,
            out if ready is None else ready,  # unused pointers: any tensor
            out if marked is None else marked,
            out if slot_of is None else slot_of,
            source,
            out if cache is None else cache,
            out,
            out if picks is None else picks,
            tallies,
            row_len,
            RECENT=ready is not None,
            CACHED=slot_of is not None,
            COUNT=count,
            BLOCK=block,
            num_warps=8,
        )

    return launch


@functools.cache
def fetch_kernel():
    """`fetch_recent`'s work on CUDA as two Triton kernels, or None where Triton is missing. `launch(experts, slot_of,
    chosen, ready, marked, enabled, pairs, tallies)`: one program marks in `marked` each expert of `experts` that a
    fetch would bring (an expert of the layer that `slot_of`, when given, says the cache does not hold), counts them,
    clears `ready`, and writes into `chosen` each entry to fetch, or -1 for all of them where `enabled[0]` is 0; then
    few programs copy the rows of every chosen expert of each `(source, out)` pair (2-D, a row per expert), marking
    each ready and counting it in `tallies` as they go. `enabled` is read on the device, so a CUDA graph that recorded
    the fetch follows the policy's latest decision at every replay."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def choose(
        experts, slot_of, chosen, ready, marked, enabled, tallies, entries, num_experts,
        CACHED: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        every = tl.arange(0, BLOCK)
        tl.store(ready + every, 0, mask=every < num_experts)
        tl.store(marked + every, 0, mask=every < num_experts)
        inside = every < entries
        expert = tl.load(experts + every, mask=inside, other=-1)
        take = inside & (expert >= 0) & (expert < num_experts)
        if CACHED:
            take = take & (tl.load(slot_of + expert, mask=take, other=-1) < 0)
        tl.debug_barrier()  # every clear lands before any mark (threads of the program write each other's entries)
        # One entry per expert (several tokens of a forward may have picked it): the one whose exchange found it clear.
        earlier = tl.atomic_xchg(marked + expert, 1, mask=take)
        take = take & (earlier == 0)
        tl.atomic_add(tallies + 4, tl.sum(take.to(tl.int32), axis=0).to(tl.int64))  # CANDIDATES
        on = tl.load(enabled)
        tl.store(chosen + every, tl.where(take & (on != 0), expert, -1), mask=inside)

    @triton.jit
    def fetch_rows(
        chosen,
        first_source,
        first_out,
        first_len,
        second_source,
        second_out,
        second_len,
        ready,
        tallies,
        entries,
        MARK: tl.constexpr,
        FETCHED: tl.constexpr,
        BLOCK: tl.constexpr,
        PROGRAMS: tl.constexpr,
    ):
        # For each chosen expert (-1: none, skipped at once), PROGRAMS programs take turns over the BLOCKs of its row
        # in two tensors, read from the host (through the mapped view). Its first block marks it ready and counts it.
        # Few programs: the kernel runs beside the compute stream's, which need SMs too.
        first_blocks = tl.cdiv(first_len, BLOCK)
        blocks = first_blocks + tl.cdiv(second_len, BLOCK)
        for entry in range(0, entries):
            expert = tl.load(chosen + entry)
            if expert >= 0:
                for block in range(tl.program_id(0), blocks, PROGRAMS):
                    if block < first_blocks:
                        offsets = block * BLOCK + tl.arange(0, BLOCK)
                        inside = offsets < first_len
                        values = tl.load(first_source + expert * first_len + offsets, mask=inside)
                        tl.store(first_out + expert * first_len + offsets, values, mask=inside)
                        if MARK:
                            if block == 0:
                                tl.store(ready + expert, 1)
                                tl.atomic_add(tallies + FETCHED, 1)
                    else:
                        offsets = (block - first_blocks) * BLOCK + tl.arange(0, BLOCK)
                        inside = offsets < second_len
                        values = tl.load(second_source + expert * second_len + offsets, mask=inside)
                        tl.store(second_out + expert * second_len + offsets, values, mask=inside)

    block = 2048

    def launch(experts, slot_of, chosen, ready, marked, enabled, pairs, tallies, programs=None):
        programs = programs or FETCH_PROGRAMS
        num_experts = ready.numel()
        cached = slot_of is not None
        chooser_block = triton.next_power_of_2(max(num_experts, experts.numel()))
        choose[(1,)](experts, slot_of if cached else experts, chosen, ready, marked, enabled, tallies,
                     experts.numel(), num_experts, CACHED=cached, BLOCK=chooser_block)  # fmt: skip
        for start in range(0, len(pairs), 2):  # two tensors a launch (an experts module has two, or four with biases)
            (first_source, first_out), *rest = pairs[start : start + 2]
            second_source, second_out = rest[0] if rest else (first_source, first_out)
            fetch_rows[(programs,)](
                chosen,
                first_source,
                first_out,
                first_out.shape[1],
                second_source,
                second_out,
                second_out.shape[1] if rest else 0,
                ready,
                tallies,
                experts.numel(),
                MARK=start == 0,
                FETCHED=FETCHED,
                BLOCK=block,
                PROGRAMS=programs,
                num_warps=8,
            )

    return launch
