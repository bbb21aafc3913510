"""The routed experts' Triton kernels (hf_prefetch/runtime/expert_kernels.py) run by Triton's interpreter on CPU
tensors, wherever Triton is installed: what the fetch ahead marks, copies and counts, and what the gather reads and
counts, entry by entry. The same kernels on CUDA are checked end to end by the `gpu` tests of test_routed.py and
test_expert_policy.py."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

# Triton reads TRITON_INTERPRET when it is imported (its own library functions are built then), so the kernels run
# in a fresh process that sets it first: `test_the_kernels_under_the_interpreter` starts it on this file.
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
inside = pytest.mark.skipif(not INTERPRETING, reason="runs in the interpreter's process")


@pytest.mark.skipif(INTERPRETING, reason="this is the interpreter's process")
@pytest.mark.skipif(
    tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 7),
    reason="Triton's interpreter before 3.7 cannot run a loop whose bound is a kernel argument (CUDA compiles it)",
)
def test_the_kernels_under_the_interpreter():
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(root), *sys.path])}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        env=env, cwd=root, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert run.stdout.splitlines()[-1].startswith("3 passed"), run.stdout[-2000:]


@pytest.fixture
def kernels():
    from hf_prefetch.runtime import expert_kernels

    return expert_kernels


E, FIRST, SECOND = 16, 3000, 5000  # rows of two tensors, not multiples of the kernels' block


@inside
@pytest.mark.parametrize("enabled", [0, 1])
def test_the_fetch_marks_and_counts_each_expert_once_and_copies_only_where_enabled(kernels, enabled):
    torch.manual_seed(0)
    sources = [torch.randn(E, FIRST), torch.randn(E, SECOND)]
    outs = [torch.full((E, FIRST), -7.0), torch.full((E, SECOND), -7.0)]
    # Repeated picks (3, 5), a sentinel (16), padding (-1) and a cached expert (9).
    experts = torch.tensor([3, 9, 16, 3, 11, -1, 5, 5])
    slot_of = torch.full((E,), -1, dtype=torch.long)
    slot_of[9] = 0
    chosen = torch.full((E,), -1, dtype=torch.long)
    ready = torch.ones(E, dtype=torch.int32)  # stale marks: cleared by the fetch
    marked = torch.ones(E, dtype=torch.int32)
    tallies = torch.zeros(kernels.TALLIES, dtype=torch.long)
    flag = torch.tensor([enabled], dtype=torch.int32)
    kernels.fetch_kernel()(
        experts, slot_of, chosen, ready, marked, flag, list(zip(sources, outs, strict=True)), tallies, 4
    )
    wanted = {3, 5, 11}
    assert {e for e in range(E) if marked[e]} == wanted
    assert {e for e in range(E) if ready[e]} == (wanted if enabled else set())
    assert sorted(e for e in chosen.tolist() if e >= 0) == (sorted(wanted) if enabled else [])
    for source, out in zip(sources, outs, strict=True):
        for expert in range(E):
            want = source[expert] if enabled and expert in wanted else torch.full_like(source[expert], -7.0)
            assert torch.equal(out[expert], want), expert
    assert tallies[kernels.CANDIDATES] == 3 and tallies[kernels.FETCHED] == 3 * enabled


@inside
def test_the_gather_reads_each_pick_from_one_place_and_counts_a_fetched_expert_once(kernels):
    torch.manual_seed(1)
    source, cache = torch.randn(E, FIRST), torch.randn(1, FIRST)
    out = torch.full((E, FIRST), -7.0)
    out[3] = 1000.0  # fetched ahead: left as it is
    ready = torch.zeros(E, dtype=torch.int32)
    ready[3] = 1
    marked = torch.zeros(E, dtype=torch.int32)
    marked[3] = marked[11] = 1  # 11: a fetch would have brought it (the policy had it off)
    slot_of = torch.full((E,), -1, dtype=torch.long)
    slot_of[9] = 0
    picks = torch.zeros(E, dtype=torch.long)
    tallies = torch.zeros(kernels.TALLIES, dtype=torch.long)
    index = torch.tensor([3, 3, 11, 0, 9])
    kernels.gather_kernel()(index, ready, marked, slot_of, source, cache, out, picks, tallies, True)
    assert torch.all(out[3] == 1000.0)
    assert torch.equal(out[9], cache[0]) and torch.equal(out[11], source[11]) and torch.equal(out[0], source[0])
    found = [tallies[k].item() for k in (kernels.FOUND_RECENT, kernels.FOUND_CACHED, kernels.FROM_HOST)]
    assert found == [2, 1, 2]  # per pick: 3 twice; 9; 11 and 0
    assert tallies[kernels.CANDIDATE_HITS] == 2  # per expert: 3 once, 11 once
    assert picks[3] == 2 and picks[9] == 1
