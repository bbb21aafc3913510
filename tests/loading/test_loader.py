"""The loader end to end: tiny checkpoints written by `save_pretrained` load bitwise like transformers' loader."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from accelerate import init_empty_weights
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaModel,
    MixtralConfig,
    Qwen2Config,
    Qwen2MoeConfig,
)

import hf_prefetch
from hf_prefetch.host import diskio
from hf_prefetch.lifecycle import attach
from hf_prefetch.loading import filling, loader
from hf_prefetch.loading import reader as reader_module
from hf_prefetch.loading.checkpoint import Checkpoint
from tests.models import ATTENTION, logits, prompt

CONFIGS = {
    "llama": lambda: LlamaConfig(intermediate_size=128, num_hidden_layers=4, **ATTENTION),
    "llama-tied": lambda: LlamaConfig(
        intermediate_size=128, num_hidden_layers=4, tie_word_embeddings=True, **ATTENTION
    ),
    "qwen2": lambda: Qwen2Config(intermediate_size=128, num_hidden_layers=4, **ATTENTION),
    "gpt2": lambda: GPT2Config(n_embd=64, n_layer=4, n_head=4, vocab_size=128, bos_token_id=1, eos_token_id=2),
    "qwen2_moe": lambda: Qwen2MoeConfig(
        intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=4, **ATTENTION,
    ),
    "mixtral": lambda: MixtralConfig(
        intermediate_size=96, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=4, **ATTENTION
    ),
}  # fmt: skip
# (checkpoint name, config, tied embeddings, max_shard_size: None writes one model.safetensors)
CHECKPOINTS = {
    "llama-sharded": ("llama", False, "200KB"),
    "llama-tied-single": ("llama-tied", True, None),
    "qwen2-sharded": ("qwen2", False, "200KB"),
    "gpt2-tied-sharded": ("gpt2", True, "200KB"),
    "qwen2_moe-sharded": ("qwen2_moe", False, "200KB"),
    "mixtral-single": ("mixtral", False, None),
}
PATTERNS = {
    "every-second": dict(group_size=2, num_in_group=1, prefetch_step=1),
    "three-of-four": dict(group_size=4, num_in_group=3, prefetch_step=3),
}
MOE_PATTERN = dict(group_size=1, num_in_group=1, prefetch_step=2, offload_params={"experts"})
CASES = [(name, pattern) for name in CHECKPOINTS for pattern in PATTERNS]
CASES += [("qwen2_moe-sharded", "experts-only"), ("mixtral-single", "experts-only")]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """`saved(name)`: the folder of a checkpoint from CHECKPOINTS, written once per module by save_pretrained."""
    folders = {}

    def get(name: str):
        if name not in folders:
            config_name, tied, shard_size = CHECKPOINTS[name]
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(CONFIGS[config_name]())
            assert model.config.tie_word_embeddings is tied
            folder = tmp_path_factory.mktemp(name)
            model.save_pretrained(folder, **({"max_shard_size": shard_size} if shard_size else {}))
            index = (folder / "model.safetensors.index.json").is_file()
            assert index is (shard_size is not None)
            folders[name] = folder
        return folders[name]

    return get


def reference(folder, dtype=None) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


@pytest.mark.parametrize("name, pattern", CASES, ids=[f"{n}-{p}" for n, p in CASES])
def test_from_pretrained_matches_transformers(saved, name, pattern):
    folder = saved(name)
    model = hf_prefetch.from_pretrained(
        folder, device="cpu", offload=hf_prefetch.PrefetchConfig(**PATTERNS.get(pattern, MOE_PATTERN))
    )
    expected = reference(folder)
    assert torch.equal(logits(model), logits(expected))
    state = hf_prefetch.get_state(model)
    assert state.plan.offloaded_bytes > 0 and not model.training
    for (name_a, a), (name_b, b) in zip(model.named_buffers(), expected.named_buffers(), strict=True):
        assert name_a == name_b and torch.equal(a, b), name_a  # rotary tables computed as transformers does
    input_embeddings, output_embeddings = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert (input_embeddings is output_embeddings) is CHECKPOINTS[name][1]


@pytest.mark.parametrize("name", ["llama-sharded", "qwen2_moe-sharded", "gpt2-tied-sharded"])
def test_dtype_cast_matches_transformers(saved, name):
    folder = saved(name)
    model = hf_prefetch.from_pretrained(
        folder, device="cpu", dtype=torch.bfloat16, offload=hf_prefetch.PrefetchConfig(**PATTERNS["three-of-four"])
    )
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {o.host.dtype for o in hf_prefetch.get_state(model).offloaded} == {torch.bfloat16}
    assert torch.equal(logits(model), logits(reference(folder, dtype=torch.bfloat16)))


@pytest.mark.parametrize("target", ["folder", "index", "file"])
def test_load_checkpoint_and_dispatch_matches_transformers(saved, target):
    folder = saved("llama-tied-single" if target == "file" else "llama-sharded")
    path = {"folder": folder, "index": folder / "model.safetensors.index.json", "file": folder / "model.safetensors"}
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    loaded = hf_prefetch.load_checkpoint_and_dispatch(
        model, path[target], device="cpu", offload=hf_prefetch.PrefetchConfig(**PATTERNS["every-second"])
    )
    expected = reference(folder)
    assert loaded is model and torch.equal(logits(model), logits(expected))
    hf_prefetch.remove_offload(model)
    assert torch.equal(logits(model), logits(expected))


def test_load_checkpoint_and_dispatch_casts_on_request(saved):
    folder = saved("qwen2_moe-sharded")
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    hf_prefetch.load_checkpoint_and_dispatch(
        model, folder, device="cpu", dtype=torch.bfloat16, offload=hf_prefetch.PrefetchConfig(**MOE_PATTERN)
    )
    assert torch.equal(logits(model), logits(reference(folder, dtype=torch.bfloat16)))


def test_base_model_checkpoint_gets_the_prefix(tmp_path):
    # A checkpoint of the bare LlamaModel ("layers.0...") loads into LlamaForCausalLM ("model.layers.0...").
    torch.manual_seed(0)
    LlamaModel(CONFIGS["llama-tied"]()).save_pretrained(tmp_path)
    model = hf_prefetch.from_pretrained(
        tmp_path, device="cpu", offload=hf_prefetch.PrefetchConfig(**PATTERNS["every-second"])
    )
    assert torch.equal(logits(model), logits(reference(tmp_path)))


def test_generation_config_and_generate(tmp_path):
    torch.manual_seed(0)
    source = LlamaForCausalLM(CONFIGS["llama"]())
    source.generation_config.max_new_tokens = 3
    source.save_pretrained(tmp_path)
    model = hf_prefetch.from_pretrained(
        tmp_path, device="cpu", timing=True, offload=hf_prefetch.PrefetchConfig(**PATTERNS["every-second"])
    )
    assert model.generation_config.max_new_tokens == 3
    ids = prompt(batch=1)
    assert torch.equal(model.generate(ids, do_sample=False), reference(tmp_path).generate(ids, do_sample=False))
    s = hf_prefetch.stats(model)
    assert s.timing and s.copy_seconds > 0 and s.misses == 0


class FusedQKVLlamaForCausalLM(LlamaForCausalLM):
    """A Llama whose checkpoints store q, k and v fused: a conversion (Chunk) the loader does not stream."""


def test_conversion_that_cannot_stream_goes_through_transformers(tmp_path, caplog):
    from transformers.conversion_mapping import register_checkpoint_conversion_mapping
    from transformers.core_model_loading import Chunk, WeightConverter

    targets = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"]
    fuse = WeightConverter("self_attn.qkv_proj.weight", targets, operations=[Chunk(dim=0)])
    register_checkpoint_conversion_mapping(FusedQKVLlamaForCausalLM.__name__, [fuse], overwrite=True)
    torch.manual_seed(0)
    config = LlamaConfig(intermediate_size=128, num_hidden_layers=2, **{**ATTENTION, "num_key_value_heads": 4})
    source = LlamaForCausalLM(config).eval()
    state = source.state_dict()
    for i in range(config.num_hidden_layers):
        qkv = [state.pop(f"model.layers.{i}.{t}") for t in targets]
        state[f"model.layers.{i}.self_attn.qkv_proj.weight"] = torch.cat(qkv)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(tmp_path)

    with caplog.at_level(logging.INFO, logger="hf_prefetch.loading"):
        model = hf_prefetch.from_pretrained(
            tmp_path, hf_prefetch.PrefetchConfig(group_size=2), device="cpu", model_class=FusedQKVLlamaForCausalLM
        )
    assert "Not streamed (converted through transformers)" in caplog.text
    assert "model.layers.1.self_attn.q_proj.weight" in caplog.text
    assert torch.equal(logits(model), logits(source))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("name", ["llama-sharded", "qwen2_moe-sharded", "gpt2-tied-sharded"])
def test_cuda_load_matches_transformers(saved, monkeypatch, name, dtype):
    monkeypatch.setattr(reader_module, "_WINDOW_BYTES", 4096)  # many windows
    spans = []  # the reader's page-locked spans of the shards: none in a load (its device reads go through windows)
    monkeypatch.setattr(reader_module, "lock_read_only", lambda *args: spans.append(args))
    key = (torch.cuda.current_device(), os.stat(saved(name)).st_dev)
    monkeypatch.setattr(reader_module, "_maps_files", {key: True})  # probed: the probe's lock is not a read's
    model = hf_prefetch.from_pretrained(
        saved(name), device="cuda", dtype=dtype, offload=hf_prefetch.PrefetchConfig(**PATTERNS["every-second"])
    )
    arena = hf_prefetch.get_state(model).arena
    assert arena.pinned
    # Weights stored as loaded stay in the page cache's pages (not routed experts': kernels read those in place).
    assert (arena.file_bytes > 0) is (dtype is None and "moe" not in name)
    assert spans == []
    expected = AutoModelForCausalLM.from_pretrained(saved(name), dtype=dtype, device_map="cuda").eval()
    ids = prompt().cuda()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected(ids).logits)


def test_progress_bar_and_final_log_line(saved, caplog, capsys):
    with caplog.at_level(logging.INFO, logger="hf_prefetch.loading"):
        hf_prefetch.from_pretrained(saved("llama-sharded"), device="cpu", progress=True)
    assert "Loading checkpoint" in capsys.readouterr().err
    assert caplog.records[-1].getMessage().endswith("GB/s); pinned host 0.00 GiB, GPU 0.00 GiB")
    hf_prefetch.from_pretrained(saved("llama-sharded"), device="cpu")  # not a terminal: quiet
    assert "Loading checkpoint" not in capsys.readouterr().err


# ---- bad input: a clear error before anything large is allocated, and the model left as it was ----------------------


def empty_model(folder, **overrides) -> torch.nn.Module:
    config = AutoConfig.from_pretrained(folder, **overrides)
    with init_empty_weights():
        return AutoModelForCausalLM.from_config(config)


def assert_left_as_given(model) -> None:
    assert hf_prefetch.get_state(model) is None and not hasattr(model, "hf_device_map")
    assert all(not hasattr(m, "_hf_hook") and "_apply" not in m.__dict__ for m in model.modules())
    assert all(p.is_meta for p in model.parameters())
    assert all(not b.is_meta for b in model.buffers())


def copy_checkpoint(folder, tmp_path, edit) -> None:
    """A single-file copy of the checkpoint in `folder`, with `edit(state_dict)` applied, plus its config."""
    state = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(file)))
    edit(state)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())


def drop_norm(state):
    del state["model.norm.weight"]


def add_extra(state):
    state["model.extra.weight"] = torch.ones(3)


BAD_CHECKPOINTS = [
    ("missing-key", drop_norm, {}, r"no tensor for LlamaForCausalLM\.model\.norm\.weight \(1 missing"),
    ("unexpected-key", add_extra, {}, r"'model\.extra\.weight' \(as 'model\.extra\.weight'\) matches no parameter"),
    ("shape-mismatch", None, {"intermediate_size": 96},
     r"'model\.layers\.0\.mlp\.down_proj\.weight' has shape \[64, 128\] but LlamaForCausalLM\.model\.layers\.0\.mlp"
     r"\.down_proj\.weight has shape \[64, 96\]\. The checkpoint was saved for another configuration"),
]  # fmt: skip


@pytest.mark.parametrize("name, edit, overrides, message", BAD_CHECKPOINTS, ids=[c[0] for c in BAD_CHECKPOINTS])
def test_bad_checkpoint_is_rejected_before_allocating(saved, tmp_path, arenas, name, edit, overrides, message):
    folder = saved("llama-sharded")
    if edit is not None:
        copy_checkpoint(folder, tmp_path, edit)
        folder = tmp_path
        with pytest.raises(ValueError, match=message):
            hf_prefetch.from_pretrained(folder, device="cpu")
    model = empty_model(folder, **overrides)
    with pytest.raises(ValueError, match=message):
        hf_prefetch.load_checkpoint_and_dispatch(model, folder, device="cpu", dtype=torch.bfloat16)
    assert arenas == []
    assert_left_as_given(model)
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the requested cast was undone


def test_moe_checkpoint_for_another_expert_size(saved, arenas):
    model = empty_model(saved("qwen2_moe-sharded"), moe_intermediate_size=24)
    message = (
        r"Checkpoint tensors \['model\.layers\.0\.mlp\.experts\.0\.down_proj\.weight', .* convert to "
        r"model\.layers\.0\.mlp\.experts\.down_proj of shape \[4, 64, 32\], but Qwen2MoeForCausalLM has \[4, 64, 24\]"
    )
    with pytest.raises(ValueError, match=message):
        hf_prefetch.load_checkpoint_and_dispatch(model, saved("qwen2_moe-sharded"), device="cpu")
    assert arenas == []
    assert_left_as_given(model)


def test_corrupt_shard_is_rejected_before_building_anything(saved, tmp_path, arenas):
    folder = saved("llama-sharded")
    for file in folder.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    shard = sorted(tmp_path.glob("*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(ValueError, match=rf"{shard.name}: tensor '.*' has data_offsets .* outside .* truncated"):
        hf_prefetch.from_pretrained(tmp_path, device="cpu")
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=rf"to '{shard.name}', but .* does not exist"):
        hf_prefetch.from_pretrained(tmp_path, device="cpu")
    with pytest.raises(FileNotFoundError, match=r"has no config.json"):
        hf_prefetch.from_pretrained(tmp_path / "elsewhere", device="cpu")
    assert arenas == []


def test_tied_weights_stored_twice_must_agree(saved, tmp_path):
    folder = saved("llama-tied-single")

    def add_lm_head(value):
        return lambda state: state.update({"lm_head.weight": value(state["model.embed_tokens.weight"])})

    copy_checkpoint(folder, tmp_path, add_lm_head(lambda embeddings: embeddings.clone()))
    model = hf_prefetch.from_pretrained(tmp_path, device="cpu")
    assert torch.equal(logits(model), logits(reference(folder)))
    copy_checkpoint(folder, tmp_path, add_lm_head(lambda embeddings: embeddings + 1))
    with pytest.raises(ValueError, match=r"'model.embed_tokens.weight' and 'lm_head.weight' fill one tensor"):
        hf_prefetch.from_pretrained(tmp_path, device="cpu")


def test_meta_buffers_need_init_empty_weights_without_buffers(saved, arenas):
    folder = saved("llama-sharded")
    with init_empty_weights(include_buffers=True):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    with pytest.raises(ValueError, match=r"Buffer model\.rotary_emb\.inv_freq .* is on the meta device"):
        hf_prefetch.load_checkpoint_and_dispatch(model, folder, device="cpu")
    assert arenas == []


def test_failed_read_releases_everything(saved, monkeypatch, arenas):
    folder = saved("llama-sharded")
    model = empty_model(folder)
    buffers = dict(model.named_buffers())
    calls = []
    real_read = Checkpoint.read

    def failing_read(self, entry, out, start=0):
        calls.append(entry.key)
        if len(calls) == 10:
            raise OSError("Input/output error")
        real_read(self, entry, out, start)

    monkeypatch.setattr(Checkpoint, "read", failing_read)
    with pytest.raises(OSError, match="Input/output error"):
        hf_prefetch.load_checkpoint_and_dispatch(
            model, folder, device="cpu", offload=hf_prefetch.PrefetchConfig(**PATTERNS["every-second"])
        )
    assert len(arenas) == 1 and arenas[0]._buffer.numel() == 0  # released
    assert_left_as_given(model)
    assert all(b is buffers[name] for name, b in model.named_buffers())


@pytest.mark.parametrize("name", ["llama-sharded", "qwen2_moe-sharded", "gpt2-tied-sharded"])
@pytest.mark.parametrize("real_direct_io", [False, True])
def test_direct_reads_match_transformers(saved, monkeypatch, name, real_direct_io):
    # real_direct_io=False: windows through ordinary descriptors, so that CI runs them where tmpfs refuses O_DIRECT.
    if not real_direct_io:
        monkeypatch.setattr(reader_module, "open_direct", lambda path: os.open(path, os.O_RDONLY))
    monkeypatch.setattr(reader_module, "_WINDOW_BYTES", 8192)
    folder = saved(name)
    offload = hf_prefetch.PrefetchConfig(**PATTERNS["every-second"] if "moe" not in name else MOE_PATTERN)
    model = hf_prefetch.from_pretrained(folder, device="cpu", offload=offload, direct_io=True)
    assert torch.equal(logits(model), logits(reference(folder)))


def test_failed_direct_read_releases_everything(saved, monkeypatch, arenas):
    folder = saved("llama-sharded")
    model = empty_model(folder)
    monkeypatch.setattr(reader_module, "open_direct", lambda path: os.open(path, os.O_RDONLY))
    monkeypatch.setattr(reader_module, "_WINDOW_BYTES", 8192)
    calls, real_pread = [], diskio.pread

    def failing_pread(fd, out, position):
        calls.append(position)
        if len(calls) == 10:
            raise OSError("Input/output error")
        return real_pread(fd, out, position)

    monkeypatch.setattr(diskio, "pread", failing_pread)
    monkeypatch.setattr(reader_module, "HostArena", filling.HostArena)  # the recording arena: bounce buffers too
    with pytest.raises(OSError, match="Input/output error"):
        hf_prefetch.load_checkpoint_and_dispatch(
            model, folder, device="cpu", offload=hf_prefetch.PrefetchConfig(**PATTERNS["every-second"]), direct_io=True
        )
    assert len(arenas) == 2 and all(arena._buffer.numel() == 0 for arena in arenas)  # the weights' and the bounce
    assert_left_as_given(model)


def test_failed_attach_is_rolled_back(saved, monkeypatch, arenas):
    folder = saved("llama-sharded")
    model = empty_model(folder)
    buffers = dict(model.named_buffers())
    real_attach = attach.attach

    def attach_then_fail(model, state):
        real_attach(model, state)
        raise RuntimeError("late failure")

    monkeypatch.setattr(attach, "attach", attach_then_fail)
    with pytest.raises(RuntimeError, match="late failure"):
        hf_prefetch.load_checkpoint_and_dispatch(
            model, folder, device="cpu", offload=hf_prefetch.PrefetchConfig(**PATTERNS["every-second"])
        )
    assert len(arenas) == 1 and arenas[0]._buffer.numel() == 0
    assert_left_as_given(model)
    assert all(b is buffers[name] for name, b in model.named_buffers())
    monkeypatch.setattr(attach, "attach", real_attach)
    hf_prefetch.load_checkpoint_and_dispatch(model, folder, device="cpu")  # the same skeleton loads afterwards
    assert torch.equal(logits(model), logits(reference(folder)))


def test_argument_errors(saved):
    folder = saved("llama-sharded")
    model = hf_prefetch.from_pretrained(folder, device="cpu")
    with pytest.raises(ValueError, match=r"already dispatched; call hf_prefetch.remove_offload\(model\)"):
        hf_prefetch.load_checkpoint_and_dispatch(model, folder, device="cpu")
    with pytest.raises(ValueError, match=r"dtype='half' must be a floating-point torch.dtype"):
        hf_prefetch.load_checkpoint_and_dispatch(empty_model(folder), folder, device="cpu", dtype="half")
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['group'\]"):
        hf_prefetch.from_pretrained(folder, device="cpu", group=2)
    with pytest.raises(TypeError, match=r"device_map= is called device=.*torch_dtype= is called dtype="):
        hf_prefetch.from_pretrained(folder, device_map="auto", torch_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"direct_io='yes' must be True .*, False .* or None"):
        hf_prefetch.from_pretrained(folder, device="cpu", direct_io="yes")
    json.loads((folder / "config.json").read_text())  # untouched


def test_a_seq2seq_checkpoint_names_the_auto_class_to_pass(tmp_path):
    from transformers import AutoModelForSeq2SeqLM, T5Config, T5ForConditionalGeneration

    config = T5Config(d_model=32, d_ff=64, num_layers=2, num_heads=2, d_kv=16, vocab_size=64)
    T5ForConditionalGeneration(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"pass model_class=transformers.AutoModelForSeq2SeqLM") as caught:
        hf_prefetch.from_pretrained(tmp_path, device="cpu")
    assert len(str(caught.value)) < 400  # not transformers' list of every model type
    model = hf_prefetch.from_pretrained(tmp_path, device="cpu", model_class=AutoModelForSeq2SeqLM)
    assert type(model).__name__ == "T5ForConditionalGeneration"
    hf_prefetch.remove_offload(model)


def test_the_load_timeline_names_every_phase_in_order(saved):
    import time

    folder = saved("llama-sharded")
    started = time.perf_counter()
    model = hf_prefetch.from_pretrained(folder, device="cpu")
    elapsed = time.perf_counter() - started
    timeline = hf_prefetch.get_state(model).load_timeline
    phases = ["device", "open", "skeleton", "plan", "allocate", "read", "convert", "warm-up", "pin"]
    assert list(timeline) == [*phases, "attach", "generation config"]
    assert all(seconds >= 0 for seconds in timeline.values())
    assert sum(timeline.values()) <= elapsed
    hf_prefetch.remove_offload(model)


def test_a_background_job_is_joined_whether_or_not_it_started():
    from hf_prefetch.loading.filling import Background

    Background(lambda: None).join()  # assigned but not started (an interrupt came between): nothing to wait for

    def fail():
        raise OSError("page-locking failed")

    job = Background(fail)
    job.start()
    job.join(raise_error=False)
    with pytest.raises(OSError, match="page-locking failed"):
        job.join()


class _RecordedWarmup:
    """Stands in for `warmup.Warmup`: records when the loader starts it, hands it a model and joins it."""

    events: list[str] = []

    def __init__(self, device):
        self.seconds = None
        self.events.append(f"start {device.type}")

    def run(self, model, spare_bytes):
        self.events.append("run")

    def join(self):
        self.events.append("join")


def test_from_pretrained_starts_the_warmup_before_the_skeleton_and_joins_it_on_every_path(saved, monkeypatch):
    folder = saved("llama-sharded")
    events = _RecordedWarmup.events = []
    build = loader.build_skeleton
    monkeypatch.setattr(loader, "Warmup", _RecordedWarmup)
    monkeypatch.setattr(loader, "build_skeleton", lambda *args: (events.append("skeleton"), build(*args))[1])
    hf_prefetch.remove_offload(hf_prefetch.from_pretrained(folder, device="cpu"))
    assert events[:3] == ["start cpu", "skeleton", "run"] and set(events[3:]) == {"join"}

    events.clear()
    monkeypatch.setattr(loader, "build_skeleton", lambda *args: (events.append("skeleton"), 1 / 0))
    with pytest.raises(ZeroDivisionError):
        hf_prefetch.from_pretrained(folder, device="cpu")
    assert events == ["start cpu", "skeleton", "join"]  # a failed skeleton leaves no thread waiting for a model


def test_load_checkpoint_and_dispatch_joins_its_warmup_when_the_plan_fails(saved, monkeypatch):
    folder = saved("llama-sharded")
    events = _RecordedWarmup.events = []
    monkeypatch.setattr(loader, "Warmup", _RecordedWarmup)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(CONFIGS["llama"]())
    with pytest.raises(ValueError, match="layers"):
        hf_prefetch.load_checkpoint_and_dispatch(model, folder, device="cpu", layers="model.nothing")
    assert events == ["start cpu", "join"] and hf_prefetch.get_state(model) is None


def test_an_interrupt_right_after_the_warmup_started_joins_it(saved, monkeypatch):
    events = _RecordedWarmup.events = []
    monkeypatch.setattr(loader, "Warmup", _RecordedWarmup)

    def interrupt(self, phase, device=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(loader.LoadTimeline, "mark", interrupt)
    with pytest.raises(KeyboardInterrupt):
        hf_prefetch.from_pretrained(saved("llama-sharded"), device="cpu")
    assert events == ["start cpu", "join"]


def test_two_threads_loading_at_once_get_their_own_weights_and_leave_nn_module_as_it_was(saved):
    # accelerate's init_empty_weights patches nn.Module.register_parameter for the whole process and restores what
    # it found: two skeletons built at once could leave the patch in place, and every later module on the meta device.
    from torch import nn

    names = ["llama-sharded", "qwen2-sharded"]
    want = {name: logits(reference(saved(name))) for name in names}
    register = nn.Module.register_parameter
    try:
        for _ in range(8):
            got, errors = _load_at_once([saved(name) for name in names])
            assert errors == [] and nn.Module.register_parameter is register
            for name, result in zip(names, got, strict=True):
                assert torch.equal(result, want[name])
    finally:
        nn.Module.register_parameter = register  # a failure here must not leave every later test's modules on meta


def _load_at_once(folders) -> tuple[list, list]:
    # Each folder loaded by its own thread, all starting together: their logits, and any errors.
    import threading

    got, errors, barrier = [None] * len(folders), [], threading.Barrier(len(folders))

    def load(number, folder):
        try:
            barrier.wait()
            model = hf_prefetch.from_pretrained(folder, device="cpu", progress=False)
            got[number] = logits(model)
            hf_prefetch.remove_offload(model)
        except BaseException as err:  # reported by the caller
            errors.append(err)

    threads = [threading.Thread(target=load, args=item) for item in enumerate(folders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return got, errors


def test_a_second_interrupt_while_the_warmup_is_joined_still_rolls_back(saved, monkeypatch, arenas):
    import signal

    folder = saved("llama-sharded")
    model = empty_model(folder)

    class Interrupted(_RecordedWarmup):
        def join(self):  # a second Ctrl-C (SIGINT) arrives during the error path's join
            super().join()
            if self.events.count("join") == 1:
                signal.raise_signal(signal.SIGINT)

    _RecordedWarmup.events = []
    monkeypatch.setattr(loader, "Warmup", Interrupted)
    monkeypatch.setattr(loader, "read_all", lambda *args: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        hf_prefetch.load_checkpoint_and_dispatch(
            model, folder, device="cpu", offload=hf_prefetch.PrefetchConfig(**PATTERNS["every-second"])
        )
    assert len(arenas) == 1 and arenas[0]._buffer.numel() == 0  # released
    assert_left_as_given(model)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_attn_implementation_is_set_as_transformers_sets_it(saved, attention):
    folder = saved("llama-sharded")
    config = hf_prefetch.PrefetchConfig(**PATTERNS["every-second"])
    model = hf_prefetch.from_pretrained(folder, config, device="cpu", attn_implementation=attention)
    expected = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=attention).eval()
    assert model.config._attn_implementation == expected.config._attn_implementation == attention
    assert torch.equal(logits(model), logits(expected))
    assert hf_prefetch.plan(folder, config, device="cpu", attn_implementation=attention) == (
        hf_prefetch.get_state(model).plan
    )


def test_what_builds_a_model_is_refused_where_it_has_no_meaning(saved, arenas):
    folder = saved("llama-sharded")
    with pytest.raises(ValueError, match=r"transformers has no attention implementation 'no-such-attention'"):
        hf_prefetch.from_pretrained(folder, device="cpu", attn_implementation="no-such-attention")
    with pytest.raises(ValueError, match=r"attn_implementation=3 must be the name of one of transformers'"):
        hf_prefetch.from_pretrained(folder, device="cpu", attn_implementation=3)
    with pytest.raises(ValueError, match=r"trust_remote_code=True is not supported yet.*load_checkpoint_and_dispatch"):
        hf_prefetch.from_pretrained(folder, device="cpu", trust_remote_code=True)
    for keyword in ("attn_implementation", "trust_remote_code"):
        with pytest.raises(TypeError, match=rf"got {keyword}=, which says how a model is built; the model is built"):
            hf_prefetch.load_checkpoint_and_dispatch(empty_model(folder), folder, device="cpu", **{keyword: "eager"})
    with pytest.raises(TypeError, match=r"device_map= is called device= here .*max_memory= gives a budget"):
        hf_prefetch.from_pretrained(folder, device_map="auto")
    assert arenas == []
