"""This package against another copy of it (an earlier commit's `hf_prefetch` folder, in `--previous-dir`), paired in
one run: dense decode, prefill and compiled decode, routed mixture-of-experts decode, and a checkpoint's load to the
first token. GPU only; `--tiny` runs the same steps with tiny models on the CPU, to check the script.

Each measurement runs in a fresh process (`--child PART`) whose `hf_prefetch` is one package or the other (first on
its `sys.path`); the two alternate, `--pairs` times, the first of a pair alternating too. A process builds its models
from seed 0, so both packages compute on the same weights: each row says whether their tokens agree. Parts:
- `dense`: an 8B-shaped Llama of `--layers` layers, every second one streamed (2/1/2): eager s/token between generates
  of 8 and 40 new tokens; one forward of a 2048-token prompt (median of 3); and transformers' compile of static-cache
  decoding (inductor, "reduce-overhead": CUDA graphs), s/token between 8 and 40 new tokens after a compiling warm-up.
- `routed`: a Qwen3-30B-A3B-shaped model of `--moe-layers` layers dispatched at half its bytes with the default
  `PrefetchConfig()`, every experts module picking at random (tests/routing.py): eager s/token between 8 and 40.
- `load`: `from_pretrained` of a checkpoint of the dense shape (written once, page cache warm), every second layer
  streamed (2/1/2), to the first token of a 16-token prompt.
A first process, not counted, runs the first part with the other package: in two H200 runs without it, the first
process (this package's, both times) decoded eager at 0.136 and 0.144 s/token, every later one of either package at
0.089-0.115. Prints, for each figure, each package's median, the paired ratios (this package over the other) and
their median.

    PYTHONPATH=. python benchmarks/package_pairs.py --previous-dir DIR [--pairs 2] [--parts dense routed load]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULT_MARK = "RESULT "
PARTS = ("dense", "routed", "load")
PROMPT_TOKENS = 16
SHORT, LONG = 8, 40


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn) -> float:
    _synchronize()
    begin = time.perf_counter()
    fn()
    _synchronize()
    return time.perf_counter() - begin


def _generate(model, ids, n: int):
    import torch

    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False)  # fmt: skip


def _per_token(model, ids) -> tuple[float, list[int]]:
    _generate(model, ids, SHORT)  # warm-up
    short = _timed(lambda: _generate(model, ids, SHORT))
    out = {}
    long = _timed(lambda: out.setdefault("tokens", _generate(model, ids, LONG)))
    return (long - short) / (LONG - SHORT), out["tokens"][0].tolist()


def _dense_model(args, device: str):
    import torch
    from common import build_model, clone_to_cpu

    torch.manual_seed(0)
    tiny = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    model = build_model(args.layers, device=device, **(tiny if args.tiny else {}))
    return clone_to_cpu(model) if device == "cuda" else model


def child_dense(args, device: str) -> dict:
    import torch

    import hf_prefetch

    config = hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=2)
    model = hf_prefetch.dispatch_model(_dense_model(args, device), config, device=device)
    ids = torch.randint(3, 200, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(1)).to(device)
    result = {}
    result["decode s/token"], tokens = _per_token(model, ids)
    prompt = torch.randint(3, 200, (1, 64 if args.tiny else 2048), generator=torch.Generator().manual_seed(2))
    prompt = prompt.to(device)
    with torch.no_grad():
        model(prompt, use_cache=False)  # warm-up
        result["prefill s"] = statistics.median(_timed(lambda: model(prompt, use_cache=False)) for _ in range(3))
    if device == "cuda":  # CUDA graphs: the GPU only
        from common import static_decode
        from transformers import StaticCache

        cache = StaticCache(config=model.config, max_cache_len=PROMPT_TOKENS + LONG + 8)
        static_decode(model, ids, cache, SHORT, True)  # compile and record
        short, _ = static_decode(model, ids, cache, SHORT, True)
        long, out = static_decode(model, ids, cache, LONG, True)
        result["compiled s/token"] = (long - short) / (LONG - SHORT)
        tokens += out[0].tolist()
    result["tokens"] = tokens
    return result


def child_routed(args, device: str) -> dict:
    import torch

    import hf_prefetch

    sys.path.insert(0, str(ROOT))  # tests.routing from this checkout, after the package under test was imported
    from tests.routing import control_routing

    torch.manual_seed(0)
    if args.tiny:
        from tests.moe_models import moe_model

        model = moe_model("qwen3_moe")
    else:
        from moe import build
        from moe_policy import SHAPES

        model = build(args.moe_layers, *SHAPES["qwen3-30b-a3b"])
    control_routing(model, "random", device=device)
    reserve = 2**16 if args.tiny else 2**30
    share = 0.8 if args.tiny else 0.5  # a tiny model's pool of two slots is half of it
    budget = int(sum(p.numel() * p.element_size() for p in model.parameters()) * share) + reserve
    hf_prefetch.dispatch_model(model, hf_prefetch.PrefetchConfig(), max_memory={0: budget}, reserve_bytes=reserve,
                               device=device)  # fmt: skip
    ids = torch.randint(3, 100, (1, 8), generator=torch.Generator().manual_seed(1)).to(device)
    seconds, tokens = _per_token(model, ids)
    return {"routed s/token": seconds, "tokens": tokens}


def child_load(args, device: str) -> dict:
    import torch

    import hf_prefetch  # and transformers: imports are not the load's

    begin = time.perf_counter()
    config = hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=2)
    model = hf_prefetch.from_pretrained(args.checkpoint, config, device=device)
    ids = torch.randint(3, 200, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        token = model(ids, logits_to_keep=1).logits[0, -1].argmax().item()
    return {"first token s": time.perf_counter() - begin, "tokens": [token]}


def _child(args) -> None:
    device = "cpu" if args.tiny else "cuda"
    result = {"dense": child_dense, "routed": child_routed, "load": child_load}[args.child](args, device)
    import hf_prefetch

    result["package"] = os.path.dirname(hf_prefetch.__file__)
    print(RESULT_MARK + json.dumps(result), flush=True)


def _save_checkpoint(args) -> None:
    # The dense shape's random weights as a safetensors checkpoint in `args.checkpoint`, once.
    folder = Path(args.checkpoint)
    if (folder / "config.json").is_file():
        return
    import torch

    model = _dense_model(args, "cuda" if not args.tiny and torch.cuda.is_available() else "cpu")
    model.save_pretrained(folder, max_shard_size="5GB")


def _run(args, part: str, package_dir: Path) -> dict:
    # One measurement in a fresh process whose `hf_prefetch` is the one in `package_dir`.
    env = {**os.environ, "PYTHONPATH": str(package_dir)}
    command = [sys.executable, __file__, "--child", part, "--layers", str(args.layers), "--moe-layers",
               str(args.moe_layers), "--checkpoint", args.checkpoint] + (["--tiny"] if args.tiny else [])  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_MARK)]
    if done.returncode != 0 or not lines:
        sys.exit(f"{part} with {package_dir} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    result = json.loads(lines[-1][len(RESULT_MARK) :])
    if not Path(result["package"]).resolve().is_relative_to(package_dir):
        sys.exit(f"{part} meant to run {package_dir / 'hf_prefetch'} ran {result['package']}")
    return result


def _figures(result: dict) -> dict[str, float]:
    # A child's timed figures (its tokens left out), rounded for the progress lines.
    return {k: round(v, 4) for k, v in result.items() if isinstance(v, float)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--previous-dir", help="a folder holding the other package's hf_prefetch folder")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--parts", nargs="*", default=list(PARTS), choices=PARTS)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--moe-layers", type=int, default=12)
    parser.add_argument("--checkpoint", default="/tmp/hf_prefetch_package_pairs")
    parser.add_argument("--tiny", action="store_true", help="tiny models on the CPU: a check of the script")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false", help="count the run's first process too")
    parser.add_argument("--child", choices=PARTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        return _child(args)
    if not args.previous_dir or not (Path(args.previous_dir) / "hf_prefetch" / "__init__.py").is_file():
        sys.exit(f"--previous-dir={args.previous_dir!r} must be a folder holding an hf_prefetch package folder")
    packages = {"this": ROOT, "previous": Path(args.previous_dir).resolve()}
    print(f"this: {ROOT / 'hf_prefetch'}; previous: {packages['previous'] / 'hf_prefetch'}", flush=True)
    if "load" in args.parts:
        _save_checkpoint(args)
    if args.warmup:  # the run's first process pays one-time costs of the machine
        warmup = _figures(_run(args, args.parts[0], packages["previous"]))
        print(f"warm-up, not counted: {args.parts[0]} previous: {warmup}", flush=True)
    rows = []
    for part in args.parts:
        results: dict[str, list[dict]] = {name: [] for name in packages}
        for pair in range(args.pairs):
            order = list(packages) if pair % 2 == 0 else list(packages)[::-1]
            for name in order:
                results[name].append(_run(args, part, packages[name]))
                print(f"{part} pair {pair} {name}: {_figures(results[name][-1])}", flush=True)
        agree = all(r["tokens"] == results["this"][0]["tokens"] for name in packages for r in results[name])
        for figure in [k for k, v in results["this"][0].items() if isinstance(v, float)]:
            this = [r[figure] for r in results["this"]]
            previous = [r[figure] for r in results["previous"]]
            ratios = [a / b for a, b in zip(this, previous, strict=True)]
            rows.append((part, figure, statistics.median(this), statistics.median(previous), ratios, agree))
    print("\n| part | figure | this | previous | this / previous, paired | median | tokens |")
    print("|---|---|---:|---:|---|---:|---|")
    for part, figure, this, previous, ratios, agree in rows:
        print(f"| {part} | {figure} | {this:.4f} | {previous:.4f} | {', '.join(f'{r:.3f}' for r in ratios)} | "
              f"{statistics.median(ratios):.3f} | {'same' if agree else 'DIFFER'} |")  # fmt: skip


if __name__ == "__main__":
    main()
