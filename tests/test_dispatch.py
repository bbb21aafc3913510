import gc
import subprocess
import sys
import weakref

import pytest
import torch
from accelerate.hooks import ModelHook, add_hook_to_module

import hf_prefetch
from hf_prefetch import PrefetchConfig
from tests.models import llama_and_logits, prompt, tiny_llama

PATTERNS = [(2, 1), (8, 2), (4, 3), (1, 1), (3, 1)]


@pytest.fixture(scope="module")
def reference():
    model, ids, logits = llama_and_logits(8)
    tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    return model, ids, logits, tokens, state


def _counters(model):
    return hf_prefetch.stats(model)


@pytest.mark.parametrize("prefetch_step", [1, 2, 3, 4])
@pytest.mark.parametrize("group_size, num_in_group", PATTERNS)
def test_logits_and_tokens_are_bitwise_equal(reference, group_size, num_in_group, prefetch_step):
    model, ids, logits, tokens, state = reference
    hf_prefetch.dispatch_model(
        model,
        hf_prefetch.PrefetchConfig(group_size=group_size, num_in_group=num_in_group, prefetch_step=prefetch_step),
        device="cpu",
    )
    try:
        with torch.no_grad():
            for _ in range(3):
                assert torch.equal(model(ids).logits, logits)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
        assert torch.equal(out, tokens)
        assert _counters(model).misses == 0
        streamed = len(hf_prefetch.get_state(model).plan.rings[0].streamed)
        if streamed > prefetch_step:
            assert _counters(model).copies > streamed  # the weights really streamed, forward after forward
    finally:
        hf_prefetch.remove_offload(model)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, state[name]), name


def test_streamed_parameters_point_at_pool_slots(reference):
    model = reference[0]
    hf_prefetch.dispatch_model(
        model, hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=2), device="cpu"
    )
    try:
        layers = model.model.layers
        # layers 1 and 5 are the 1st and 3rd streamed layers: both use slot 0
        assert layers[1].mlp.up_proj.weight.data_ptr() == layers[5].mlp.up_proj.weight.data_ptr()
        assert layers[1].mlp.up_proj.weight.data_ptr() != layers[3].mlp.up_proj.weight.data_ptr()
        assert layers[0].mlp.up_proj.weight.data_ptr() != layers[2].mlp.up_proj.weight.data_ptr()
        assert layers[1].mlp.up_proj.weight.requires_grad  # as before: aten's matmul picks its path by it
        assert model.device == torch.device("cpu") and model.dtype == torch.float32
        assert not hasattr(model, "hf_device_map")  # set under pipeline placement only
    finally:
        hf_prefetch.remove_offload(model)
    assert model.model.layers[1].mlp.up_proj.weight.requires_grad
    assert not hasattr(model, "hf_device_map")
    assert not any(hasattr(m, "_hf_hook") for m in model.modules())


def test_streamed_parameters_keep_requires_grad_so_the_numbers_do_not_change():
    # aten's matmul of a 2-D weight and a 3-D tensor folds it or not by the weight's requires_grad, under no_grad too:
    # Mamba's `dt_proj.weight @ time_step.transpose(1, 2)` gave other bits once a dispatch set requires_grad=False.
    from transformers import MambaConfig, MambaForCausalLM

    config = MambaConfig(hidden_size=64, num_hidden_layers=4, vocab_size=128, state_size=8, expand=2, conv_kernel=4)
    torch.manual_seed(0)
    model = MambaForCausalLM(config).eval()
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    hf_prefetch.dispatch_model(model, hf_prefetch.PrefetchConfig(group_size=1, prefetch_step=2), device="cpu")
    try:
        assert all(param.requires_grad for param in model.parameters())
        with torch.no_grad():
            assert torch.equal(model(input_ids=ids).logits, expected)
    finally:
        hf_prefetch.remove_offload(model)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, expected)


def test_a_to_that_changes_nothing_returns_the_module_and_any_other_is_refused(reference):
    model, ids, logits, *_ = reference
    hf_prefetch.dispatch_model(model, hf_prefetch.PrefetchConfig(group_size=2), device="cpu")
    try:
        layer = model.model.layers[1]
        assert model.to(torch.float32) is model and layer.to("cpu") is layer and layer.to(ids.device) is layer
        for convert in (lambda: model.to(torch.float16), lambda: layer.to("meta"), model.half):
            with pytest.raises(RuntimeError, match="conversions would detach the offloaded weights"):
                convert()
        assert all(param.dtype == torch.float32 and param.device.type == "cpu" for param in model.parameters())
        with torch.no_grad():
            assert torch.equal(model(ids).logits, logits)
    finally:
        hf_prefetch.remove_offload(model)
    assert not any("to" in module.__dict__ for module in model.modules())


def test_a_kept_to_of_a_deleted_model_says_so():
    model = hf_prefetch.dispatch_model(tiny_llama(4), hf_prefetch.PrefetchConfig(group_size=2), device="cpu")
    kept = model.model.layers[1].to
    del model
    with pytest.raises(RuntimeError, match="belonged to a module that no longer exists"):
        kept(torch.float32)


def test_a_router_that_converts_itself_to_its_own_dtype_in_every_forward_streams():
    # SwitchTransformers' router runs `self.classifier = self.classifier.to(self.dtype)` in every forward: a `.to()`
    # that changes nothing, which the dispatch's guard on conversions refused.
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

    config = SwitchTransformersConfig(
        vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=4, num_decoder_layers=4, num_heads=4, num_experts=4,
        expert_capacity=8, encoder_sparse_step=2, decoder_sparse_step=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = SwitchTransformersForConditionalGeneration(config).eval()
    ids, decoder_ids = torch.randint(3, 128, (1, 7)), torch.randint(3, 128, (1, 5))
    with torch.no_grad():
        expected = model(input_ids=ids, decoder_input_ids=decoder_ids).logits
    hf_prefetch.dispatch_model(model, hf_prefetch.PrefetchConfig(group_size=2, prefetch_step=1), device="cpu")
    try:
        with torch.no_grad():
            assert torch.equal(model(input_ids=ids, decoder_input_ids=decoder_ids).logits, expected)
        assert hf_prefetch.stats(model).misses == 0
    finally:
        hf_prefetch.remove_offload(model)


def test_generate_of_an_encoder_decoder_leaves_no_hook_after_the_removal():
    # transformers' generate hooks the encoder of a model with `hf_device_map` (set by the dispatch); the hook stayed
    # after remove_offload. The dispatch now sets it, so the removal takes it off.
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=4, num_heads=4, decoder_start_token_id=0)
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(config).eval()
    ids = torch.randint(3, 128, (1, 7))
    expected = model.generate(ids, max_new_tokens=5, do_sample=False)
    hf_prefetch.dispatch_model(model, hf_prefetch.PrefetchConfig(group_size=2), device="cpu")
    assert torch.equal(model.generate(ids, max_new_tokens=5, do_sample=False), expected)
    hf_prefetch.remove_offload(model)
    leftovers = [name for name, m in model.named_modules() if {"_hf_hook", "_old_forward", "forward"} & set(vars(m))]
    assert leftovers == []
    assert torch.equal(model.generate(ids, max_new_tokens=5, do_sample=False), expected)


def _word_tokenizer():
    # A word-level tokenizer over the tiny models' 128 ids, built here (nothing is downloaded).
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = "the a cat dog sat on mat and ran".split()
    vocab = {
        "<unk>": 0,
        "<eos>": 1,
        "<pad>": 2,
        **{w: i + 3 for i, w in enumerate(words + [f"w{i}" for i in range(116)])},
    }
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<eos>", pad_token="<pad>")


def test_a_dispatched_model_generates_in_a_transformers_pipeline_and_saves_without_a_warning(tmp_path):
    # The dispatch set `hf_device_map` = {"": "cpu"} on every model: transformers' pipeline then refused `device=`
    # ("loaded with `accelerate`"), and save_pretrained warned of offloaded modules.
    import copy
    import warnings

    from safetensors.torch import load_file
    from transformers import pipeline

    model, tokenizer = tiny_llama(4, eos_token_id=None), _word_tokenizer()
    settings = dict(max_new_tokens=8, do_sample=False, return_tensors=True)
    expected = pipeline("text-generation", model=copy.deepcopy(model), tokenizer=tokenizer, device="cpu")
    expected = expected("the cat sat on", **settings)
    hf_prefetch.dispatch_model(model, PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=1), device="cpu")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            generator = pipeline("text-generation", model=model, tokenizer=tokenizer, device="cpu")
            assert generator("the cat sat on", **settings) == expected  # the same token ids
            model.save_pretrained(tmp_path)
        assert [str(w.message) for w in caught if "offload" in str(w.message)] == []
        saved, state = load_file(tmp_path / "model.safetensors"), model.state_dict()
        assert saved.keys() == state.keys() and all(torch.equal(saved[name], state[name]) for name in state)
    finally:
        hf_prefetch.remove_offload(model)


def test_state_dict_holds_true_values_not_slot_contents(reference):
    model, *_, state = reference
    hf_prefetch.dispatch_model(
        model, hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=1), device="cpu"
    )
    try:
        current = model.state_dict()
        assert current.keys() == state.keys()
        for name, tensor in current.items():
            assert torch.equal(tensor, state[name]), name
    finally:
        hf_prefetch.remove_offload(model)


class _Boom(RuntimeError):
    pass


@pytest.mark.parametrize("failing_layer", [1, 2, 5])
def test_forward_interrupted_in_a_layer_stays_correct(reference, failing_layer):
    model, ids, logits, tokens, _ = reference
    hf_prefetch.dispatch_model(
        model, hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=2), device="cpu"
    )
    mlp = model.model.layers[failing_layer].mlp
    original = mlp.forward

    def explode(*args, **kwargs):
        raise _Boom("interrupted")

    try:
        mlp.forward = explode
        with pytest.raises(_Boom), torch.no_grad():
            model(ids)
        mlp.forward = original
        with torch.no_grad():
            for _ in range(3):
                assert torch.equal(model(ids).logits, logits)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
        assert torch.equal(out, tokens)
    finally:
        mlp.forward = original
        hf_prefetch.remove_offload(model)


def test_unusual_call_order_is_a_counted_miss_not_wrong_weights(reference):
    model, ids, *_ = reference
    layers = model.model.layers
    hidden = torch.randn(1, 4, 64)
    position_embeddings = model.model.rotary_emb(hidden, torch.arange(4)[None])
    with torch.no_grad():
        expected = [layers[i](hidden, position_embeddings=position_embeddings) for i in (5, 1, 1, 7, 3)]
    hf_prefetch.dispatch_model(
        model, hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=2), device="cpu"
    )
    try:
        with torch.no_grad():
            got = [layers[i](hidden, position_embeddings=position_embeddings) for i in (5, 1, 1, 7, 3)]
        for a, b in zip(got, expected, strict=True):
            assert torch.equal(a, b)
        assert _counters(model).misses >= 3
    finally:
        hf_prefetch.remove_offload(model)


def test_dispatch_twice_needs_remove_or_replace(reference):
    model, ids, logits, *_ = reference
    hf_prefetch.dispatch_model(
        model, hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=1), device="cpu"
    )
    try:
        with pytest.raises(
            ValueError, match=r"already dispatched.*remove_offload\(model\) first, or pass replace=True"
        ):
            hf_prefetch.dispatch_model(
                model, hf_prefetch.PrefetchConfig(group_size=4, num_in_group=2, prefetch_step=2), device="cpu"
            )
        hf_prefetch.dispatch_model(
            model,
            hf_prefetch.PrefetchConfig(group_size=4, num_in_group=2, prefetch_step=2),
            device="cpu",
            replace=True,
        )
        plan = hf_prefetch.get_state(model).plan
        assert [layer.index for layer in plan.rings[0].streamed] == [2, 3, 6, 7]
        with torch.no_grad():
            assert torch.equal(model(ids).logits, logits)
        assert sum(isinstance(getattr(m, "_hf_hook", None), ModelHook) for m in model.modules()) == 4
    finally:
        hf_prefetch.remove_offload(model)
    hf_prefetch.dispatch_model(
        model, hf_prefetch.PrefetchConfig(group_size=1, num_in_group=1, prefetch_step=3), device="cpu"
    )
    try:
        with torch.no_grad():
            assert torch.equal(model(ids).logits, logits)
    finally:
        hf_prefetch.remove_offload(model, device="cpu")


class _CountingHook(ModelHook):
    def __init__(self):
        self.calls = 0

    def pre_forward(self, module, *args, **kwargs):
        self.calls += 1
        return args, kwargs


def test_existing_hook_is_chained_and_restored(reference):
    model, ids, logits, *_ = reference
    counting = _CountingHook()
    add_hook_to_module(model.model.layers[1], counting)
    try:
        hf_prefetch.dispatch_model(
            model, hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=2), device="cpu"
        )
        with torch.no_grad():
            assert torch.equal(model(ids).logits, logits)
        assert counting.calls == 1
        hf_prefetch.remove_offload(model)
        assert model.model.layers[1]._hf_hook is counting
        with torch.no_grad():
            model(ids)
        assert counting.calls == 2
    finally:
        from accelerate.hooks import remove_hook_from_module

        remove_hook_from_module(model.model.layers[1])


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"device": "cuda"}, ValueError, r"device='cuda' but CUDA is not available.*device='cpu'"),
        ({"device": 0}, ValueError, r"device=0 but CUDA is not available.*device='cpu'"),
        ({"device": "mps:0"}, ValueError, r"executes on 'cuda' or 'cpu' devices only"),
        ({"device": "cpu", "group_sise": 2}, TypeError, r"unexpected keyword argument\(s\) \['group_sise'\]"),
        ({"device": "cpu", "group_size": 2}, TypeError, r"hf_prefetch.PrefetchConfig\(group_size=2\)"),
        ({"device": "cpu", "config": PrefetchConfig()}, TypeError, r"config= is called offload="),
        ({"device": "cpu", "device_map": "auto"}, TypeError, r"device_map= is called device="),
        ({"device": "cpu", "offload": "disk"}, ValueError, r"offload='disk' is not supported"),
        ({"device": "cpu", "offload": PrefetchConfig(offload_params={"w2"})}, ValueError, r"matched no parameter"),
        ({"device": "cpu", "layers": "model.nope"}, ValueError, r"layers='model.nope' is not a ModuleList"),
        ({"device": "cpu", "max_memory": {"cpu": "1GiB"}}, ValueError, r"only a 'cpu' entry"),
    ],
)
def test_bad_input_leaves_nothing_behind(reference, kwargs, error, match):
    if kwargs.get("device") in ("cuda", 0) and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    model, ids, logits, *_ = reference
    with pytest.raises(error, match=match):
        hf_prefetch.dispatch_model(model, **kwargs)
    assert hf_prefetch.get_state(model) is None
    assert not any(hasattr(m, "_hf_hook") for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits)


def test_meta_model_is_refused():
    with torch.device("meta"):
        model = tiny_llama(2)
    with pytest.raises(ValueError, match=r"is on the meta device.*load_checkpoint_and_dispatch"):
        hf_prefetch.dispatch_model(model, device="cpu")


def test_failure_during_execution_rolls_back(reference, monkeypatch):
    model, ids, logits, *_ = reference

    def broken_hook(*args, **kwargs):
        raise RuntimeError("hook failed")

    monkeypatch.setattr("hf_prefetch.lifecycle.journal.add_hook_to_module", broken_hook)
    with pytest.raises(RuntimeError, match="hook failed"):
        hf_prefetch.dispatch_model(model, device="cpu")
    monkeypatch.undo()
    assert hf_prefetch.get_state(model) is None
    assert not any(hasattr(m, "_hf_hook") for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits)


@pytest.mark.parametrize("convert", [lambda m: m.half(), lambda m: m.to("meta"), lambda m: m.model.layers.double()])
def test_moving_a_dispatched_model_is_refused_before_anything_changes(reference, convert):
    model, ids, logits, *_ = reference
    hf_prefetch.dispatch_model(
        model, hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=2), device="cpu"
    )
    try:
        with pytest.raises(RuntimeError, match=r"remove_offload\(model\) first"):
            convert(model)
        assert model.dtype == torch.float32
        with torch.no_grad():
            assert torch.equal(model(ids).logits, logits)
    finally:
        hf_prefetch.remove_offload(model)


def test_import_does_not_initialise_cuda_or_dynamo():
    code = (
        "import sys, torch, hf_prefetch\n"
        "assert not torch.cuda.is_initialized(), 'CUDA initialised'\n"
        "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_replace_with_a_bad_config_keeps_the_current_dispatch(reference):
    model, ids, logits, *_ = reference
    hf_prefetch.dispatch_model(
        model, hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=1), device="cpu"
    )
    try:
        with pytest.raises(ValueError, match="matched no parameter"):
            hf_prefetch.dispatch_model(
                model, hf_prefetch.PrefetchConfig(offload_params={"nonexistent"}), device="cpu", replace=True
            )
        assert hf_prefetch.get_state(model).plan.config.prefetch_step == 1
        with torch.no_grad():
            assert torch.equal(model(ids).logits, logits)
    finally:
        hf_prefetch.remove_offload(model)


def test_remove_offload_to_an_unavailable_device_changes_nothing(reference):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    model, ids, logits, *_ = reference
    hf_prefetch.dispatch_model(
        model, hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=2), device="cpu"
    )
    try:
        with pytest.raises(ValueError, match="CUDA is not available"):
            hf_prefetch.remove_offload(model, device="cuda")
        assert hf_prefetch.get_state(model) is not None
        with torch.no_grad():
            assert torch.equal(model(ids).logits, logits)
    finally:
        hf_prefetch.remove_offload(model)


def test_interrupt_while_a_copy_is_issued_is_a_miss_not_stale_weights(reference, monkeypatch):
    model, ids, logits, *_ = reference
    hf_prefetch.dispatch_model(
        model, hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=2), device="cpu"
    )
    engine = hf_prefetch.get_state(model).engine
    try:
        calls = {"n": 0}
        real_copy = engine._copy_on_host

        def interrupted_copy(layer, whole):
            calls["n"] += 1
            if calls["n"] == 2:  # the second copy of the forward: half the tensors land, then Ctrl-C
                layer.device[0].copy_(layer.host[0])
                raise KeyboardInterrupt
            real_copy(layer, whole)

        monkeypatch.setattr(engine, "_copy_on_host", interrupted_copy)
        with pytest.raises(KeyboardInterrupt), torch.no_grad():
            model(ids)
        monkeypatch.undo()
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(model(ids).logits, logits)
        assert hf_prefetch.stats(model).misses >= 1
    finally:
        hf_prefetch.remove_offload(model)


def _dispatch_objects(model) -> dict[str, weakref.ref]:
    # Weak references to everything a dispatch builds: the state, the engine, each ring's pool, the arena, the hooks.
    state = hf_prefetch.get_state(model)
    objects = {"state": state, "engine": state.engine, "arena": state.arena}
    objects |= {f"pool {i}": ring.pool for i, ring in enumerate(state.engine.rings)}
    hooks = [m._hf_hook for m in model.modules() if hasattr(m, "_hf_hook")]
    objects |= {f"hook {i}": hook for i, hook in enumerate(hooks)}
    return {name: weakref.ref(obj) for name, obj in objects.items()}


@pytest.mark.parametrize("load", ["dispatch_model", "from_pretrained"])
def test_remove_offload_and_replace_leave_no_engine_pool_or_arena_alive(tmp_path, load):
    model = tiny_llama(6)
    ids = prompt(1)
    if load == "from_pretrained":
        model.save_pretrained(tmp_path)
        model = hf_prefetch.from_pretrained(
            tmp_path, hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1), device="cpu", timing=True
        )
    else:
        hf_prefetch.dispatch_model(
            model, hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1), device="cpu", timing=True
        )
    # Freed by reference counting, not by a later garbage collection: on a GPU the pool's memory is reused by the
    # moves of remove_offload itself.
    gc.disable()
    try:
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
        first = _dispatch_objects(model)
        hf_prefetch.stats(model)
        held = hf_prefetch.get_state(model)  # a caller's reference to the state keeps nothing else alive
        hf_prefetch.dispatch_model(
            model,
            hf_prefetch.PrefetchConfig(group_size=3, num_in_group=2, prefetch_step=2),
            device="cpu",
            replace=True,
        )
        # The state keeps its released arena (an empty buffer), nothing that holds memory.
        assert [name for name, ref in first.items() if ref() is not None] == ["state", "arena"]
        assert held.arena.pinned is False and held.arena.bytes_view(0, 0).untyped_storage().nbytes() == 0
        del held
        assert first["state"]() is None
        with torch.no_grad():
            model(ids)
        second = _dispatch_objects(model)
        held = hf_prefetch.get_state(model)
        hf_prefetch.remove_offload(model, device="cpu")
        assert [name for name, ref in second.items() if ref() is not None] == ["state", "arena"]
        assert held.engine is None and held.offloaded == [] and held.write_throughs == []
        del held
        assert second["state"]() is None
    finally:
        gc.enable()
    assert hf_prefetch.get_state(model) is None and not hasattr(model.model.layers[1], "_hf_hook")
