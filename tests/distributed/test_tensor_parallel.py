"""Tensor-parallel models (transformers' `distributed_config`): each rank streams its own shards. Real process groups
on the CPU (gloo), 2 and 4 ranks, each rank checking itself (ranks.py); here, what the ranks computed is compared with
each other and with the model in one process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from ..models import CUDA
from . import ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tp")
    ranks.save_llama(folder / "llama")
    ranks.save_llama(folder / "uneven", num_layers=2, intermediate_size=67)  # rows no mesh divides
    return folder


def _single_process(folder: Path) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return ranks.run(AutoModelForCausalLM.from_pretrained(folder / "llama").eval())


def _check(results: list[dict], folder: Path, world: int) -> None:
    first = results[0]
    for result in results[1:]:  # every rank computes the whole logits (the last layer gathers them)
        assert torch.equal(result["logits"], first["logits"]) and torch.equal(result["tokens"], first["tokens"])
    logits, tokens = _single_process(folder)
    # The sharded matmuls reduce over ranks: close to the one-process model, not bitwise; the tokens agree.
    torch.testing.assert_close(first["logits"], logits, rtol=1e-4, atol=1e-5)
    assert torch.equal(first["tokens"], tokens)
    # Each rank read its slice of every sharded tensor and the replicated ones whole: nothing more.
    sharded = ("_proj.weight", "lm_head.weight")  # transformers' plan for Llama shards the projections and the head
    sizes = {name: p.nbytes for name, p in _parameters(folder)}
    share = sum(n // world if name.endswith(sharded) else n for name, n in sizes.items())
    assert share < sum(sizes.values()) / world + sizes["model.embed_tokens.weight"]
    for result in results:
        assert result["read"] == result["share"] == share, (result["read"], result["share"], share)


def _parameters(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder / "llama").named_parameters()


# Two ranks on one GPU cannot run: NCCL refuses a GPU twice, and gloo's collectives of CUDA tensors crash in torch.
TWO_GPUS = [*CUDA, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]


@pytest.mark.parametrize(
    ("world", "device"), [(2, "cpu"), (4, "cpu"), pytest.param(2, "cuda", marks=TWO_GPUS, id="two_gpus")]
)
def test_ranks_stream_their_own_shards(checkpoints, tmp_path, world, device):
    # On GPUs, each rank on its own (NCCL): their copies, pools and events are real.
    args = (world, _free_port(), str(checkpoints), str(tmp_path), device)
    context = mp.start_processes(ranks.main, args=args, nprocs=world, start_method="spawn", join=False)
    deadline = time.monotonic() + 300  # a rank that waits for the others forever fails the test instead
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the {world} ranks did not finish within 300 s")
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(world)]
    _check(results, checkpoints, world)


def test_torchrun_on_two_nodes(checkpoints, tmp_path):
    # Two "nodes" of one rank each (torchrun --nnodes 2), as on two hosts: ranks and local ranks differ.
    port = _free_port()
    script = Path(ranks.__file__)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(script.parents[2]), os.environ.get("PYTHONPATH", "")]))
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU's ranks (transformers' tensor parallelism takes the GPUs there are)
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc_per_node",
                "1",
                "--node_rank",
                str(node),
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                str(port),
                str(script),
                str(checkpoints),
                str(tmp_path),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in range(2)
    ]
    try:
        outputs = [node.communicate(timeout=300)[0] for node in nodes]
    finally:  # a node that waits for the other forever fails the test instead
        for node in nodes:
            node.kill()
    for node, output in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, output[-4000:]
    _check([torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)], checkpoints, 2)
