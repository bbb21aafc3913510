"""A Hub id or a local folder -> a local folder of the files a load needs.

Every verb that takes a checkpoint (`from_pretrained`, `load_checkpoint_and_dispatch`, `plan`, the command line) takes
a local folder or a Hugging Face Hub id, `"org/name"`, resolved here through `huggingface_hub`: its cache
(`HF_HUB_CACHE`, `HF_HOME`), its offline mode (`HF_HUB_OFFLINE`), `revision`, `token` and `subfolder`, with its own
progress bars. Only what a load reads is fetched: `config.json`, `generation_config.json`, the safetensors index and
the shards it names (or `model.safetensors`), and the tokenizer's files where asked; never `*.bin`, `*.pt`, `*.gguf`,
ONNX or other copies of the weights. `header_folder` fetches less, for `plan`: where the shards are not cached, their
headers are read from the Hub and planned from as header-only stand-ins, without downloading the weights.

A local path is never sent to the Hub: a `Path`, an existing file or folder, and a string that is not `org/name` stay
local (and get the loaders' own errors). Every failure to find a Hub id's files names the id, the revision, the cache
folder and the fix, and is raised before anything is loaded.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from .checkpoint import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

__all__ = ["hub_id", "local_folder", "header_folder", "TOKENIZER_FILES"]

CONFIG_FILES = ("config.json", "generation_config.json")
# What transformers' tokenizers read (the files of every tokenizer class, fast or slow, and chat templates).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)


def hub_id(path: Any) -> str | None:
    """`path` as a Hub model id (`"org/name"`), or None for a local path: a `Path`, an existing file or folder, or a
    string of another form (`./x`, `/x`, `~/x`, `a/b/c`, `x.safetensors`)."""
    if not isinstance(path, str) or os.path.lexists(path) or path.count("/") != 1:
        return None
    if path.startswith((".", "~")) or path.endswith((".safetensors", ".json")):
        return None
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(path)
    except HFValidationError:
        return None
    return path


def local_folder(
    path: str | os.PathLike,
    *,
    revision: str | None = None,
    token: bool | str | None = None,
    subfolder: str | None = None,
    config: bool = True,
    weights: bool = True,
    tokenizer: bool = False,
) -> Path:
    """The local folder of `path`: a local path as it is (joined with `subfolder`); for a Hub id, the snapshot folder
    in the Hugging Face cache holding `config.json` and `generation_config.json` (`config`), the safetensors weights
    (`weights`) and the tokenizer's files (`tokenizer`, with the config files where the repository has them),
    downloaded where they are not cached."""
    repo = _Repo.of(path, revision, token, subfolder)
    if repo is None:
        return _local(path, subfolder)
    names = [*(CONFIG_FILES if config or tokenizer else ()), *((SAFE_WEIGHTS_INDEX_NAME,) if weights else ())]
    snapshot = repo.snapshot([*names, *(TOKENIZER_FILES if tokenizer else ())], repo.revision)
    folder = snapshot / repo.subfolder
    shards = _shards(folder) if weights else []
    if shards:
        repo.snapshot(shards, snapshot.name)  # the commit the first call resolved: one revision for every file
    repo.check(folder, snapshot.name, [*(["config.json"] if config else []), *shards])
    return folder


@contextlib.contextmanager
def header_folder(
    path: str | os.PathLike,
    *,
    revision: str | None = None,
    token: bool | str | None = None,
    subfolder: str | None = None,
) -> Iterator[Path]:
    """What `plan` reads (`config.json` and the safetensors headers) in a local folder. A local path and a Hub id
    whose weights are cached (or, offline, must be) give `local_folder`'s folder. Otherwise the shards' headers are
    read from the Hub (a few ranges of each file) into a temporary folder beside `config.json`: each shard a stand-in
    of its full size holding its header, the data left as holes (no disk space, and no byte of it read by a plan);
    the folder is removed on exit. A bitsandbytes checkpoint's shards are downloaded instead: its model is built from
    values stored in them (the packed quantization settings)."""
    repo = _Repo.of(path, revision, token, subfolder)
    if repo is None:
        yield _local(path, subfolder)
        return
    snapshot = repo.snapshot([*CONFIG_FILES, SAFE_WEIGHTS_INDEX_NAME], repo.revision)
    folder = snapshot / repo.subfolder
    shards = _shards(folder)
    repo.check(folder, snapshot.name, ["config.json"])
    cached = all((folder / shard).is_file() for shard in shards)
    if repo.offline or cached or not shards or _reads_values(folder):
        yield local_folder(path, revision=revision, token=token, subfolder=subfolder)
        return
    with tempfile.TemporaryDirectory(prefix="hf_prefetch_plan_") as stand_in:
        repo.stand_ins(folder, snapshot.name, shards, Path(stand_in))
        yield Path(stand_in)


def _local(path: str | os.PathLike, subfolder: str | None) -> Path:
    folder = Path(path)
    return folder / _subfolder(subfolder) if subfolder else folder


def _subfolder(subfolder: Any) -> str:
    if subfolder is None or subfolder == "":
        return ""
    pure = PurePosixPath(subfolder) if isinstance(subfolder, str) else None
    if pure is None or pure.is_absolute() or ".." in pure.parts or "\\" in subfolder:
        raise ValueError(
            f"subfolder={subfolder!r} must be a relative folder inside the checkpoint, such as 'text_encoder'."
        )
    return "/".join(pure.parts)


def _shards(folder: Path) -> list[str]:
    # The shards the index names (plain relative names only: Checkpoint.open refuses the others with its own
    # message), or the single file. An index that does not parse is left to Checkpoint.open's message.
    index = folder / SAFE_WEIGHTS_INDEX_NAME
    if not index.is_file():
        return [SAFE_WEIGHTS_NAME]
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        names = {name for name in weight_map.values() if isinstance(name, str)}
    except (OSError, ValueError, AttributeError, RecursionError):
        return []
    plain = {n for n in names if not PurePosixPath(n).is_absolute() and ".." not in PurePosixPath(n).parts}
    return sorted(plain)


def _reads_values(folder: Path) -> bool:
    # A bitsandbytes checkpoint's model is built from settings stored as tensors (formats/bnb.py).
    try:
        quantization = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("quantization_config")
    except (OSError, ValueError, AttributeError, RecursionError):
        return False
    return isinstance(quantization, dict) and quantization.get("quant_method") == "bitsandbytes"


@dataclass(frozen=True)
class _Repo:
    """A Hub model id with the revision, token and subfolder to read it at, and huggingface_hub's cache settings."""

    id: str
    revision: str
    token: bool | str | None
    subfolder: str
    cache: Path
    offline: bool

    @classmethod
    def of(cls, path: Any, revision: Any, token: Any, subfolder: Any) -> _Repo | None:
        repo_id = hub_id(path)
        if repo_id is None:
            given = [f"{name}={value!r}" for name, value in (("revision", revision), ("token", token)) if value]
            if given:
                raise ValueError(
                    f"{' and '.join(given)} choose what is read from the Hugging Face Hub, but {str(path)!r} is a "
                    "local path, read as it is. Drop them, or pass a Hub id ('org/name')."
                )
            return None
        if revision is not None and (not isinstance(revision, str) or not revision.strip()):
            raise ValueError(f"revision={revision!r} must be a branch, tag or commit hash of {repo_id!r}, or None.")
        from huggingface_hub import constants

        return cls(
            repo_id,
            revision or "main",
            token,
            _subfolder(subfolder),
            Path(constants.HF_HUB_CACHE).expanduser(),
            bool(constants.HF_HUB_OFFLINE),
        )

    @property
    def storage(self) -> Path:
        return self.cache / f"models--{self.id.replace('/', '--')}"

    def prefixed(self, name: str) -> str:
        return f"{self.subfolder}/{name}" if self.subfolder else name

    def snapshot(self, names: list[str], revision: str) -> Path:
        """The snapshot folder of `revision` with those of `names` that the repository has, downloaded (offline: as
        cached; the caller checks what it needs is there)."""
        import huggingface_hub

        with self.errors(revision):
            folder = huggingface_hub.snapshot_download(
                self.id,
                revision=revision,
                token=self.token,
                cache_dir=self.cache,
                allow_patterns=[self.prefixed(name) for name in names],
                local_files_only=self.offline,
            )
        return Path(folder)

    def check(self, folder: Path, commit: str, files: list[str]) -> None:
        """`FileNotFoundError` unless every one of `files` is in `folder`, the snapshot of `commit`."""
        missing = [name for name in files if not (folder / name).is_file()]
        if not missing:
            return
        where = f"{self.id!r} (revision {self.revision!r}, commit {commit[:12]}"
        where += f", subfolder {self.subfolder!r})" if self.subfolder else ")"
        if self.offline:
            raise FileNotFoundError(
                f"{where}: the Hugging Face cache ({self.storage}) lacks {_some(missing)}, and HF_HUB_OFFLINE is set, "
                f"so nothing was downloaded. {self.fix()}"
            )
        if missing[0] == "config.json":
            raise FileNotFoundError(
                f"{where} has no {self.prefixed('config.json')} on the Hub: it is not a transformers checkpoint. "
                "Pass the id of a transformers model, or its subfolder= where the model lies in one."
            )
        raise FileNotFoundError(
            f"{where} has no {_some([self.prefixed(m) for m in missing])} on the Hub: hf_prefetch reads safetensors "
            "checkpoints (model.safetensors, or model.safetensors.index.json and its shards). Pick a revision that "
            "has them, or load the model with transformers and save it with save_pretrained."
        )

    def fix(self) -> str:
        revision = "" if self.revision == "main" else f" --revision {self.revision}"
        return (
            f"Go online (unset HF_HUB_OFFLINE), or download it first where the Hub can be reached: "
            f"`hf download {self.id}{revision}` (into the same cache), or pass a local folder."
        )

    @contextlib.contextmanager
    def errors(self, revision: str) -> Iterator[None]:
        """huggingface_hub's errors as errors that name the id, the revision, the cache folder and the fix."""
        from huggingface_hub import errors

        name = f"{self.id!r} is not a local folder"
        try:
            yield
        except errors.GatedRepoError as error:
            raise PermissionError(
                f"{name}, and the Hub model {self.id!r} is gated: accept its terms at https://huggingface.co/"
                f"{self.id}, then log in (`hf auth login`) or pass token=."
            ) from error
        except errors.RepositoryNotFoundError as error:
            raise FileNotFoundError(
                f"{name}, and the Hub has no model {self.id!r} that this token can see: check the id (org/name), "
                "and for a private model log in (`hf auth login`) or pass token=."
            ) from error
        except errors.RevisionNotFoundError as error:
            raise FileNotFoundError(
                f"The Hub model {self.id!r} has no revision {revision!r}: pass a branch, tag or commit hash it has "
                "(revision='main' by default)."
            ) from error
        except errors.LocalEntryNotFoundError as error:
            reason = (
                "HF_HUB_OFFLINE is set, so nothing was downloaded"
                if self.offline
                else f"the Hub could not be reached ({_first_line(error.__cause__ or error)})"
            )
            if type(error).__name__ == "IncompleteSnapshotError":  # the snapshot is cached, some of its files not
                raise FileNotFoundError(
                    f"{name}, and the Hugging Face cache's snapshot of revision {revision!r} of the Hub model "
                    f"{self.id!r} ({self.storage}) is incomplete: it lacks files a load reads; {reason}. {self.fix()}"
                ) from error
            cached = _cached_revisions(self.storage)
            cached_text = f" (it holds {', '.join(cached)})" if cached else " (it holds no revision of it)"
            raise FileNotFoundError(
                f"{name}, and revision {revision!r} of the Hub model {self.id!r} is not in the Hugging Face cache "
                f"{self.storage}{cached_text}; {reason}. {self.fix()}"
            ) from error
        except errors.HfHubHTTPError as error:
            status = getattr(getattr(error, "response", None), "status_code", None)
            if status in (401, 403):
                raise PermissionError(
                    f"{name}, and the Hub refused access to {self.id!r} (HTTP {status}): log in (`hf auth login`) "
                    "or pass token= with access to it."
                ) from error
            raise OSError(f"Reading {self.id!r} (revision {revision!r}) from the Hub failed: {error}") from error

    def stand_ins(self, folder: Path, commit: str, shards: list[str], into: Path) -> None:
        """`folder`'s small files copied `into` a folder, and each shard a header-only stand-in read from the Hub."""
        import huggingface_hub
        from huggingface_hub.errors import EntryNotFoundError, SafetensorsParsingError
        from huggingface_hub.utils import tqdm

        for name in (*CONFIG_FILES, SAFE_WEIGHTS_INDEX_NAME):
            if (folder / name).is_file():
                shutil.copyfile(folder / name, into / name)

        def header(shard: str) -> Any:
            with self.errors(commit):
                try:
                    return huggingface_hub.parse_safetensors_file_metadata(
                        repo_id=self.id, filename=self.prefixed(shard), revision=commit, token=self.token
                    )
                except SafetensorsParsingError as error:
                    raise ValueError(f"{self.id!r}: {error} Re-upload or re-save the checkpoint.") from None
                except EntryNotFoundError:  # not in the repository (the index names it, or there is no index)
                    self.check(folder, commit, [shard])  # the message of a file the Hub does not have
                    raise

        with ThreadPoolExecutor(8) as pool, tqdm(total=len(shards), desc="Reading safetensors headers") as bar:
            for shard, metadata in zip(shards, pool.map(header, shards), strict=True):
                _write_stand_in(into / shard, metadata)
                bar.update()


def _write_stand_in(path: Path, metadata: Any) -> None:
    # A safetensors file of the shard's full size: its header (tensor names, dtypes, shapes, offsets, metadata), then
    # holes where the data would be.
    header: dict[str, Any] = {"__metadata__": metadata.metadata} if metadata.metadata else {}
    for name, info in metadata.tensors.items():
        header[name] = {"dtype": info.dtype, "shape": list(info.shape), "data_offsets": list(info.data_offsets)}
    raw = json.dumps(header).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    end = max((info.data_offsets[1] for info in metadata.tensors.values()), default=0)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as file:
        file.write(len(raw).to_bytes(8, "little") + raw)
        file.truncate(8 + len(raw) + end)


def _cached_revisions(storage: Path) -> list[str]:
    refs = storage / "refs"
    named = sorted(p.relative_to(refs).as_posix() for p in refs.rglob("*") if p.is_file()) if refs.is_dir() else []
    commits = sorted(p.name[:12] for p in (storage / "snapshots").glob("*") if p.is_dir())
    return [*named, *(f"commit {c}" for c in commits)]


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:200] if text else ''}"
