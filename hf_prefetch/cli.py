"""The command line: `hf-prefetch plan|generate|bench PATH ...` (also `python -m hf_prefetch ...`).

- `plan PATH --max-memory 0=10GiB,cpu=64GiB`: the plan table for a checkpoint; nothing is loaded.
- `generate PATH --prompt "..." --max-new-tokens N`: loads the checkpoint with its tokenizer, streams the new text to
  the terminal as it comes, then prints seconds per token and the ratio to the transfer bound.
- `bench PATH`: measures this machine's link, decodes, and prints seconds per token, bound and ratio.

PATH is a checkpoint folder or a Hub id (`org/name`, `--revision`; `loading/hub.py`): `plan` downloads no weights,
`generate` and `bench` what a load reads and the tokenizer. The model class is `--model-class`, else the one
config.json's `architectures` names (as transformers' pipelines choose it), else the Auto class mapping its
`model_type`. Bad input ends with `hf-prefetch <command>: error: ...` and exit status 2, like argparse's errors; the
library's messages name the flags (`--reserve`) for its arguments (`reserve_bytes`), its warnings are printed as
`hf-prefetch <command>: warning: ...`.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import re
import statistics
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = ["main"]

_EPILOG = (
    "Sizes: bytes or '10GiB', '9.5GB', '500MB'. PATH is a local folder or a Hugging Face Hub id (org/name), whose "
    "files are downloaded into the Hugging Face cache unless cached (HF_HUB_OFFLINE=1: the cache only; a private "
    "model: `hf auth login` or HF_TOKEN)."
)


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
        with warnings.catch_warnings():
            # A warning's location would be this script's line; the library's text says what to change.
            warnings.showwarning = lambda message, *_, **__: print(
                f"hf-prefetch {args.command}: warning: {flags(str(message))}", file=sys.stderr
            )
            return args.run(args)
    except CommandError as error:
        print(f"hf-prefetch {args.command}: error: {error}", file=sys.stderr)
        return 2
    except (ValueError, TypeError, OSError, KeyError, ImportError) as error:
        # The library's own validation (budgets, configs, checkpoints): its message names the field and the fix.
        text = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
        print(f"hf-prefetch {args.command}: error: {flags(text)}", file=sys.stderr)
        return 2


# The library's argument names -> the flags that set them, for its messages.
_FLAGS = dict(
    reserve_bytes="--reserve", max_memory="--max-memory", group_size="--group-size", num_in_group="--num-in-group",
    prefetch_step="--prefetch-step", offload_params="--offload-params", routed_experts="--no-routed-experts",
    model_class="--model-class", revision="--revision", links="--links", device="--device", dtype="--dtype",
    compress="--compress", cpu_experts="--cpu-experts",
)  # fmt: skip
_VALUE = r"\{[^{}]*\}|\[[^\]]*\]|'[^']*'|\"[^\"]*\"|[\w.:+-]+"
_ASSIGNED = re.compile(rf"(?<![\w.])({'|'.join(_FLAGS)})(?:(\[[^\]]+\])(?!=)|(\[[^\]]+\])?=({_VALUE}))")
_NAMED = re.compile(rf"(?<![\w.-])({'|'.join(name for name in _FLAGS if '_' in name)})\b(?!\()")


def flags(message: str) -> str:
    """A library message with its argument names as the command line's flags: `reserve_bytes='1x'` -> `--reserve 1x`,
    `max_memory={0: '10GiB'}` -> `--max-memory 0=10GiB`, `max_memory[0]='x'` -> `--max-memory 0=x`."""

    def assigned(match: re.Match) -> str:
        name, entry, key, value = match.groups()
        if entry is not None:  # `max_memory[0] = 1.00 GiB`
            return f"{_FLAGS[name]} {entry[1:-1].strip(chr(39))}"
        try:
            parsed = ast.literal_eval(value)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            parsed = value.removeprefix("transformers.")
        if name in ("routed_experts", "compress"):  # flags without a value
            return _FLAGS[name] if parsed is (name == "compress") else match.group(0)
        parsed = str(parsed).lower() if name == "cpu_experts" else parsed  # --cpu-experts true|false|auto
        if isinstance(parsed, dict):
            parsed = ",".join(f"{k}={v}" for k, v in parsed.items())
        elif isinstance(parsed, list | tuple):
            parsed = ",".join(str(v) for v in parsed)
        return f"{_FLAGS[name]} {key[1:-1].strip(chr(39)) + '=' if key else ''}{parsed}"

    return _NAMED.sub(lambda match: _FLAGS[match.group(1)], _ASSIGNED.sub(assigned, message))


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
        help="print the plan for a checkpoint (nothing is loaded)",
        description="Print which layers would stream, the pool, pinned and streamed bytes and, on a GPU, the transfer "
        "time per forward, for a checkpoint folder or Hub id. Nothing is loaded: only config.json and the "
        "safetensors headers are read (of a Hub id's shards that are not cached, from the Hub: no weights are "
        "downloaded).",
        epilog=_EPILOG,
    )
    _common(plan)
    plan.set_defaults(command="plan", run=_plan)

    generate = commands.add_parser(
        "generate",
        help="load a checkpoint and generate from a prompt",
        description="Load a checkpoint folder or Hub id with hf_prefetch, stream the generated text to the terminal, "
        "then print seconds per token and the ratio to the transfer bound.",
        epilog=_EPILOG,
    )
    _common(generate)
    generate.add_argument("--prompt", required=True, help="the text to continue")
    generate.add_argument("--max-new-tokens", type=_positive_int, default=64, help="tokens to generate (64)")
    generate.add_argument("--tokenizer", help="a folder or Hub id with the tokenizer (default: the checkpoint's)")
    generate.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    generate.add_argument("--seed", type=int, default=0, help="random seed for --sample (0)")
    generate.set_defaults(command="generate", run=_generate)

    bench = commands.add_parser(
        "bench",
        help="measure the link and decode speed on this machine",
        description="Measure this machine's host-to-device link, load a checkpoint folder or Hub id with "
        "hf_prefetch, decode from a random prompt, and print seconds per token against the transfer bound.",
        epilog=_EPILOG,
    )
    _common(bench)
    bench.add_argument("--rounds", type=_positive_int, default=3, help="measurements; the median is printed (3)")
    bench.add_argument("--tokens", type=_positive_int, default=32, help="tokens decoded per measurement (32)")
    bench.add_argument("--prompt-length", type=_positive_int, default=16, help="random prompt tokens (16)")
    bench.set_defaults(command="bench", run=_bench)
    return parser


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "path", help="a checkpoint folder (config.json and safetensors weights) or a Hugging Face Hub id (org/name)"
    )
    parser.add_argument("--revision", help="of a Hub id: a branch, tag or commit (default: main)")
    parser.add_argument(
        "--model-class",
        metavar="NAME",
        help="a transformers model class or Auto class, e.g. AutoModelForSeq2SeqLM (default: the class config.json's "
        "architectures names)",
    )
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
    parser.add_argument("--compress", action="store_true", help="stream bf16/fp32 weights losslessly compressed")
    parser.add_argument("--cpu-experts", choices=("true", "false", "auto"), help="routed experts on the host's cores")
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
    if text is None or text.strip() == "auto":
        return None if text is None else "auto"
    text = text.strip()
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


@contextlib.contextmanager
def _checkpoint(args: argparse.Namespace, *, weights: bool) -> Iterator[tuple[Path, dict[str, Any]]]:
    """The checkpoint's local folder and its config.json: a folder as given; a Hub id's snapshot with what a load
    reads (`weights`) and the tokenizer, or what `plan` reads (`loading/hub.py`)."""
    from .loading import hub

    if hub.hub_id(args.path) is None:
        if args.revision is not None:
            raise CommandError(f"--revision {args.revision} reads a Hub id, but {args.path} is a local folder")
        yield _check_folder(args.path, args.path)
    elif weights:
        tokenizer = args.command == "generate" and args.tokenizer is None
        yield _check_folder(str(hub.local_folder(args.path, revision=args.revision, tokenizer=tokenizer)), args.path)
    else:
        with hub.header_folder(args.path, revision=args.revision) as folder:
            yield _check_folder(str(folder), args.path)


def _check_folder(path: str, shown: str) -> tuple[Path, dict[str, Any]]:
    if not path.strip():
        raise CommandError("the checkpoint folder is an empty string; give a folder or a Hub id (org/name)")
    try:
        folder = Path(path).expanduser()
    except RuntimeError:  # ~user that does not exist
        folder = Path(path)
    if not folder.exists():
        raise CommandError(f"{path}: no such folder, and not a Hub id (org/name). Give a checkpoint folder or an id.")
    if not folder.is_dir():
        raise CommandError(f"{path}: not a folder. Give the checkpoint folder, not a file in it.")
    if not (folder / "config.json").is_file():
        raise CommandError(f"{shown}: no config.json in this folder; is it a transformers checkpoint?")
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CommandError(f"{shown}/config.json is not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise CommandError(f"{shown}/config.json holds a JSON {type(config).__name__}, not an object of settings")
    if not any(folder.glob("*.safetensors")):
        raise CommandError(
            f"{shown}: no *.safetensors weights in this folder (hf_prefetch reads safetensors checkpoints; convert "
            "others with save_pretrained)."
        )
    return folder, config


_AUTO_CLASSES = ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModelForImageTextToText", "AutoModel")


def _transformers_class(name: Any) -> type | None:
    # A transformers model class or Auto class of that name; None for any other name.
    import transformers

    if not isinstance(name, str) or not name.isidentifier():
        return None
    try:
        found = getattr(transformers, name, None)
    except Exception:  # a class whose optional dependency is missing
        return None
    auto = isinstance(found, type) and hasattr(found, "_model_mapping") and hasattr(found, "from_config")
    return found if auto or (isinstance(found, type) and issubclass(found, transformers.PreTrainedModel)) else None


def _model_class(args: argparse.Namespace, folder: Path, config: dict[str, Any]) -> type:
    """`--model-class`; else the first class `architectures` names, as transformers' pipelines choose it; else the
    first Auto class that maps the config's model type."""
    import transformers

    architectures = config.get("architectures") or []
    names = architectures if args.model_class is None else [args.model_class]
    chosen = next((found for found in map(_transformers_class, names) if found is not None), None)
    if chosen is None and args.model_class is not None:
        named = f" (config.json's architectures: {', '.join(map(str, architectures))})" if architectures else ""
        raise CommandError(
            f"--model-class {args.model_class!r} is not a transformers model class; give an Auto class such as "
            f"{', '.join(_AUTO_CLASSES)}, or a model class such as LlamaForCausalLM or "
            f"T5ForConditionalGeneration{named}"
        )
    if chosen is None:
        model_config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
        fitting = [getattr(transformers, name) for name in _AUTO_CLASSES]
        fitting = [auto for auto in fitting if type(model_config) in auto._model_mapping]
        if not fitting:
            raise CommandError(
                f"{args.path}: no transformers class builds model_type {config.get('model_type')!r} "
                f"(architectures: {architectures}); pass --model-class NAME"
            )
        chosen = fitting[0]
    if args.command != "plan" and issubclass(chosen, transformers.PreTrainedModel) and not chosen.can_generate():
        raise CommandError(
            f"{chosen.__name__} (from {'--model-class' if args.model_class else 'config.json'}) does not generate "
            "text; pass --model-class AutoModelForCausalLM or AutoModelForSeq2SeqLM"
        )
    return chosen


def _config(args: argparse.Namespace):
    from .config import PrefetchConfig

    numbers = ("group_size", "num_in_group", "prefetch_step")
    fields: dict[str, Any] = {name: getattr(args, name) for name in numbers if getattr(args, name) is not None}
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
    if args.cpu_experts is not None:
        fields["cpu_experts"] = {"true": True, "false": False, "auto": "auto"}[args.cpu_experts]
    return PrefetchConfig(**fields)


def _load_options(args: argparse.Namespace, folder: Path, config: dict[str, Any]) -> dict[str, Any]:
    device = args.device
    if device is not None and device.isascii() and device.isdigit():
        device = int(device)  # a GPU index
    return dict(
        max_memory=parse_budget(args.max_memory),
        reserve_bytes=args.reserve,
        device=device,
        dtype=args.dtype,
        links=parse_links(args.links),
        model_class=_model_class(args, folder, config),
    )


def _plan(args: argparse.Namespace) -> int:
    import hf_prefetch

    with _checkpoint(args, weights=False) as (folder, config):
        options = _load_options(args, folder, config)
        print(hf_prefetch.plan(str(folder), _config(args), **options))
    return 0


def _bound_seconds(model) -> tuple[float | None, str]:
    """One decode token's bound, the link's or its host experts' (None on the CPU), and a sentence about the link."""
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
    speed = f"{gbps:.1f} GB/s" if state.plan.num_links == 1 else f"{state.plan.num_links} links x {gbps:.1f} GB/s"
    bound = max(per_token / (gbps * 1e9 * state.plan.num_links), state.plan.host_seconds_per_token or 0.0)
    return bound, f"link: {speed} pinned host -> {device}; {per_token / 1e9:.3f} GB/token"


def _generate(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoTokenizer, TextStreamer

    import hf_prefetch

    from .loading import hub

    with _checkpoint(args, weights=True) as (folder, config):
        options = _load_options(args, folder, config)  # every flag and the model class, before anything is read
        try:
            given, only = args.tokenizer, dict(config=False, weights=False, tokenizer=True)
            tokenizer_path = folder if given is None else hub.local_folder(given, **only)
            tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
        except (OSError, ValueError) as error:
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
            raise CommandError(
                f"no tokenizer could be loaded from {args.tokenizer or args.path} ({type(error).__name__}: "
                f"{first_line[:300]}); pass --tokenizer FOLDER"
            ) from None
        ids = tokenizer(args.prompt, return_tensors="pt").input_ids
        if ids.shape[1] == 0:
            raise CommandError(f"--prompt {args.prompt!r} gives no tokens")
        model = hf_prefetch.from_pretrained(str(folder), _config(args), **options)
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

    with _checkpoint(args, weights=True) as (folder, config):
        model = hf_prefetch.from_pretrained(str(folder), _config(args), **_load_options(args, folder, config))
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
    print(f"{args.path}: {plan.streamed_bytes_per_token / 1e9:.3f} GB streamed per decoded token on {device}")
    print(link)
    header = f"{'s/token':>9} {'bound':>9} {'x bound':>8} {'misses':>7}"
    row = f"{per_token:>9.4f} " + (f"{bound:>9.4f} {per_token / bound:>8.2f}" if bound else f"{'-':>9} {'-':>8}")
    print(header)
    print(f"{row} {stats.misses:>7}")
    what = f"decoding {args.tokens} tokens less decoding {short}, per token between them"
    what = what if args.tokens > short else "decoding 1 token, the prompt included"
    print(f"(s/token: the median of {args.rounds} round{'s' * (args.rounds > 1)}, each the time of {what}; greedy)")
    return 0


def _synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    raise SystemExit(main())
