"""Shared benchmark helpers: the 8B-shaped model, the link peak, timers. GPU only."""

from __future__ import annotations

import json
import os
import statistics
import time

import torch
import torch._inductor.config as inductor_config
from transformers import LlamaConfig, LlamaForCausalLM

# Benchmarks compare the tokens of separately compiled systems. Inductor picks among kernel configurations by timing
# them on the device, and two configurations of one reduction sum in different orders: the deterministic mode picks
# without timing, so that two compiles of one model give the same bits.
inductor_config.deterministic = os.environ.get("TORCHINDUCTOR_DETERMINISTIC", "1") != "0"

try:
    from hf_prefetch.planning.link_speed import LINK_BYTES, LINK_REPEATS, measure_link_gbps
except ModuleNotFoundError:  # a package of 0.2.0's layout (load.py's "hf_prefetch previous")
    from hf_prefetch.link import LINK_BYTES, LINK_REPEATS, measure_link_gbps

LLAMA_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)


# A Qwen2.5-14B-like shape in Llama form (48 layers, hidden 5120): 14.8B parameters, 29.5 GB of bf16.
LLAMA_14B = dict(
    LLAMA_8B,
    hidden_size=5120,
    intermediate_size=13824,
    num_hidden_layers=48,
    num_attention_heads=40,
    vocab_size=152064,
)

# A Qwen2.5-32B-like shape in Llama form (64 layers, hidden 5120, intermediate 27648): 32.8B parameters, 65.5 GB of
# bf16 (it fits an 80 GB GPU, to be quantized there).
LLAMA_32B = dict(LLAMA_14B, intermediate_size=27648, num_hidden_layers=64)

SHAPES = {"8b": LLAMA_8B, "14b": LLAMA_14B, "32b": LLAMA_32B}


def build_model(
    num_layers: int | None = None, device: str = "cuda", shape: str = "8b", **overrides
) -> LlamaForCausalLM:
    """Random bf16 model of the given shape built directly on `device`."""
    fields = {**SHAPES[shape], **overrides}
    if num_layers is not None:
        fields["num_hidden_layers"] = num_layers
    config = LlamaConfig(**fields)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def h2d_peak_gbps(nbytes: int = LINK_BYTES, repeats: int = LINK_REPEATS) -> float:
    """Pinned host -> device link speed of the current CUDA device in GB/s, measured now: the library's definition
    (`hf_prefetch.planning.link_speed.measure_link_gbps`, the fastest of `repeats` copies of `nbytes` after two
    warm-up copies), uncached, so that a benchmark can measure it next to each run it bounds."""
    device = torch.device("cuda", torch.cuda.current_device())
    return measure_link_gbps(device, nbytes, repeats, cached=False)


def static_decode(
    model, ids, cache, new_tokens: int, compiled: bool, sample: bool = False
) -> tuple[float, torch.Tensor]:
    """Seconds and tokens of one `generate` of `new_tokens` into a reset static `cache`, through transformers' own
    compile of static-cache decoding (inductor, "reduce-overhead": CUDA graphs) when `compiled`. Greedy, or with
    `sample` sampled from the whole distribution after seeding the generator (the same tokens each call)."""
    from transformers import CompileConfig

    cache.reset()
    if sample:
        torch.manual_seed(0)
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            past_key_values=cache,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=sample,
            top_k=None,
            top_p=None,
            temperature=1.0,
            compile_config=CompileConfig() if compiled else None,
            disable_compile=not compiled,
        )
    torch.cuda.synchronize()
    return time.perf_counter() - start, out


def add_offload_params_argument(parser) -> None:
    parser.add_argument(
        "--offload-params",
        nargs="*",
        default=[],
        help="parameter-name segments to stream (PrefetchConfig.offload_params); experts: attention stays resident",
    )


def device_seconds(fn, repeats: int = 20) -> float:
    """Median device time of `fn` over `repeats` calls after one warm-up call, each timed with CUDA events."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / 1e3)
    return statistics.median(times)


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def decode_seconds_per_token(model, ids, short: int = 8, long: int = 40) -> float:
    """Seconds per decoded token: generate `long` and `short` new tokens, divide the difference (no prefill)."""
    mask = torch.ones_like(ids)

    def run(n):
        return lambda: model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    with torch.no_grad():
        t_short = timed(run(short))
        t_long = timed(run(long))
    return (t_long - t_short) / (long - short)


def prefill_seconds(model, length: int, repeats: int = 3) -> float:
    ids = torch.randint(3, 1000, (1, length), device="cuda")
    with torch.no_grad():
        model(ids, use_cache=False)
        return statistics.median(timed(lambda: model(ids, use_cache=False)) for _ in range(repeats))


def gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f}"


def clone_to_cpu(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """An independent copy of `model` in ordinary CPU memory (for the baselines that start from the CPU)."""
    with torch.device("meta"):
        clone = type(model)(model.config)
    clone.load_state_dict({k: v.to("cpu") for k, v in model.state_dict().items()}, assign=True)
    for name, buffer in model.named_buffers():
        path, _, leaf = name.rpartition(".")
        clone.get_submodule(path)._buffers[leaf] = buffer.to("cpu")
    return clone.eval()


def save_results(name: str, payload: dict) -> None:
    """Write `payload` as JSON to $OUT/`name` when the environment variable $OUT names a results folder."""
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, name), "w") as f:
            json.dump(payload, f, indent=1, default=str)


def use_local_fp8_kernel(path: str) -> None:
    """Serve transformers' fine-grained FP8 matmul (`FP8Linear`) from a local copy of the hub kernel
    `kernels-community/finegrained-fp8` (its `torch-ext/finegrained_fp8` folder, plus the `_ops.py` that kernel-builder
    generates), for machines that cannot download it. transformers looks the kernel up in `_KERNEL_MODULE_MAPPING`
    before asking the `kernels` package, which is not installed there."""
    import importlib
    import sys

    from transformers.integrations import finegrained_fp8, hub_kernels

    folder = os.path.abspath(path)
    sys.path.insert(0, os.path.dirname(folder))
    hub_kernels._KERNEL_MODULE_MAPPING["finegrained-fp8"] = importlib.import_module(os.path.basename(folder))
    finegrained_fp8.is_kernels_available = lambda *args, **kwargs: True  # its gate before the lookup


def pread_files(paths, buffers, pool, chunk: int = 16 * 2**20) -> None:
    """Fill each host tensor of `buffers` (uint8, a file's size) with its file of `paths`: positional reads of
    `chunk` bytes from the thread pool `pool`, as the loader's host reads do."""
    fds = [os.open(path, os.O_RDONLY) for path in paths]
    try:
        jobs = []
        for fd, buffer in zip(fds, buffers, strict=True):
            raw = buffer.numpy()
            jobs += [pool.submit(os.preadv, fd, [raw[a : a + chunk]], a) for a in range(0, raw.nbytes, chunk)]
        for job in jobs:
            job.result()
    finally:
        for fd in fds:
            os.close(fd)
