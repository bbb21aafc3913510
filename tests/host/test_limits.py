"""The host arena's host-memory limits (hf_prefetch/host/limits.py), read from fake /proc and /sys trees."""

import os
import warnings

import pytest
import torch

from hf_prefetch.host import limits as host_memory
from hf_prefetch.host.arena import HostArena

# Host limits: fake /proc and /sys trees under tmp_path.

MiB, GiB = 2**20, 2**30


def write_tree(root, files: dict[str, str]) -> None:
    for path, text in files.items():
        file = root / path
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(text)


@pytest.fixture
def fake_host(monkeypatch, tmp_path):
    """The arena reads its limits from the fake tree at tmp_path."""
    real = host_memory.host_limits
    monkeypatch.setattr(host_memory, "host_limits", lambda root=tmp_path: real(root))
    return tmp_path


@pytest.fixture
def allocations(monkeypatch):
    """The byte counts of the torch.empty calls made meanwhile."""
    sizes = []
    real = torch.empty

    def empty(*size, **kwargs):
        sizes.append(size[0] if size and isinstance(size[0], int) else None)
        return real(*size, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    return sizes


def cgroup_v2(root, path: str, limit: str, current: int, active_file: int = 0, inactive_file: int = 0) -> None:
    write_tree(
        root,
        {
            "proc/self/cgroup": f"0::{path}\n",
            "proc/self/mountinfo": "31 23 0:28 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n",
            f"sys/fs/cgroup{path}/memory.max": f"{limit}\n",
            f"sys/fs/cgroup{path}/memory.current": f"{current}\n",
            f"sys/fs/cgroup{path}/memory.stat": f"anon 1\nfile 2\nactive_file {active_file}\n"
            f"inactive_file {inactive_file}\nshmem 0\n",
        },
    )


def test_an_arena_over_the_cgroup_v2_limit_is_refused_before_allocating(fake_host, allocations):
    # 9.10 GiB in use besides 1 GiB of page cache, which the kernel reclaims before the limit.
    cgroup_v2(fake_host, "/job", str(16 * GiB), int(10.1 * GiB), active_file=GiB // 4, inactive_file=3 * GiB // 4)
    with pytest.raises(ValueError) as error:
        HostArena([4 * GiB, 4 * GiB])
    message = str(error.value)
    assert "needs 8.00 GiB" in message
    assert "cgroup memory limit (/sys/fs/cgroup/job/memory.max) is 16.00 GiB, 9.10 GiB in use" in message
    assert "6.90 GiB left" in message and "'cpu' entry of at most 6.90 GiB" in message
    assert "raise the container's memory limit" in message
    assert not any(size is not None and size >= GiB for size in allocations)  # refused before allocating
    HostArena([64 * MiB])  # what fits is allocated as before


def test_cgroup_v2_without_a_limit_allows_any_arena(fake_host):
    cgroup_v2(fake_host, "/job", "max", 10 * GiB)
    limits = host_memory.host_limits()
    assert limits.cgroup_limit is None and limits.cgroup_headroom is None and limits.cgroup_source is None
    HostArena([MiB])


def test_the_cgroup_level_with_the_least_room_counts(fake_host):
    # The process's cgroup has no limit of its own; its parent (the container) does, and a sibling uses most of it.
    cgroup_v2(fake_host, "/pod/app", "max", GiB)
    write_tree(
        fake_host, {"sys/fs/cgroup/pod/memory.max": str(8 * GiB), "sys/fs/cgroup/pod/memory.current": str(7 * GiB)}
    )
    limits = host_memory.host_limits()
    assert (limits.cgroup_limit, limits.cgroup_usage) == (8 * GiB, 7 * GiB)
    assert limits.cgroup_source == "/sys/fs/cgroup/pod/memory.max" and limits.cgroup_headroom == GiB
    with pytest.raises(ValueError, match=r"\(/sys/fs/cgroup/pod/memory.max\) is 8.00 GiB, 7.00 GiB in use"):
        HostArena([2 * GiB])


def test_cgroup_v1_without_a_cgroup_namespace(fake_host):
    # Docker on cgroup v1: /proc/self/cgroup names the host's path, the mount shows the container's cgroup as its root.
    write_tree(
        fake_host,
        {
            "proc/self/cgroup": "5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n",
            "proc/self/mountinfo": "30 23 0:26 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"
            "35 31 0:32 /docker/abc /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n",
            "sys/fs/cgroup/memory/memory.limit_in_bytes": str(4 * GiB),
            "sys/fs/cgroup/memory/memory.usage_in_bytes": str(3 * GiB),
            "sys/fs/cgroup/memory/memory.stat": f"cache 5\ninactive_file 7\ntotal_inactive_file {GiB}\n",
        },
    )
    limits = host_memory.host_limits()
    assert (limits.cgroup_limit, limits.cgroup_usage) == (4 * GiB, 2 * GiB)
    assert limits.cgroup_source == "/sys/fs/cgroup/memory/memory.limit_in_bytes"
    with pytest.raises(ValueError, match=r"memory.limit_in_bytes\) is 4.00 GiB, 2.00 GiB in use.*2.00 GiB left"):
        HostArena([3 * GiB])
    HostArena([GiB])


def test_cgroup_v1_unlimited_reads_as_no_limit(fake_host):
    unlimited = 9223372036854771712  # what an unlimited cgroup v1 level reads
    write_tree(
        fake_host,
        {
            "proc/self/cgroup": "4:memory:/user/job\n",
            "sys/fs/cgroup/memory/user/job/memory.limit_in_bytes": str(unlimited),
            "sys/fs/cgroup/memory/user/job/memory.usage_in_bytes": str(GiB),
            "sys/fs/cgroup/memory/memory.limit_in_bytes": str(unlimited),
        },
    )
    assert host_memory.host_limits().cgroup_limit is None
    HostArena([MiB])


def test_no_cgroup_or_proc_files_mean_no_limits(fake_host, monkeypatch):
    monkeypatch.setattr(host_memory, "resource", None)  # not Unix
    assert host_memory.host_limits() == host_memory.HostLimits(None, None, None, None, None)
    HostArena([MiB])


def test_an_arena_over_mem_available_warns(fake_host):
    write_tree(fake_host, {"proc/meminfo": "MemTotal:       24682416 kB\nMemAvailable:     524288 kB\n"})
    assert host_memory.host_limits().mem_available == 512 * MiB
    with pytest.warns(UserWarning, match=r"needs 1.00 GiB.*MemAvailable \(/proc/meminfo\) is 0.50 GiB"):
        HostArena([GiB])  # only an estimate: allocated all the same


def test_weights_freed_while_the_arena_fills_count_as_room(fake_host):
    cgroup_v2(fake_host, "/job", str(2 * GiB), 3 * GiB // 2)  # 1 GiB of it: weights that move into the arena
    with pytest.raises(ValueError, match=r"needs 1.00 GiB of host memory \(0.25 GiB of it freed.*at most 0.75 GiB"):
        HostArena([GiB], freed_bytes=GiB // 4)
    HostArena([GiB], freed_bytes=GiB)


def test_an_empty_arena_is_never_refused(fake_host):
    cgroup_v2(fake_host, "/job", str(GiB), 2 * GiB)  # over the limit already
    write_tree(fake_host, {"proc/meminfo": "MemAvailable: 0 kB\n"})
    with pytest.raises(ValueError, match="0.00 GiB left"):
        HostArena([1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert HostArena([]).nbytes == 0


def test_a_small_memlock_limit_is_reported_but_not_warned_about(fake_host, monkeypatch):
    # RLIMIT_MEMLOCK does not govern cudaHostRegister (see check_host_memory).
    monkeypatch.setattr(host_memory.resource, "getrlimit", lambda which: (64 * 1024, 64 * 1024))
    assert host_memory.host_limits().memlock == 64 * 1024
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        HostArena([GiB])  # the fake tree has no limits
    monkeypatch.setattr(host_memory.resource, "getrlimit", lambda which: (host_memory.resource.RLIM_INFINITY,) * 2)
    assert host_memory.host_limits().memlock is None


def test_this_machines_limits_parse():
    limits = host_memory.host_limits()
    for value in (limits.cgroup_limit, limits.cgroup_usage, limits.mem_available, limits.memlock):
        assert value is None or (isinstance(value, int) and value >= 0)
    assert (limits.cgroup_limit is None) == (limits.cgroup_source is None) == (limits.cgroup_headroom is None)
    if limits.cgroup_source is not None:
        assert os.path.isfile(limits.cgroup_source)
    if os.path.isfile("/proc/meminfo"):
        assert limits.mem_available is not None and limits.mem_available > 0
