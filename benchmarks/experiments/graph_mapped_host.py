"""Does a CUDA graph's recorded host-to-device copy keep reading host storage mapped from a file (page-locked
read-only in place), and after `HostArena.make_writable` replaced those pages with private ones at the same
addresses and page-locked them again? Each case runs in a fresh process (a fault poisons the CUDA context).

    PYTHONUNBUFFERED=1 python benchmarks/experiments/graph_mapped_host.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

CASES = {
    "eager copy from the file's pages": ("eager", False),
    "graph replay from the file's pages": ("graph", False),
    "eager copy after make_writable": ("eager", True),
    "graph recorded before make_writable, replayed after": ("graph", True),
    "graph recorded after make_writable": ("graph-after", True),
}


def case(kind: str, writable: bool, folder: str) -> str:
    import torch

    from hf_prefetch.host.arena import FilePiece, HostArena
    from hf_prefetch.runtime.graph_copies import captured_copy

    nbytes = 64 << 20
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    path = os.path.join(folder, "weights.bin")
    with open(path, "wb") as f:
        f.write(b"\0" * 123 + data.numpy().tobytes())
    fd = os.open(path, os.O_RDONLY)
    arena = HostArena([nbytes], files=[FilePiece(path, fd, 123)])
    os.close(fd)
    with torch.cuda.device(0):
        assert arena.pin()
    host = arena.view(0, (nbytes,), (1,), torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    graph = None
    if kind == "graph":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            captured_copy(dst, host, torch.cuda.current_stream())
    expected = data
    if writable:
        torch.cuda.synchronize()
        arena.make_writable()
        assert arena.file_bytes == 0 and arena.pinned
        host.fill_(7)
        expected = torch.full_like(data, 7)
        if kind == "graph-after":
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                captured_copy(dst, host, torch.cuda.current_stream())
    if graph is None:
        dst.copy_(host, non_blocking=True)
    else:
        graph.replay()
    torch.cuda.synchronize()
    return "bitwise" if torch.equal(dst.cpu(), expected) else "DIFFERENT bytes"


def main() -> None:
    if len(sys.argv) > 1:
        with tempfile.TemporaryDirectory() as folder:
            print("RESULT", case(sys.argv[1], sys.argv[2] == "1", folder))
        return
    import torch

    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    for name, (kind, writable) in CASES.items():
        child = subprocess.run([sys.executable, __file__, kind, str(int(writable))], capture_output=True, text=True)
        result = [line[7:] for line in child.stdout.splitlines() if line.startswith("RESULT ")]
        lines = child.stderr.strip().splitlines()
        error = ([line for line in lines if "Error" in line] or lines)[-1:] if child.returncode else []
        print(f"{name:<55} {result[0] if result else 'FAILED: ' + ' '.join(error)}")


if __name__ == "__main__":
    main()
