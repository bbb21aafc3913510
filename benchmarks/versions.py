"""Two versions of hf_prefetch on one model, alternately in one process: did a change move the ratios?

The previous version is a copy of the package from a git commit, renamed `hf_prefetch_prev` (its custom ops too, so
both register side by side); the script prepares it itself. Each pair dispatches the same 8B-shaped model with one
version, times decode and a 2048-token prefill, removes the offload, then does the same with the other version, in
alternating order. The link peak is measured before each pair; the table gives each version's medians against the
bound and the median of the paired ratios (current / previous), and checks that both give the same tokens.

Run on a GPU machine, in a clone:  PYTHONUNBUFFERED=1 python benchmarks/versions.py --previous 290ebb4 [--pairs 4]
(or --previous-dir DIR: a folder holding a `hf_prefetch` package of the previous version, for a checkout without git).
"""

from __future__ import annotations

import argparse
import importlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import build_model, decode_seconds_per_token, h2d_peak_gbps, prefill_seconds, save_results  # noqa: E402

import hf_prefetch  # noqa: E402

PREVIOUS = "hf_prefetch_prev"


def load_previous(commit: str | None, folder: str | None):
    """Import the previous version as `hf_prefetch_prev` (its op namespace renamed so that both can register)."""
    target = Path(tempfile.mkdtemp()) / PREVIOUS
    if folder is not None:
        shutil.copytree(Path(folder) / "hf_prefetch", target)
    else:
        target.mkdir()
        root = Path(__file__).resolve().parents[1]
        files = subprocess.run(
            ["git", "-C", str(root), "ls-tree", "--name-only", commit, "hf_prefetch/"],
            capture_output=True, text=True, check=True,
        ).stdout.split()  # fmt: skip
        for name in files:
            source = subprocess.run(
                ["git", "-C", str(root), "show", f"{commit}:{name}"], capture_output=True, check=True
            )
            (target / Path(name).name).write_bytes(source.stdout)
    for path in target.glob("*.py"):
        text = path.read_text()
        text = re.sub(r"\bhf_prefetch::", f"{PREVIOUS}::", text).replace(
            "torch.ops.hf_prefetch", f"torch.ops.{PREVIOUS}"
        )
        path.write_text(text)
    sys.path.insert(0, str(target.parent))
    return importlib.import_module(PREVIOUS)


def dispatch(version, model):
    if version is hf_prefetch:
        return hf_prefetch.dispatch_model(
            model, hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1), device="cuda"
        )
    return version.dispatch_model(model, device="cuda", group_size=2, num_in_group=1, prefetch_step=2)


def measure(version, model, ids) -> dict:
    dispatch(version, model)
    torch.cuda.synchronize()
    try:
        streamed = version.get_state(model).plan.streamed_bytes_per_forward
        decode = decode_seconds_per_token(model, ids)
        prefill = prefill_seconds(model, 2048)
        with torch.no_grad():
            tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
        misses = version.stats(model).misses
    finally:
        version.remove_offload(model, device="cuda")
    return dict(decode=decode, prefill=prefill, streamed=streamed, tokens=tokens.cpu(), misses=misses)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--previous", help="git commit of the previous version")
    parser.add_argument("--previous-dir", help="a folder holding the previous version's hf_prefetch package")
    parser.add_argument("--pairs", type=int, default=4)
    args = parser.parse_args()
    previous = load_previous(args.previous, args.previous_dir)
    versions = {"current": hf_prefetch, "previous": previous}
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  pairs {args.pairs}")
    model = build_model()
    ids = torch.randint(3, 1000, (1, 16), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    runs: dict[str, list[dict]] = {name: [] for name in versions}
    peaks = []
    for pair in range(args.pairs):
        peaks.append(h2d_peak_gbps())
        order = list(versions) if pair % 2 == 0 else list(reversed(versions))
        for name in order:
            result = measure(versions[name], model, ids)
            result["peak"] = peaks[-1]
            runs[name].append(result)
            print(f"pair {pair} {name:>8}: decode {result['decode']:.4f} s/token  "
                  f"prefill 2048 {result['prefill']:.4f} s  "
                  f"(peak {peaks[-1]:.1f} GB/s, misses {result['misses']})")  # fmt: skip
    print(f"\nlink peak before each pair: {', '.join(f'{p:.1f}' for p in peaks)} GB/s")
    print(f"{'version':<10} {'timing':<14} {'median s':>9} {'bound':>8} {'x bound':>8}")
    for name, results in runs.items():
        for key in ("decode", "prefill"):
            ratios = [r[key] / (r["streamed"] / (r["peak"] * 1e9)) for r in results]
            seconds = statistics.median(r[key] for r in results)
            bound = statistics.median(r["streamed"] / (r["peak"] * 1e9) for r in results)
            print(f"{name:<10} {key:<14} {seconds:>9.4f} {bound:>8.4f} {statistics.median(ratios):>8.3f}")
    for key in ("decode", "prefill"):
        paired = [c[key] / p[key] for c, p in zip(runs["current"], runs["previous"], strict=True)]
        print(f"current / previous, {key}: median of paired ratios {statistics.median(paired):.4f}")
    same = all(torch.equal(c["tokens"], p["tokens"]) for c, p in zip(runs["current"], runs["previous"], strict=True))
    print(f"tokens identical between versions in every pair: {same}")
    save_results(
        "versions.json", {n: [{k: v for k, v in r.items() if k != "tokens"} for r in rs] for n, rs in runs.items()}
    )


if __name__ == "__main__":
    main()
