"""Two host links for one GPU: do the GPUs' links add up, and how fast do shares relayed by a second GPU land?

Prints, for a machine with two or more GPUs:
- each GPU's pinned host-to-device rate alone, and both copying at once (host memory registered with and without
  cudaHostRegisterPortable: a second device's copies from memory registered for the first must also be direct);
- the peer (NVLink or PCIe) rate from GPU 1 into GPU 0;
- copy-a-shard-then-gather: layer-sized copies into GPU 0, a share of each layer copied by GPU 1 into a staging
  buffer and then over the peer link into GPU 0's buffer, pipelined; effective GB/s of weights landing on GPU 0.

Run:  python benchmarks/two_links.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

LAYER_BYTES = 436_224_000  # one Llama-3.1-8B layer in bf16, about


def register(tensor: torch.Tensor, portable: bool) -> None:
    err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel(), 1 if portable else 0)
    assert int(err) == 0, err


def unregister(tensor: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())


def timed(fn, repeats: int) -> float:
    """Median wall seconds of fn() followed by a synchronisation of every device."""
    times = []
    for _ in range(repeats + 1):
        for d in range(torch.cuda.device_count()):
            torch.cuda.synchronize(d)
        begin = time.perf_counter()
        fn()
        for d in range(torch.cuda.device_count()):
            torch.cuda.synchronize(d)
        times.append(time.perf_counter() - begin)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    count = torch.cuda.device_count()
    print(f"GPUs: {count} x {torch.cuda.get_device_name(0)}  torch {torch.__version__}")
    assert count >= 2, "needs two GPUs"
    print(
        f"peer access 0<-1: {torch.cuda.can_device_access_peer(0, 1)}  1<-0: {torch.cuda.can_device_access_peer(1, 0)}"
    )
    layers, n = args.layers, LAYER_BYTES
    total = layers * n
    host = torch.empty(total, dtype=torch.uint8)
    host.fill_(3)
    dst = [torch.empty(2 * n, dtype=torch.uint8, device=f"cuda:{d}") for d in range(2)]
    streams = [torch.cuda.Stream(f"cuda:{d}") for d in range(2)]

    def copy_on(d: int, share: slice | None = None) -> None:
        with torch.cuda.stream(streams[d]):
            for i in range(layers):
                src = host[i * n : (i + 1) * n]
                dst[d][(i % 2) * n : (i % 2 + 1) * n].copy_(src, non_blocking=True)

    for portable in (False, True):
        register(host, portable)
        alone = [total / timed(lambda d=d: copy_on(d), args.repeats) / 1e9 for d in range(2)]

        def both() -> None:
            copy_on(0)
            copy_on(1)

        together = total / timed(both, args.repeats) / 1e9
        print(
            f"registered portable={portable}: GPU0 alone {alone[0]:.1f} GB/s, GPU1 alone {alone[1]:.1f} GB/s, "
            f"both at once {together:.1f} GB/s each ({2 * together:.1f} in all)"
        )
        unregister(host)
    register(host, True)

    # Peer rate 1 -> 0.
    src1 = torch.empty(n, dtype=torch.uint8, device="cuda:1")
    landing = torch.cuda.Stream("cuda:0")

    def peer() -> None:
        with torch.cuda.stream(streams[1]), torch.cuda.stream(landing):
            for i in range(layers):
                dst[0][(i % 2) * n : (i % 2 + 1) * n].copy_(src1, non_blocking=True)

    print(f"peer copy GPU1 -> GPU0: {total / timed(peer, args.repeats) / 1e9:.1f} GB/s")

    # Shard then gather: share `f` of each layer through GPU 1. "one stream": GPU 1 copies from the host and over the
    # peer link on one stream; "two streams": the peer copy on its own stream, so GPU 1's next host copy need not wait
    # for it (a staging buffer is reused only after its peer copy, by an event).
    stages = 3
    staging = torch.empty(stages * n, dtype=torch.uint8, device="cuda:1")
    peer_stream = torch.cuda.Stream("cuda:1")
    for two_streams in (False, True):
        for f in (0.45, 0.5):
            cut = int(n * (1 - f)) // 4096 * 4096

            def sharded(cut: int = cut, two_streams: bool = two_streams) -> None:
                freed = [None] * stages
                for i in range(layers):
                    src = host[i * n : (i + 1) * n]
                    out = dst[0][(i % 2) * n : (i % 2 + 1) * n]
                    with torch.cuda.stream(streams[0]):
                        out[:cut].copy_(src[:cut], non_blocking=True)
                    stage = staging[(i % stages) * n : (i % stages) * n + (n - cut)]
                    with torch.cuda.stream(streams[1]):
                        if freed[i % stages] is not None:
                            streams[1].wait_event(freed[i % stages])
                        stage.copy_(src[cut:], non_blocking=True)
                        landed = streams[1].record_event()
                    via = peer_stream if two_streams else streams[1]
                    with torch.cuda.stream(via), torch.cuda.stream(landing):
                        via.wait_event(landed)
                        out[cut:].copy_(stage, non_blocking=True)
                        freed[i % stages] = via.record_event()

            seconds = timed(sharded, args.repeats)
            print(
                f"shard then gather ({'two streams' if two_streams else 'one stream'} on GPU1), share {f:.2f}: "
                f"{total / seconds / 1e9:.1f} GB/s landing on GPU0"
            )
    unregister(host)


if __name__ == "__main__":
    main()
