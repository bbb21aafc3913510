"""The command line: `hf-prefetch plan|generate|bench PATH ...` (also `python -m hf_prefetch ...`).

- `plan PATH --max-memory 0=10GiB,cpu=64GiB`: the plan table for a local checkpoint folder; nothing is loaded.
- `generate PATH --prompt "..." --max-new-tokens N`: loads the folder with its tokenizer, streams the new text to the
  terminal as it comes, then prints seconds per token and the ratio to the transfer bound.
- `bench PATH`: measures this machine's link, decodes, and prints seconds per token, bound and ratio.

Every command reads only local files. Bad input (a missing folder, a folder without config.json or weights, a budget
that does not parse) ends with `hf-prefetch <command>: error: ...` and exit status 2, like argparse's own errors.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["main"]

_EPILOG = "Sizes: bytes or '10GiB', '9.5GB', '500MB'. Every path is a local folder: nothing is downloaded."


class CommandError(Exception):
    """A mistake in the command line or its input: printed without a traceback, exit status 2."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # a usage error (argparse printed it) or --help: the status, returned like the others
        return exit_.code if isinstance(exit_.code, int) else 2
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.run(args)
    except CommandError as error:
        print(f"hf-prefetch {args.command}: error: {error}", file=sys.stderr)
        return 2
    except (ValueError, TypeError, OSError, KeyError) as error:
        # The library's own validation (budgets, configs, checkpoints): its message names the field and the fix.
        print(f"hf-prefetch {args.command}: error: {error}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-prefetch",
        description="Run Hugging Face models larger than the GPU by streaming layers from pinned host memory.",
        epilog=_EPILOG,
    )
    parser.set_defaults(command=None)
    commands = parser.add_subparsers(title="commands", metavar="{plan,generate,bench}")

    plan = commands.add_parser(
        "plan",
        help="print the plan for a checkpoint folder (nothing is loaded)",
        description="Print which layers would stream, the pool, pinned and streamed bytes and, on a GPU, the transfer "
        "time per forward, for a local checkpoint folder. Nothing is loaded: only config.json and the safetensors "
        "headers are read.",
        epilog=_EPILOG,
    )
    _common(plan)
    plan.set_defaults(command="plan", run=_plan)

    generate = commands.add_parser(
        "generate",
        help="load a checkpoint folder and generate from a prompt",
        description="Load a local checkpoint folder with hf_prefetch, stream the generated text to the terminal, then "
        "print seconds per token and the ratio to the transfer bound.",
        epilog=_EPILOG,
    )
    _common(generate)
    generate.add_argument("--prompt", required=True, help="the text to continue")
    generate.add_argument("--max-new-tokens", type=_positive_int, default=64, help="tokens to generate (64)")
    generate.add_argument("--tokenizer", help="a folder with the tokenizer (default: the checkpoint folder)")
    generate.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    generate.add_argument("--seed", type=int, default=0, help="random seed for --sample (0)")
    generate.set_defaults(command="generate", run=_generate)

    bench = commands.add_parser(
        "bench",
        help="measure the link and decode speed on this machine",
        description="Measure this machine's host-to-device link, load a local checkpoint folder with hf_prefetch, "
        "decode from a random prompt, and print seconds per token against the transfer bound.",
        epilog=_EPILOG,
    )
    _common(bench)
    bench.add_argument("--rounds", type=_positive_int, default=3, help="measurements; the median is printed (3)")
    bench.add_argument("--tokens", type=_positive_int, default=32, help="tokens decoded per measurement (32)")
    bench.add_argument("--prompt-length", type=_positive_int, default=16, help="random prompt tokens (16)")
    bench.set_defaults(command="bench", run=_bench)
    return parser


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="a local checkpoint folder (config.json and safetensors weights)")
    parser.add_argument(
        "--max-memory",
        metavar="BUDGET",
        help="memory budget in accelerate's format, e.g. 0=10GiB,cpu=64GiB (device index or cpu = size), or 'auto'",
    )
    parser.add_argument("--reserve", metavar="SIZE", help="device memory kept free for activations and the KV cache")
    parser.add_argument("--group-size", type=_positive_int, help="stream the last --num-in-group of every group")
    parser.add_argument("--num-in-group", type=_positive_int, help="streamed layers at the end of each group")
    parser.add_argument("--prefetch-step", type=_positive_int, help="layers a copy starts ahead (buffer slots)")
    parser.add_argument("--offload-params", metavar="SEGMENTS", help="comma-separated name segments, e.g. experts")
    parser.add_argument("--no-routed-experts", action="store_true", help="stream expert tensors whole")
    parser.add_argument(
        "--compress",
        action="store_true",
        help="stream bf16/fp32 weights losslessly compressed (fewer bytes per token)",
    )
    parser.add_argument("--device", help="execution device (default: the current GPU, else cpu)")
    parser.add_argument(
        "--links", metavar="GPUS", help="GPUs whose host links share the streamed bytes: all, or indices like 0,1"
    )
    parser.add_argument("--dtype", help="weights dtype, e.g. bfloat16 (default: the checkpoint's)")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def parse_links(text: str | None) -> list[int] | str | None:
    """`all` stays a string; `0,1` -> `[0, 1]`. Whether the GPUs exist and reach each other is checked by the
    library (`links`)."""
    if text is None or text.strip() == "all":
        return None if text is None else "all"
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isascii() and part.isdigit() for part in parts):
        raise CommandError(f"--links {text!r}: give 'all' or GPU indices separated by commas, e.g. --links 0,1")
    return [int(part) for part in parts]


def parse_budget(text: str | None) -> dict[int | str, str] | str | None:
    """`0=10GiB,cpu=64GiB` -> `{0: "10GiB", "cpu": "64GiB"}`; `auto` stays a string. Sizes are checked by the
    library (`max_memory`), keys and the shape here."""
    if text is None:
        return None
    text = text.strip()
    if text == "auto":
        return text
    budget: dict[int | str, str] = {}
    for piece in text.split(","):
        key, sep, value = (part.strip() for part in piece.partition("="))
        if not sep or not key or not value:
            raise CommandError(
                f"--max-memory: {piece.strip()!r} is not DEVICE=SIZE; write e.g. --max-memory 0=10GiB,cpu=64GiB"
            )
        if key.isascii() and key.isdigit():
            device: int | str = int(key)
        elif key in ("cpu", "cuda") or key.startswith("cuda:"):
            device = key
        else:
            raise CommandError(f"--max-memory: {key!r} is not a device; use a GPU index (0, 1, ...) or cpu")
        if device in budget:
            raise CommandError(f"--max-memory names {key!r} twice; give each device one size")
        budget[device] = value
    return budget


def _check_folder(path: str) -> Path:
    if not path.strip():
        raise CommandError("the checkpoint folder is an empty string; give a local folder")
    try:
        folder = Path(path).expanduser()
    except RuntimeError:  # ~user that does not exist
        folder = Path(path)
    if not folder.exists():
        raise CommandError(f"{path}: no such folder. Give a local checkpoint folder (nothing is downloaded).")
    if not folder.is_dir():
        raise CommandError(f"{path}: not a folder. Give the checkpoint folder, not a file in it.")
    if not (folder / "config.json").is_file():
        raise CommandError(f"{path}: no config.json in this folder; is it a transformers checkpoint?")
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CommandError(f"{path}/config.json is not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise CommandError(f"{path}/config.json holds a JSON {type(config).__name__}, not an object of settings")
    if not any(folder.glob("*.safetensors")):
        raise CommandError(
            f"{path}: no *.safetensors weights in this folder (hf_prefetch reads safetensors checkpoints; convert "
            "others with save_pretrained)."
        )
    return folder


def _config(args: argparse.Namespace):
    from .config import PrefetchConfig

    fields: dict[str, Any] = {}
    for name in ("group_size", "num_in_group", "prefetch_step"):
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    if args.offload_params is not None:
        fields["offload_params"] = {s.strip() for s in args.offload_params.split(",") if s.strip()}
        if not fields["offload_params"]:
            raise CommandError(
                f"--offload-params {args.offload_params!r} names no segment; e.g. --offload-params experts"
            )
    if args.no_routed_experts:
        fields["routed_experts"] = False
    if args.compress:
        fields["compress"] = True
    return PrefetchConfig(**fields)


def _load_options(args: argparse.Namespace) -> dict[str, Any]:
    device = args.device
    if device is not None and device.isascii() and device.isdigit():
        device = int(device)  # a GPU index
    return dict(
        max_memory=parse_budget(args.max_memory),
        reserve_bytes=args.reserve,
        device=device,
        dtype=args.dtype,
        links=parse_links(args.links),
    )


def _plan(args: argparse.Namespace) -> int:
    import hf_prefetch

    folder = _check_folder(args.path)
    print(hf_prefetch.plan(str(folder), _config(args), **_load_options(args)))
    return 0


def _load(args: argparse.Namespace):
    import hf_prefetch

    folder = _check_folder(args.path)
    model = hf_prefetch.from_pretrained(str(folder), _config(args), **_load_options(args))
    return folder, model


def _bound_seconds(model) -> tuple[float | None, str]:
    """The transfer bound of one decode token (None on the CPU) and a sentence about the link."""
    import torch

    from . import get_state
    from .planning.link_speed import measure_link_gbps

    state = get_state(model)
    device = state.device
    per_token = state.plan.streamed_bytes_per_token
    if device.type != "cuda":
        return None, "link: none (CPU execution: copies are synchronous; no transfer bound)"
    with torch.cuda.device(device):
        gbps = measure_link_gbps(device)
    links = state.plan.num_links
    speed = f"{gbps:.1f} GB/s" if links == 1 else f"{links} links x {gbps:.1f} GB/s"
    return per_token / (gbps * 1e9 * links), f"link: {speed} pinned host -> {device}; {per_token / 1e9:.3f} GB/token"


def _generate(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoTokenizer, TextStreamer

    import hf_prefetch

    _check_folder(args.path)
    tokenizer_path = args.tokenizer or args.path
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
    except (OSError, ValueError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise CommandError(
            f"no tokenizer could be loaded from {tokenizer_path} ({type(error).__name__}: {first_line[:160]}); "
            "pass --tokenizer FOLDER"
        ) from None
    ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    if ids.shape[1] == 0:
        raise CommandError(f"--prompt {args.prompt!r} gives no tokens")
    folder, model = _load(args)
    device = hf_prefetch.get_state(model).device
    ids = ids.to(device)
    stamps: list[float] = []

    class Streamer(TextStreamer):
        def put(self, value):  # called with the prompt first, then once per new token
            _synchronize(device)
            stamps.append(time.perf_counter())
            super().put(value)

    streamer = Streamer(tokenizer, skip_prompt=True)
    torch.manual_seed(args.seed)
    with torch.no_grad():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=args.max_new_tokens,
            do_sample=args.sample,
            streamer=streamer,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        )
    print()
    new_tokens = len(stamps) - 1  # the first call is the prompt
    if new_tokens >= 2:
        per_token = (stamps[-1] - stamps[1]) / (new_tokens - 1)
        bound, link = _bound_seconds(model)
        ratio = f", {per_token / bound:.2f}x the transfer bound ({bound:.4f} s)" if bound else ""
        print(f"{new_tokens} tokens, {per_token:.4f} s/token after the first{ratio}", file=sys.stderr)
        print(link, file=sys.stderr)
    return 0


def _bench(args: argparse.Namespace) -> int:
    import torch

    import hf_prefetch

    folder, model = _load(args)
    state = hf_prefetch.get_state(model)
    device = state.device
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(3, max(4, vocab), (1, args.prompt_length), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)

    def run(n: int) -> float:
        _synchronize(device)
        begin = time.perf_counter()
        with torch.no_grad():
            model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False
            )
        _synchronize(device)
        return time.perf_counter() - begin

    run(2)  # warm-up: kernels, allocator
    hf_prefetch.reset_stats(model)
    short = max(1, args.tokens // 4)
    samples = []
    for _ in range(args.rounds):
        samples.append((run(args.tokens) - run(short)) / (args.tokens - short) if args.tokens > short else run(1))
    per_token = statistics.median(samples)
    bound, link = _bound_seconds(model)
    stats = hf_prefetch.stats(model)
    plan = state.plan
    print(f"{folder}: {plan.streamed_bytes_per_token / 1e9:.3f} GB streamed per decoded token on {device}")
    print(link)
    header = f"{'s/token':>9} {'bound':>9} {'x bound':>8} {'misses':>7}"
    row = (
        f"{per_token:>9.4f} {bound:>9.4f} {per_token / bound:>8.2f}"
        if bound
        else f"{per_token:>9.4f} {'-':>9} {'-':>8}"
    )
    print(header)
    print(f"{row} {stats.misses:>7}")
    print(f"(median of {args.rounds} rounds of {args.tokens} - {short} tokens, greedy, batch 1)")
    return 0


def _synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    raise SystemExit(main())
