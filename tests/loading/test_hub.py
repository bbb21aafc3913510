"""Hub ids resolved through huggingface_hub's cache, laid out as huggingface_hub lays it out; no network."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import huggingface_hub
import pytest
import torch
from accelerate import init_empty_weights
from huggingface_hub import constants, errors
from huggingface_hub.utils import SafetensorsFileMetadata, TensorInfo
from transformers import AutoConfig, AutoModelForCausalLM

import hf_prefetch
from hf_prefetch.loading import hub
from tests.models import logits, tiny_llama

REPO = "tiny-org/tiny-llama"
COMMIT = hashlib.sha1(b"the first commit").hexdigest()


def cache_repo(
    cache: Path,
    repo_id: str,
    source: Path,
    *,
    commit: str = COMMIT,
    ref: str | None = "main",
    only: set[str] | None = None,
    tree: bool = True,
) -> Path:
    """`source`'s files as huggingface_hub caches a download of `repo_id` at `commit`: `blobs/<hash>` (sha256 for
    LFS files, the git blob sha1 for others), `snapshots/<commit>/<path>` relative links to them, `refs/<ref>` holding
    the commit, and the tree listing `trees/<commit>.json` of every file in the repository. `only` caches some files
    (an interrupted or partial download); the listing still names them all."""
    storage = cache / f"models--{repo_id.replace('/', '--')}"
    listing = {}
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        name, data = path.relative_to(source).as_posix(), path.read_bytes()
        lfs = name.endswith(".safetensors")
        git_sha = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        blob = hashlib.sha256(data).hexdigest() if lfs else git_sha
        entry = {"size": len(data), "blob_id": git_sha}
        if lfs:
            entry.update(lfs_sha256=blob, lfs_size=len(data))
        listing[name] = entry
        if only is not None and name not in only:
            continue
        (storage / "blobs").mkdir(parents=True, exist_ok=True)
        (storage / "blobs" / blob).write_bytes(data)
        link = storage / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(storage / "blobs" / blob, link.parent))
    (storage / "snapshots" / commit).mkdir(parents=True, exist_ok=True)
    if ref is not None:
        (storage / "refs").mkdir(parents=True, exist_ok=True)
        (storage / "refs" / ref).write_text(commit)
    if tree:
        (storage / "trees").mkdir(parents=True, exist_ok=True)
        (storage / "trees" / f"{commit}.json").write_text(json.dumps({"format_version": 1, "files": listing}))
    return storage / "snapshots" / commit


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache, offline: the environment and huggingface_hub's constants (read at its import)."""
    cache = tmp_path / "hf_cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny Llama saved in three shards with a generation config, and beside them files a load never reads."""
    folder = tmp_path_factory.mktemp("tiny_llama")
    model = tiny_llama(4)
    model.save_pretrained(folder, max_shard_size="200KB")
    (folder / "pytorch_model.bin").write_bytes(b"not read")
    (folder / "model.gguf").write_bytes(b"not read")
    (folder / "onnx").mkdir()
    (folder / "onnx" / "model.onnx").write_bytes(b"not read")
    assert len(list(folder.glob("model-*.safetensors"))) > 1
    return folder


def files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))


CONFIG = hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=1)


@pytest.mark.parametrize("revision", [None, "main", COMMIT])
def test_a_cached_hub_id_loads_bitwise_like_its_folder(hf_cache, source, revision):
    snapshot = cache_repo(hf_cache, REPO, source)
    model = hf_prefetch.from_pretrained(REPO, CONFIG, device="cpu", revision=revision)
    expected = hf_prefetch.from_pretrained(source, CONFIG, device="cpu")
    assert torch.equal(logits(model), logits(expected))
    assert hf_prefetch.get_state(model).plan == hf_prefetch.get_state(expected).plan
    assert model.config.name_or_path == REPO
    assert model.generation_config.to_dict() == expected.generation_config.to_dict()
    assert hf_prefetch.plan(REPO, CONFIG, device="cpu", revision=revision) == hf_prefetch.get_state(expected).plan
    with init_empty_weights():
        empty = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source))
    hf_prefetch.load_checkpoint_and_dispatch(empty, REPO, CONFIG, device="cpu", revision=revision)
    assert torch.equal(logits(empty), logits(expected))
    assert hub.local_folder(REPO, revision=revision) == snapshot


def test_only_the_files_a_load_reads_are_asked_for(hf_cache, source, monkeypatch):
    cache_repo(hf_cache, REPO, source)
    asked = []
    real = huggingface_hub.snapshot_download

    def recording(repo_id, **kwargs):
        asked.extend(kwargs["allow_patterns"])
        return real(repo_id, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", recording)
    hf_prefetch.from_pretrained(REPO, CONFIG, device="cpu")
    weights = sorted(p.name for p in source.glob("*.safetensors"))
    assert sorted(asked) == sorted(["config.json", "generation_config.json", "model.safetensors.index.json", *weights])


def test_a_local_folder_wins_and_is_never_sent_to_the_hub(hf_cache, source, tmp_path, monkeypatch):
    cache_repo(hf_cache, REPO, source)

    def refused(*args, **kwargs):
        raise AssertionError("a local path was sent to the Hub")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refused)
    local = tmp_path / "here" / REPO  # a folder named like the id, relative to the working directory
    local.mkdir(parents=True)
    tiny_llama(4, seed=3).save_pretrained(local)
    monkeypatch.chdir(tmp_path / "here")
    model = hf_prefetch.from_pretrained(REPO, CONFIG, device="cpu")
    assert torch.equal(logits(model), logits(tiny_llama(4, seed=3)))
    for path in ("tiny-org/a/b", "./tiny-org/b", "tiny-org/b.safetensors", "~/b", "/b/c", Path("tiny-org/b")):
        with pytest.raises(FileNotFoundError, match="has no config.json"):
            hf_prefetch.from_pretrained(path, device="cpu")
    with pytest.raises(ValueError, match=r"revision='main' choose what is read from the Hugging Face Hub, but"):
        hf_prefetch.from_pretrained(REPO, device="cpu", revision="main")


@pytest.fixture
def nested(hf_cache, source, tmp_path):
    """REPO with the model in its folder `text_model`, cached: the snapshot's folder."""
    nested = tmp_path / "nested"
    (nested / "text_model").mkdir(parents=True)
    for path in source.iterdir():
        if path.is_file():
            (nested / "text_model" / path.name).write_bytes(path.read_bytes())
    return cache_repo(hf_cache, REPO, nested) / "text_model"


def test_a_subfolder_of_a_hub_repository_is_resolved(nested, source):
    folder = hub.local_folder(REPO, subfolder="text_model")
    assert folder == nested and {"config.json", "model.safetensors.index.json"} <= set(files(folder))
    with pytest.raises(FileNotFoundError, match=r"subfolder 'vision_model'\).*lacks config.json"):
        hf_prefetch.from_pretrained(REPO, device="cpu", subfolder="vision_model")
    for bad in ("../x", "/x", 3):
        with pytest.raises(ValueError, match=r"subfolder=.* must be a relative folder"):
            hf_prefetch.from_pretrained(REPO, device="cpu", subfolder=bad)


@pytest.mark.xfail(
    strict=True,
    raises=ValueError,
    reason="Checkpoint.open follows links into the cache's blobs from a snapshot's top folder only",
)
def test_a_subfolder_of_a_hub_repository_loads(nested, source):
    model = hf_prefetch.from_pretrained(REPO, CONFIG, device="cpu", subfolder="text_model")
    assert torch.equal(logits(model), logits(hf_prefetch.from_pretrained(source, CONFIG, device="cpu")))


@pytest.mark.parametrize(
    "repo_id, revision, message",
    [
        (REPO, "v2", r"revision 'v2' of the Hub model 'tiny-org/tiny-llama' is not in the Hugging Face cache .*"
                     r"models--tiny-org--tiny-llama \(it holds main, commit [0-9a-f]{12}\); HF_HUB_OFFLINE is set"),
        (REPO, "0" * 40, r"revision '0{40}' of the Hub model"),
        ("tiny-org/not-cached", None, r"'tiny-org/not-cached' is not a local folder, and revision 'main' of the "
                                      r"Hub model 'tiny-org/not-cached' is not in the Hugging Face cache .*holds no"),
    ],
)  # fmt: skip
def test_what_the_cache_lacks_offline_is_a_clear_error_that_downloads_nothing(
    hf_cache, source, repo_id, revision, message
):
    cache_repo(hf_cache, REPO, source)
    before = files(hf_cache)
    for call in (
        lambda: hf_prefetch.from_pretrained(repo_id, device="cpu", revision=revision),
        lambda: hf_prefetch.plan(repo_id, device="cpu", revision=revision),
    ):
        with pytest.raises(FileNotFoundError, match=message) as caught:
            call()
        text = str(caught.value)
        assert f"hf download {repo_id}" in text and "unset HF_HUB_OFFLINE" in text, text
        assert files(hf_cache) == before


@pytest.mark.parametrize("tree", [True, False], ids=["tree-listing", "no-tree-listing"])
def test_a_partly_cached_snapshot_offline_names_what_is_missing(hf_cache, source, tree, arenas):
    shards = sorted(p.name for p in source.glob("model-*.safetensors"))
    only = {"config.json", "model.safetensors.index.json", *shards[:1]}
    cache_repo(hf_cache, REPO, source, only=only, tree=tree)
    before = files(hf_cache)
    # huggingface_hub's listing of a commit's files (1.x) tells an incomplete snapshot from a partial download.
    expected = "is incomplete" if tree and hasattr(errors, "IncompleteSnapshotError") else f"lacks {shards[1]}"
    with pytest.raises(FileNotFoundError, match=expected) as caught:
        hf_prefetch.from_pretrained(REPO, device="cpu")
    assert f"hf download {REPO}" in str(caught.value) and "HF_HUB_OFFLINE" in str(caught.value)
    with pytest.raises(FileNotFoundError, match=expected):
        hf_prefetch.plan(REPO, device="cpu")  # offline: the headers are in the shards
    assert files(hf_cache) == before and not arenas


def test_the_token_reaches_huggingface_hub(hf_cache, source, monkeypatch):
    cache_repo(hf_cache, REPO, source)
    tokens = []
    real = huggingface_hub.snapshot_download

    def recording(repo_id, **kwargs):
        tokens.append(kwargs["token"])
        return real(repo_id, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", recording)
    hf_prefetch.from_pretrained(REPO, CONFIG, device="cpu", token="hf_secret")
    hf_prefetch.plan(REPO, device="cpu", token="hf_secret")
    assert tokens and set(tokens) == {"hf_secret"}


def _http_error(kind, status):
    import httpx

    response = httpx.Response(status, request=httpx.Request("GET", f"https://huggingface.co/api/models/{REPO}"))
    return kind("refused", response=response)


@pytest.mark.parametrize(
    "error, kind, message",
    [
        ((errors.GatedRepoError, 403), PermissionError, r"is gated: accept its terms at https://huggingface.co/tiny-org"),
        ((errors.RepositoryNotFoundError, 401), FileNotFoundError, r"no model 'tiny-org/tiny-llama' that this token "
                                                                    r"can see.*pass token="),
        ((errors.RevisionNotFoundError, 404), FileNotFoundError, r"has no revision 'v9'"),
        ((errors.HfHubHTTPError, 401), PermissionError, r"refused access to 'tiny-org/tiny-llama' \(HTTP 401\)"),
    ],
)  # fmt: skip
def test_the_hubs_refusals_online_are_clear_errors(hf_cache, monkeypatch, arenas, error, kind, message):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def refusing(repo_id, **kwargs):
        raise _http_error(*error)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refusing)
    with pytest.raises(kind, match=message):
        hf_prefetch.from_pretrained(REPO, device="cpu", revision="v9")
    assert files(hf_cache) == [] and not arenas


def test_plan_of_a_hub_id_online_reads_the_headers_and_downloads_no_weights(hf_cache, source, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    shards = {p.name for p in source.glob("*.safetensors")}
    asked, headers = [], []

    def hub_download(repo_id, *, revision, allow_patterns, **kwargs):
        # The Hub as snapshot_download sees it: the files the patterns name are downloaded into the cache.
        asked.extend(allow_patterns)
        return str(cache_repo(hf_cache, repo_id, source, only=set(allow_patterns), tree=False))

    def parse_safetensors_file_metadata(*, repo_id, filename, revision, token):
        headers.append((filename, revision))
        data = (source / filename).read_bytes()
        header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
        metadata = header.pop("__metadata__", {})
        tensors = {key: TensorInfo(v["dtype"], v["shape"], tuple(v["data_offsets"])) for key, v in header.items()}
        return SafetensorsFileMetadata(metadata=metadata, tensors=tensors)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub_download)
    monkeypatch.setattr(huggingface_hub, "parse_safetensors_file_metadata", parse_safetensors_file_metadata)
    plan = hf_prefetch.plan(REPO, CONFIG, device="cpu")
    assert plan == hf_prefetch.plan(source, CONFIG, device="cpu")
    assert not shards & set(asked) and sorted(name for name, _ in headers) == sorted(shards)
    assert {revision for _, revision in headers} == {COMMIT}
    cached = files(hf_cache)
    assert not any(name.endswith(".safetensors") for name in cached), cached


@pytest.fixture
def online(hf_cache, monkeypatch):
    """The Hub, as snapshot_download sees it, serving `serve(folder)`'s files: the ones the patterns name are
    downloaded into the cache (as an online snapshot_download does). Returns `serve` and the patterns asked for."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    served, asked = {}, []

    def hub_download(repo_id, *, revision, allow_patterns, **kwargs):
        asked.extend(allow_patterns)
        return str(cache_repo(hf_cache, repo_id, served["folder"], only=set(allow_patterns), tree=False))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub_download)
    return lambda folder: served.update(folder=folder) or asked


def test_online_a_load_downloads_only_the_files_it_reads(hf_cache, source, online):
    asked = online(source)
    model = hf_prefetch.from_pretrained(REPO, CONFIG, device="cpu")
    assert torch.equal(logits(model), logits(hf_prefetch.from_pretrained(source, CONFIG, device="cpu")))
    cached = [name for name in files(hf_cache) if "/snapshots/" in name and not name.endswith(COMMIT)]
    assert sorted(name.rpartition("/")[2] for name in cached) == sorted(
        ["config.json", "generation_config.json", "model.safetensors.index.json"]
        + [p.name for p in source.glob("*.safetensors")]
    )
    assert not [name for name in asked if name.endswith((".bin", ".gguf", ".onnx", ".pt"))]


def test_online_a_repository_without_safetensors_is_a_clear_error(hf_cache, source, tmp_path, online, monkeypatch):
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "config.json").write_bytes((source / "config.json").read_bytes())
    (legacy / "pytorch_model.bin").write_bytes(b"not read")
    online(legacy)
    with pytest.raises(FileNotFoundError, match=r"has no model.safetensors on the Hub: hf_prefetch reads safetensors"):
        hf_prefetch.from_pretrained(REPO, device="cpu")

    def missing(*, repo_id, filename, revision, token):
        raise _http_error(errors.RemoteEntryNotFoundError, 404)

    monkeypatch.setattr(huggingface_hub, "parse_safetensors_file_metadata", missing)
    with pytest.raises(FileNotFoundError, match=r"has no model.safetensors on the Hub"):
        hf_prefetch.plan(REPO, device="cpu")
    (legacy / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"has no config.json on the Hub: it is not a transformers checkpoint"):
        hf_prefetch.plan("tiny-org/weights-only", device="cpu")
