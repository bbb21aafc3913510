"""Tensor-parallel decode on the GPUs of one host: each rank streams its own shards (`from_pretrained(...,
distributed_config=DistributedConfig(tp_size=N), max_memory=...)`) against its own link bound and against the same
tensor-parallel model resident, and pipeline placement of the same model over the same GPUs against its bound.

    PYTHONPATH=. python benchmarks/tensor_parallel.py --gpus 2 --shape 8b [--budget-share 0.5] [--pairs 3]

The driver saves a random-weight bf16 checkpoint of the shape, then runs the two placements alternately, `--pairs`
times, each in processes of its own (torchrun for tensor parallelism, one process for pipeline placement). Inside the
tensor-parallel ranks, the resident and the streamed model decode alternately too. Bounds: a rank's streamed bytes per
token over its own link (measured on its GPU), or the resident model's time where that is longer; pipeline placement's
GPUs stream one after the other, so its bound is the sum of each GPU's bytes over its link. Tokens: streamed tensor
parallelism against resident tensor parallelism, pipeline placement against the model on one GPU. Without CUDA it runs
on the CPU with gloo (`--shape tiny`), to check the script: no bounds then.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4, vocab_size=128)
SHORT, LONG = 8, 40  # new tokens of the two generates whose difference times the decode


def save_checkpoint(folder: Path, shape: str, layers: int | None) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    if shape == "tiny":
        fields = dict(TINY, num_hidden_layers=layers or 8)
    else:
        from common import SHAPES

        fields = dict(SHAPES[shape], **({"num_hidden_layers": layers} if layers else {}))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**fields))
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.02)
    model.eval().save_pretrained(folder)


def decode(model, device: torch.device) -> tuple[float, torch.Tensor]:
    """Seconds per decoded token (the difference of two greedy generates) and the long generate's tokens."""
    import time

    ids = torch.randint(3, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1)).to(device)

    def generate(n: int) -> tuple[float, torch.Tensor]:
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        sync()
        return time.perf_counter() - start, out.cpu()

    short, _ = generate(SHORT)
    long, tokens = generate(LONG)
    return (long - short) / (LONG - SHORT), tokens


def link_gbps(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    from common import h2d_peak_gbps

    return h2d_peak_gbps()


def tensor_parallel_ranks(folder: Path, budget_share: float, rounds: int) -> None:
    """One rank (under torchrun): the resident and the streamed tensor-parallel model, alternately."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import hf_prefetch

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tp = DistributedConfig(tp_size=world)
    resident = AutoModelForCausalLM.from_pretrained(folder, distributed_config=tp, dtype=torch.bfloat16).eval()
    device = resident.device
    share = sum(getattr(p, "_local_tensor", p).nbytes for p in resident.parameters())
    budget = {device.index or 0: int(share * budget_share)}
    streamed = hf_prefetch.from_pretrained(folder, max_memory=budget, reserve_bytes=0, distributed_config=tp)
    plan = hf_prefetch.get_state(streamed).plan
    link = link_gbps(device)
    times = {"resident": [], "streamed": []}
    tokens = {}
    for _ in range(rounds):
        for name, model in (("resident", resident), ("streamed", streamed)):
            seconds, tokens[name] = decode(model, device)
            times[name].append(seconds)
    resident_s, streamed_s = statistics.median(times["resident"]), statistics.median(times["streamed"])
    bytes_per_token = plan.streamed_bytes_per_forward
    bound = max(resident_s, bytes_per_token / (link * 1e9)) if link else None
    row = dict(
        rank=rank,
        device=str(device),
        link_gbps=link,
        streamed_layers=len(plan.rings[0].streamed),
        gb_per_token=bytes_per_token / 1e9,
        resident_s=resident_s,
        streamed_s=streamed_s,
        x_bound=streamed_s / bound if bound else None,
        ratios=[s / r for s, r in zip(times["streamed"], times["resident"], strict=True)],
        tokens_identical=bool(torch.equal(tokens["streamed"], tokens["resident"])),
    )
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        print("RESULT " + json.dumps(rows), flush=True)
    dist.destroy_process_group()


def pipeline(folder: Path, gpus: int, budget_share: float) -> None:
    """Pipeline placement over `gpus` GPUs against the model on one GPU (one process)."""
    import hf_prefetch

    total = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    limit = int(total / gpus * budget_share)
    model = hf_prefetch.from_pretrained(folder, max_memory={g: limit for g in range(gpus)}, reserve_bytes=0)
    plan = hf_prefetch.get_state(model).plan
    device = torch.device("cuda", 0)
    seconds, tokens = decode(model, device)
    links = {g: _link_on(g) for g in range(gpus)}
    bound = sum(
        sum(ring.bytes_per_forward for ring in plan.rings if ring.device == g) / (links[g] * 1e9) for g in range(gpus)
    )
    hf_prefetch.remove_offload(model, "cpu")
    del model
    from transformers import AutoModelForCausalLM

    whole = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map={"": 0}).eval()
    _, want = decode(whole, device)
    row = dict(gb_per_token=plan.streamed_bytes_per_forward / 1e9, seconds=seconds, x_bound=seconds / bound)
    row.update(links=links, tokens_identical=bool(torch.equal(tokens, want)))
    print("RESULT " + json.dumps(row), flush=True)


def _link_on(index: int) -> float:
    with torch.cuda.device(index):
        return link_gbps(torch.device("cuda", index))


def _result(command: list[str]) -> object:
    done = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        sys.exit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--shape", default="8b", help="8b, 14b, 32b (benchmarks/common.py) or tiny")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--budget-share", type=float, default=0.5, help="each GPU's budget / its share of the model")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3, help="resident/streamed alternations inside each TP run")
    parser.add_argument("--role", choices=["tp", "pipeline"], help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "tp":
        return tensor_parallel_ranks(args.folder, args.budget_share, args.rounds)
    if args.role == "pipeline":
        return pipeline(args.folder, args.gpus, args.budget_share)
    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        folder = Path(tmp) / "model"
        save_checkpoint(folder, args.shape, args.layers)
        me = [sys.executable, os.path.abspath(__file__), "--folder", str(folder), "--gpus", str(args.gpus)]
        me += ["--budget-share", str(args.budget_share), "--rounds", str(args.rounds)]
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.gpus)]
        tp_runs, pipe_runs = [], []
        for _ in range(args.pairs):
            tp_runs.append(_result(torchrun + me[1:] + ["--role", "tp"]))
            if cuda:
                pipe_runs.append(_result(me + ["--role", "pipeline"]))
    print(
        f"shape {args.shape}, {args.gpus} GPUs, budget {args.budget_share:.2f} of each GPU's share, {args.pairs} pairs"
    )
    print("| system | rank | link GB/s | GB/token | s/token | x bound | vs resident TP | tokens |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for rank in range(args.gpus):
        runs = [run[rank] for run in tp_runs]
        seconds = statistics.median(r["streamed_s"] for r in runs)
        ratio = statistics.median(x for r in runs for x in r["ratios"])
        bound = statistics.median(r["x_bound"] for r in runs) if cuda else None
        link = runs[0]["link_gbps"]
        print(
            f"| TP streamed | {rank} | {f'{link:.1f}' if link else '-'} | {runs[0]['gb_per_token']:.3f} | "
            f"{seconds:.4f} | {f'{bound:.3f}' if bound else '-'} | {ratio:.3f} | "
            f"{'identical' if all(r['tokens_identical'] for r in runs) else 'DIFFER'} |"
        )
    if pipe_runs:
        seconds = statistics.median(r["seconds"] for r in pipe_runs)
        tp_seconds = [max(rank["streamed_s"] for rank in run) for run in tp_runs]
        ratios = [p["seconds"] / t for p, t in zip(pipe_runs, tp_seconds, strict=True)]
        print(
            f"| pipeline | - | - | {pipe_runs[0]['gb_per_token']:.3f} | {seconds:.4f} | "
            f"{statistics.median(r['x_bound'] for r in pipe_runs):.3f} | - | "
            f"{'identical' if all(r['tokens_identical'] for r in pipe_runs) else 'DIFFER'} |"
        )
        print(f"pipeline / TP streamed time: {statistics.median(ratios):.3f} (median of {len(ratios)} pairs)")


if __name__ == "__main__":
    main()
