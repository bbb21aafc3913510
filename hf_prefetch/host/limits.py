"""What the host allows this process: its memory cgroup's limit and usage, MemAvailable, RLIMIT_MEMLOCK, and the
check an arena of offloaded weights must pass before it is allocated (`check_host_memory`).

An arena larger than what the container's memory cgroup still allows is refused with a ValueError that says so,
instead of the process being killed for memory midway through a load; one larger than MemAvailable gets a warning.
Every source is read from files under a root (`/` by default, a fake tree in tests); what cannot be read is None.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

try:
    import resource
except ImportError:  # not Unix
    resource = None  # type: ignore[assignment]

__all__ = ["HostLimits", "host_limits", "check_host_memory"]

# A cgroup v1 level without a limit reads 2**63 rounded down to a page; no real limit comes near 2**60 bytes (1 EiB).
_UNLIMITED_BYTES = 1 << 60


@dataclass(frozen=True)
class HostLimits:
    """The host-memory limits that apply to this process, in bytes; None where unknown or unlimited.

    `cgroup_limit` and `cgroup_usage` are those of the memory cgroup level with the least room left (the process's own
    cgroup or an ancestor), and `cgroup_source` is that level's limit file. `cgroup_usage` leaves out page cache (the
    file pages of `memory.stat`), which the kernel reclaims before the limit is reached. `mem_available` is
    MemAvailable from /proc/meminfo. `memlock` is RLIMIT_MEMLOCK, for diagnostics only: it does not limit
    `cudaHostRegister` (see `check_host_memory`).
    """

    cgroup_limit: int | None = None
    cgroup_usage: int | None = None
    cgroup_source: str | None = None
    mem_available: int | None = None
    memlock: int | None = None

    @property
    def cgroup_headroom(self) -> int | None:
        """Bytes the memory cgroup still allows (limit less usage), or None without a limit."""
        if self.cgroup_limit is None:
            return None
        return max(0, self.cgroup_limit - (self.cgroup_usage or 0))


def host_limits(root: str | os.PathLike[str] = "/") -> HostLimits:
    """This process's host-memory limits, read from the cgroup files, /proc/meminfo and RLIMIT_MEMLOCK.

    `root` is where /sys and /proc are found (a fake tree in tests). Every source is optional: what cannot be read
    (not Linux, no memory cgroup, no such file) is None.

    Example:

    ```python
    >>> from hf_prefetch.host.limits import host_limits
    >>> limits = host_limits()
    >>> limits.cgroup_headroom is None or limits.cgroup_headroom >= 0
    True

    ```
    """
    root = Path(root)
    limit, usage, source = _cgroup_memory(root)
    return HostLimits(limit, usage, source, _mem_available(root), _memlock())


def check_host_memory(nbytes: int, limits: HostLimits, *, freed_bytes: int = 0) -> None:
    """Refuse `nbytes` more host memory for offloaded weights where the container does not allow them.

    Raises ValueError where they exceed what the memory cgroup still allows (past it the kernel kills the process);
    warns where they exceed MemAvailable, only an estimate (swap, and VMs whose memory grows with use, allow more).
    `freed_bytes` of host memory are released while the arena fills (weights that move into it from the CPU): they
    count as room.

    RLIMIT_MEMLOCK (`ulimit -l`) is not checked: it does not govern `cudaHostRegister`. NVIDIA's Linux kernel module
    pins the pages with `pin_user_pages` (`os_lock_user_pages` in kernel-open/nvidia/os-mlock.c of
    open-gpu-kernel-modules), with no memlock accounting; on driver 580.159.04 a process as user nobody, with no
    capabilities and `ulimit -l 64`, registered 1 GiB and its VmLck and VmPin stayed 0. Pinned pages are ordinary
    process memory charged to the memory cgroup, which is why the cgroup is what a plan must fit.
    """
    needed = nbytes - freed_bytes
    if needed <= 0:
        return
    freed = f" ({_gib(freed_bytes)} of it freed as weights move in from the CPU)" if freed_bytes > 0 else ""
    headroom = limits.cgroup_headroom
    if headroom is not None and needed > headroom:
        most = headroom + max(freed_bytes, 0)  # the largest arena that fits
        raise ValueError(
            f"The host arena for offloaded weights needs {_gib(nbytes)} of host memory{freed}, but the container's "
            f"cgroup memory limit ({limits.cgroup_source}) is {_gib(limits.cgroup_limit or 0)}, "
            f"{_gib(limits.cgroup_usage or 0)} in use (page cache not counted): {_gib(headroom)} left. Stream fewer "
            f"bytes: pass max_memory with a 'cpu' entry of at most {_gib(most)} (more weights then stay on the GPU), "
            "or raise the container's memory limit (docker --memory, Kubernetes resources.limits.memory)."
        )
    if limits.mem_available is not None and needed > limits.mem_available:
        warnings.warn(
            f"The host arena for offloaded weights needs {_gib(nbytes)} of host memory{freed}, but MemAvailable "
            f"(/proc/meminfo) is {_gib(limits.mem_available)}: the system may swap, or kill this process for memory. "
            "Pass max_memory with a smaller 'cpu' entry to stream fewer bytes, or free host memory.",
            stacklevel=3,
        )


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def _cgroup_memory(root: Path) -> tuple[int | None, int | None, str | None]:
    # (limit, usage net of page cache, limit file) of the cgroup level with the least room left; Nones without a limit.
    best: tuple[int | None, int | None, str | None] = (None, None, None)
    for directory, v2 in _memory_cgroup_dirs(root):
        if v2:
            limit_file, usage_file, cache = "memory.max", "memory.current", ("active_file", "inactive_file")
        else:  # cgroup v1: usage and the total_* counters include the descendants, as the limit does
            limit_file, usage_file = "memory.limit_in_bytes", "memory.usage_in_bytes"
            cache = ("total_active_file", "total_inactive_file")
        limit = _read_int(directory / limit_file)
        if limit is None or limit >= _UNLIMITED_BYTES:
            continue
        stat = _read_keyed(directory / "memory.stat")
        usage = max(0, (_read_int(directory / usage_file) or 0) - sum(stat.get(key, 0) for key in cache))
        if best[0] is None or limit - usage < best[0] - (best[1] or 0):
            best = (limit, usage, "/" + os.path.relpath(directory / limit_file, root))
    return best


def _memory_cgroup_dirs(root: Path) -> list[tuple[Path, bool]]:
    # The process's memory cgroup directory, then its ancestors up to the cgroup mount, each with whether it is v2.
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    cgroup, v2 = None, False
    for line in lines:  # hierarchy-ID:controllers:path
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        if "memory" in fields[1].split(","):  # cgroup v1 memory controller (also on hybrid hosts)
            cgroup, v2 = fields[2], False
            break
        if fields[0] == "0" and fields[1] == "":
            cgroup, v2 = fields[2], True
    if cgroup is None:
        return []
    mount_point, mount_root = _cgroup_mount(root, v2)
    # The mount shows the hierarchy from mount_root down (a container's own cgroup, without a cgroup namespace).
    relative = os.path.relpath(os.path.normpath(cgroup), mount_root)
    if relative == os.pardir or relative.startswith(os.pardir + os.sep):
        relative = os.curdir  # not below the mount: only the mount's own level is visible
    directory = Path(os.path.normpath(mount_point / relative))
    levels = [(directory, v2)]
    while directory != mount_point and mount_point in directory.parents:
        directory = directory.parent
        levels.append((directory, v2))
    return levels


def _cgroup_mount(root: Path, v2: bool) -> tuple[Path, str]:
    # (mount point under root, root of the hierarchy shown there) of the memory cgroup, from /proc/self/mountinfo.
    try:
        lines = (root / "proc/self/mountinfo").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:  # id parent major:minor root mount-point options [optional fields] - type source super-options
        fields, _, tail = line.partition(" - ")
        before, after = fields.split(), tail.split()
        if len(before) < 5 or len(after) < 3:
            continue
        if (v2 and after[0] == "cgroup2") or (not v2 and after[0] == "cgroup" and "memory" in after[2].split(",")):
            mount_point = before[4].replace("\\040", " ")
            return Path(os.path.normpath(root / mount_point.lstrip("/"))), before[3].replace("\\040", " ")
    return Path(os.path.normpath(root / ("sys/fs/cgroup" if v2 else "sys/fs/cgroup/memory"))), "/"


def _read_int(path: Path) -> int | None:
    # A cgroup value: bytes, or None for "max", a missing file or anything unreadable.
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _read_keyed(path: Path) -> dict[str, int]:
    # "key value" lines (memory.stat).
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    values = {}
    for line in lines:
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            values[key] = int(value)
    return values


def _mem_available(root: Path) -> int | None:
    try:
        lines = (root / "proc/meminfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:  # "MemAvailable:   24299888 kB"
        fields = line.split()
        if fields[:1] == ["MemAvailable:"] and len(fields) > 1 and fields[1].isdigit():
            return int(fields[1]) * (1024 if fields[2:] == ["kB"] else 1)
    return None


def _memlock() -> int | None:
    if resource is None:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY or soft < 0 else soft
