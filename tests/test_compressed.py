"""Compressed streaming (PrefetchConfig(compress=True)): the same bits as the resident model, on every path that
reads or writes the offloaded weights."""

import logging
import warnings

import pytest
import torch
from transformers import LlamaForCausalLM

import hf_prefetch
from hf_prefetch.formats import lossless as codec
from hf_prefetch.host.arena import padded_bytes
from hf_prefetch.host.offloaded import host_value
from tests.models import assert_same_generation, generate_with_logits, prompt, tiny_llama

CONFIG = dict(group_size=2, num_in_group=1, prefetch_step=2, compress=True)


def _model(dtype=torch.bfloat16, seed=0, layers=6) -> LlamaForCausalLM:
    # Projections of 16384 elements and more: large enough to be compressed (codec.MIN_NUMEL).
    return tiny_llama(layers, seed, dtype, hidden_size=128, intermediate_size=256)


def _values(model) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("pattern", [dict(group_size=2, num_in_group=1), dict(group_size=1, num_in_group=1)])
def test_outputs_state_dict_and_removal_are_bitwise_the_resident_models(dtype, pattern):
    model = _model(dtype)
    ids = prompt(2, 9)
    want, values = generate_with_logits(model, ids), _values(model)
    hf_prefetch.dispatch_model(
        model, hf_prefetch.PrefetchConfig(prefetch_step=2, compress=True, **pattern), device="cpu"
    )
    state = hf_prefetch.get_state(model)
    compressed = [o for o in state.offloaded if o.layout is not None]
    # Every projection of every layer that takes turns in a slot; norms (too small) stay plain.
    assert compressed and all(o.host.dtype == torch.uint8 for o in compressed)
    assert not any("norm" in o.full_name for o in compressed)
    values_bytes, encoded_bytes = state.plan.compressed_bytes
    assert encoded_bytes / values_bytes < (0.76 if dtype == torch.bfloat16 else 0.88)
    assert state.plan.host_bytes < state.plan.offloaded_bytes
    assert state.arena.nbytes == state.plan.host_bytes  # the plan's pinned bytes are the arena's, padding and all
    assert_same_generation(generate_with_logits(model, ids), want)
    assert all(torch.equal(values[k], v) for k, v in model.state_dict().items())
    stats = hf_prefetch.stats(model)
    assert stats.decodes > 0 and stats.decoded_bytes > 0
    # Every decode of a layer decodes all its compressed parameters: the ratio is the plan's, layer by layer.
    assert stats.compression == pytest.approx(encoded_bytes / values_bytes)
    assert all(layer.compressed_bytes * values_bytes == layer.decoded_bytes * encoded_bytes for layer in stats.layers)
    assert "compressed MiB" in str(stats) and "decoded MiB" in str(stats)
    arena = state.arena._buffer
    inside = range(arena.data_ptr(), arena.data_ptr() + arena.numel())
    hf_prefetch.remove_offload(model)
    assert all(torch.equal(values[k], v) for k, v in model.state_dict().items())
    assert all(p.is_contiguous() for p in model.parameters())
    # Nothing keeps the compressed arena (encoded bytes and all) alive: the plain parameters got copies of their own.
    assert not any(p.data_ptr() in inside for p in model.parameters())
    del arena
    assert_same_generation(generate_with_logits(model, ids), want)


def test_the_plan_counts_encoded_bytes_and_staging():
    model = _model()
    plain = hf_prefetch.plan(model, hf_prefetch.PrefetchConfig(group_size=1, num_in_group=1, prefetch_step=2))
    packed = hf_prefetch.plan(
        model, hf_prefetch.PrefetchConfig(group_size=1, num_in_group=1, prefetch_step=2, compress=True)
    )
    assert packed.offloaded_bytes == plain.offloaded_bytes  # the values the device does not hold
    assert packed.streamed_bytes_per_forward < 0.8 * plain.streamed_bytes_per_forward
    ring = packed.rings[0]
    assert ring.staging_bytes == max(layer.staging_bytes for layer in ring.streamed) > 0
    assert packed.pool_bytes == plain.pool_bytes + padded_bytes(ring.staging_bytes) * ring.num_slots
    assert "compressed" in str(packed)


def test_layers_alone_in_their_slot_are_not_compressed():
    # 3 streamed layers, 4 slots: each is copied once, compressing it would only add a decode.
    plan = hf_prefetch.plan(_model(), hf_prefetch.PrefetchConfig(prefetch_step=4, compress=True))
    assert plan.compressed_bytes == (0, 0)


def _compress_warnings(caught) -> list[warnings.WarningMessage]:
    return [w for w in caught if "PrefetchConfig(compress=True) changes nothing" in str(w.message)]


@pytest.mark.parametrize(
    "dtype, size, why",
    [
        (torch.bfloat16, {}, f"18 under the codec's minimum of {codec.MIN_NUMEL} elements"),  # 64 x 128 at most
        (torch.float16, dict(hidden_size=128, intermediate_size=256), "18 of dtype float16, not bfloat16 or float32"),
    ],
)
def test_compress_that_compresses_nothing_says_so_once_and_the_plan_shows_it(tmp_path, dtype, size, why):
    model = tiny_llama(4, 0, dtype, **size)
    ids = prompt(1, 6)
    want = generate_with_logits(model, ids)
    config = hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=1, compress=True)  # 1 and 3 share
    nothing = f"all 18 streamed tensors stay plain ({why})"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf_prefetch.dispatch_model(model, config, device="cpu")
    (warned,) = _compress_warnings(caught)
    assert str(warned.message) == (
        f"PrefetchConfig(compress=True) changes nothing in this plan: {nothing}. Drop compress=True."
    )
    assert warned.filename == __file__  # at the caller's line
    plan = hf_prefetch.get_state(model).plan
    assert plan.compressed_bytes == (0, 0) and f"compressed             nothing: {nothing}" in str(plan)
    assert_same_generation(generate_with_logits(model, ids), want)
    hf_prefetch.remove_offload(model)
    model.save_pretrained(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = hf_prefetch.from_pretrained(tmp_path, config, device="cpu")
    assert len(_compress_warnings(caught)) == 1 and _compress_warnings(caught)[0].filename == __file__
    want = generate_with_logits(LlamaForCausalLM.from_pretrained(tmp_path, dtype=dtype), ids)
    assert_same_generation(generate_with_logits(loaded, ids), want)


def test_compress_that_compresses_some_tensors_warns_nothing_and_the_plan_lists_the_plain_ones():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = hf_prefetch.plan(_model(), hf_prefetch.PrefetchConfig(**CONFIG), device="cpu")
        model = hf_prefetch.dispatch_model(_model(), hf_prefetch.PrefetchConfig(**CONFIG), device="cpu")
    hf_prefetch.remove_offload(model)
    assert not _compress_warnings(caught)
    # Layers 1, 3 and 5 stream in 2 slots: 3 is alone in its slot; of 1 and 5, the k and v projections and the
    # norms are too small.
    assert plan.kept_plain == {
        f"under the codec's minimum of {codec.MIN_NUMEL} elements": 8,
        "in layers alone in their slot, which are copied once": 9,
    }
    assert (
        f"kept plain             17 streamed tensors: 8 under the codec's minimum of {codec.MIN_NUMEL} elements; 9 in "
        "layers alone in their slot, which are copied once"
    ) in str(plan)
    assert hf_prefetch.plan(_model(), hf_prefetch.PrefetchConfig(**{**CONFIG, "compress": False})).kept_plain == {}


def test_compress_whose_values_all_stay_plain_at_dispatch_says_so_once(caplog):
    model = _model(layers=2)  # both layers stream, taking turns in one slot
    config = hf_prefetch.PrefetchConfig(group_size=1, num_in_group=1, prefetch_step=1, compress=True)
    with torch.no_grad():  # every compressible weight: 38 exponents equally common, 23 of them escape
        for name, weight in model.named_parameters():
            if "layers." in name and weight.numel() >= codec.MIN_NUMEL:
                i = torch.arange(weight.numel(), dtype=torch.int32)
                bits = ((90 + i % 38) << 7) | (i * 37 % 128) | ((i % 3 == 0).int() << 15)
                weight.copy_(bits.to(torch.int16).view(torch.bfloat16).view(weight.shape))
    ids = prompt(1, 6)
    want = generate_with_logits(model, ids)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING, logger="hf_prefetch"):
        warnings.simplefilter("always")
        hf_prefetch.dispatch_model(model, config, device="cpu")
    (warned,) = _compress_warnings(caught)
    assert str(warned.message) == (
        "PrefetchConfig(compress=True) changes nothing for these weights: all 18 streamed tensors stay plain (10 "
        "whose values have too many rare exponents for their layout; 8 under the codec's minimum of "
        f"{codec.MIN_NUMEL} elements). Drop it."
    )
    assert warned.filename == __file__
    assert caplog.text.count("stays uncompressed") == 10  # each named in the log
    assert hf_prefetch.get_state(model).plan.compressed_bytes == (0, 0)
    assert_same_generation(generate_with_logits(model, ids), want)


def test_misses_and_interrupted_forwards_decode_the_right_layer():
    model = _model()
    ids = prompt(1, 5)
    want = generate_with_logits(model, ids)
    hf_prefetch.dispatch_model(model, hf_prefetch.PrefetchConfig(**CONFIG), device="cpu")
    layers = model.model.layers

    def interrupt(module, args):
        raise KeyboardInterrupt

    handle = layers[3].register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt), torch.no_grad():
        model(ids)
    handle.remove()
    assert_same_generation(generate_with_logits(model, ids), want)
    assert hf_prefetch.stats(model).misses > 0


def test_load_state_dict_encodes_the_new_values():
    model, other = _model(seed=0), _model(seed=1)
    ids = prompt(1, 6)
    want = generate_with_logits(other, ids)
    hf_prefetch.dispatch_model(model, hf_prefetch.PrefetchConfig(**CONFIG), device="cpu")
    generate_with_logits(model, ids)
    model.load_state_dict(other.state_dict())
    assert_same_generation(generate_with_logits(model, ids), want)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in other.state_dict().items())


def _spread(like: torch.Tensor) -> torch.Tensor:
    # One weight per exponent value, repeated: most weights escape.
    spread = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return spread.repeat(like.numel() // spread.numel() + 1)[: like.numel()].view(like.shape).to(like.dtype)


@pytest.mark.parametrize("loaded", ["model", "layer"])
def test_values_that_do_not_fit_the_layout_are_refused_and_nothing_is_written(loaded):
    # New values everywhere, one of which (the last compressed weight: earlier modules would load first) does not fit.
    model = _model()
    ids = prompt(1, 6)
    want, values = generate_with_logits(model, ids), _values(model)
    hf_prefetch.dispatch_model(model, hf_prefetch.PrefetchConfig(**CONFIG), device="cpu")
    name = [o.full_name for o in hf_prefetch.get_state(model).offloaded if o.layout is not None][-1]
    new = _values(_model(seed=1))
    new[name] = _spread(new[name])
    target, prefix = model, ""
    if loaded == "layer":  # load_state_dict on the layer itself: its pre-hook sees the call's whole state dict
        prefix = name[: name.index(".self_attn") if ".self_attn" in name else name.index(".mlp")] + "."
        target = model.get_submodule(prefix[:-1])
    new = {k[len(prefix) :]: v for k, v in new.items() if k.startswith(prefix)}
    with pytest.raises(ValueError, match=rf"The new value of {name} has \d+ weights whose exponent is outside"):
        target.load_state_dict(new)
    assert all(torch.equal(values[k], v) for k, v in model.state_dict().items())
    assert_same_generation(generate_with_logits(model, ids), want)


def test_a_tensor_that_does_not_compress_at_dispatch_stays_plain(caplog):
    model = _model()
    name = "model.layers.1.mlp.down_proj.weight"
    weight = model.get_parameter(name)
    with torch.no_grad():  # 38 exponents equally common (magnitudes below 2): 23 of them escape
        i = torch.arange(weight.numel(), dtype=torch.int32)
        bits = ((90 + i % 38) << 7) | (i * 37 % 128) | ((i % 3 == 0).int() << 15)
        weight.copy_(bits.to(torch.int16).view(torch.bfloat16).view(weight.shape))
    ids = prompt(1, 6)
    want = generate_with_logits(model, ids)
    with caplog.at_level(logging.WARNING, logger="hf_prefetch"):
        hf_prefetch.dispatch_model(model, hf_prefetch.PrefetchConfig(**CONFIG), device="cpu")
    assert f"{name} stays uncompressed" in caplog.text
    state = hf_prefetch.get_state(model)
    assert next(o for o in state.offloaded if o.full_name == name).layout is None
    assert not next(p for p in state.plan.rings[0].layers[1].params if p.name == "mlp.down_proj.weight").compressed
    assert_same_generation(generate_with_logits(model, ids), want)


def test_sync_from_device_writes_encoded_values_back():
    model = _model()
    ids = prompt(1, 6)
    want = generate_with_logits(model, ids)
    hf_prefetch.dispatch_model(model, hf_prefetch.PrefetchConfig(**CONFIG), device="cpu")
    generate_with_logits(model, ids)
    assert hf_prefetch.sync_from_device(model)
    assert_same_generation(generate_with_logits(model, ids), want)


def test_sync_from_device_writes_no_layer_when_one_does_not_fit():
    model = _model(layers=8)
    values = _values(model)
    hf_prefetch.dispatch_model(model, hf_prefetch.PrefetchConfig(**CONFIG), device="cpu")
    first, second = "model.layers.1.mlp.up_proj.weight", "model.layers.3.mlp.down_proj.weight"  # both hold a slot
    with torch.no_grad():
        model.get_parameter(first).mul_(0.5)
        model.get_parameter(second).copy_(_spread(model.get_parameter(second)))
    with pytest.raises(ValueError, match=rf"The value of {second} in its slot has \d+ weights"):
        hf_prefetch.sync_from_device(model)
    assert all(torch.equal(values[k], v) for k, v in model.state_dict().items())


def test_reload_weights_is_refused_clearly():
    model = _model()
    hf_prefetch.dispatch_model(model, hf_prefetch.PrefetchConfig(**CONFIG), device="cpu")
    with pytest.raises(ValueError, match="reload_weights does not write compressed host storage"):
        hf_prefetch.reload_weights(model, _model(seed=1).state_dict())


@pytest.mark.parametrize("fail_at", ["encode", "attach"])
def test_a_failed_dispatch_leaves_the_model_as_it_was(monkeypatch, fail_at):
    model = _model()
    ids = prompt(1, 6)
    want, values = generate_with_logits(model, ids), _values(model)
    calls = []

    def fail(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt

    if fail_at == "encode":
        real = codec.encode
        monkeypatch.setattr(codec, "encode", lambda *a: (fail(), real(*a))[1])
    else:
        import hf_prefetch.dispatch as dispatch

        monkeypatch.setattr(dispatch, "attach", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        hf_prefetch.dispatch_model(model, hf_prefetch.PrefetchConfig(**CONFIG), device="cpu")
    monkeypatch.undo()
    assert hf_prefetch.get_state(model) is None
    assert all(torch.equal(values[k], v) for k, v in model.state_dict().items())
    assert_same_generation(generate_with_logits(model, ids), want)


def test_from_pretrained_compresses_what_it_reads(tmp_path):
    model = _model()
    model.save_pretrained(tmp_path)
    ids = prompt(1, 6)
    want = generate_with_logits(LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16), ids)
    loaded = hf_prefetch.from_pretrained(tmp_path, hf_prefetch.PrefetchConfig(**CONFIG), device="cpu")
    state = hf_prefetch.get_state(loaded)
    assert any(o.layout is not None for o in state.offloaded)
    assert "compress" in state.load_timeline
    assert_same_generation(generate_with_logits(loaded, ids), want)
    assert torch.equal(host_value(state.offloaded[0]), loaded.state_dict()[state.offloaded[0].full_name])


def test_the_config_field_is_validated():
    with pytest.raises(ValueError, match=r"PrefetchConfig.compress='yes' must be True or False"):
        hf_prefetch.PrefetchConfig(compress="yes")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compressed_streaming_on_cuda_is_bitwise_the_resident_model(dtype):
    from tests.models import gpu_llama

    model = gpu_llama(dtype=dtype)
    ids = prompt(2, 9, vocab=1024).cuda()
    want = generate_with_logits(model.cuda(), ids, max_new_tokens=24)
    values = _values(model)
    model.cpu()
    hf_prefetch.dispatch_model(
        model,
        hf_prefetch.PrefetchConfig(group_size=1, num_in_group=1, prefetch_step=2, compress=True),
        device="cuda",
        timing=True,
    )
    for _ in range(2):
        assert_same_generation(generate_with_logits(model, ids, max_new_tokens=24), want)
    stats = hf_prefetch.stats(model)
    assert stats.misses == 0 and stats.decodes > 0 and stats.decode_seconds > 0
    model.load_state_dict(values)  # write-through, encoded again
    assert_same_generation(generate_with_logits(model, ids, max_new_tokens=24), want)
    hf_prefetch.remove_offload(model)
    assert all(torch.equal(values[k].cuda(), v) for k, v in model.state_dict().items())


def test_between_forwards_a_held_layer_shows_its_values_and_edits_to_it_are_synced():
    # The copies of the next forward's first layers bring encoded bytes; their parameters must show the values all
    # the same (sync_from_device's example edits a held layer's parameter and writes it back).
    model = _model(layers=8)
    values = _values(model)
    hf_prefetch.dispatch_model(model, hf_prefetch.PrefetchConfig(**CONFIG), device="cpu")
    name = "model.layers.3.mlp.up_proj.weight"  # a first layer of the ring (with layer 7 in slot 1)
    for _ in range(2):  # after the dispatch, then after a forward
        assert torch.equal(model.get_parameter(name), values[name])
        with torch.no_grad():
            model(prompt())
    with torch.no_grad():
        model.get_parameter(name).mul_(0.5)
    assert "model.layers.3" in hf_prefetch.sync_from_device(model)
    assert torch.equal(model.state_dict()[name], values[name] * 0.5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("timing", [False, True])
def test_on_cuda_held_layers_show_their_values_once_the_copies_are_done(timing):
    # After a forward the next forward's first layers are still landing (encoded) and are decoded on the copy stream
    # behind their copies: once the device has finished, their parameters are their values, and an edit is synced.
    from tests.models import gpu_llama

    model = gpu_llama()
    values = _values(model)
    config = hf_prefetch.PrefetchConfig(group_size=1, num_in_group=1, prefetch_step=2, compress=True)
    hf_prefetch.dispatch_model(model, config, device="cuda", timing=timing)
    name = "model.layers.0.mlp.up_proj.weight"  # the ring's first layer: its copy is queued at the end of a forward
    ids = prompt(1, 9, vocab=1024).cuda()
    for _ in range(2):
        with torch.no_grad():
            model(ids)
        torch.cuda.synchronize()
        assert torch.equal(model.get_parameter(name).cpu(), values[name])
    with torch.no_grad():
        model.get_parameter(name).mul_(0.5)
    assert "model.layers.0" in hf_prefetch.sync_from_device(model)
    state = model.state_dict()
    assert torch.equal(state[name].cpu(), values[name] * 0.5)
    assert all(torch.equal(state[key].cpu(), value) for key, value in values.items() if key != name)
    hf_prefetch.remove_offload(model)
