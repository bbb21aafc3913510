"""GPU tests: the same bitwise equality with real asynchronous copies, and the memory accounting."""

import copy
import gc

import pytest
import torch
from transformers import LlamaForCausalLM

import hf_prefetch
from hf_prefetch.host.arena import _clear_last_cuda_error
from hf_prefetch.planning.links import STAGES
from tests.models import gpu_llama

pytestmark = pytest.mark.gpu


def _model(num_layers: int = 8) -> LlamaForCausalLM:
    return gpu_llama(num_layers)


def _register(pointer: int, nbytes: int) -> int:
    """cudaHostRegister's error code for a range (712: cudaErrorHostMemoryAlreadyRegistered, i.e. already
    page-locked); the error is cleared so that it does not surface in a later CUDA call."""
    err = int(torch.cuda.cudart().cudaHostRegister(pointer, nbytes, 0))
    _clear_last_cuda_error()
    return err


def _check_generate(model, ids, long_ids, expected, prefill) -> None:
    """200 greedy tokens and every step's logits, then two prefills, bitwise equal to the resident model's."""
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=200,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        assert torch.equal(out.sequences, expected.sequences)
        for step, (got, want) in enumerate(zip(out.logits, expected.logits, strict=True)):
            assert torch.equal(got, want), f"logits differ at decode step {step}"
        for _ in range(2):
            assert torch.equal(model(long_ids).logits, prefill)


@pytest.fixture(scope="module")
def gpu_reference():
    model = _model()
    resident = copy.deepcopy(model).cuda()
    ids = torch.randint(3, 1024, (1, 16), generator=torch.Generator().manual_seed(1)).cuda()
    long_ids = torch.randint(3, 1024, (2, 1024), generator=torch.Generator().manual_seed(2)).cuda()
    with torch.no_grad():
        out = resident.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=200,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        prefill = resident(long_ids).logits
    del resident
    torch.cuda.empty_cache()
    return model, ids, long_ids, out, prefill


@pytest.mark.parametrize("prefetch_step", [1, 2, 3])
def test_200_decode_steps_bitwise_equal_on_cuda(gpu_reference, prefetch_step):
    model, ids, long_ids, expected, prefill = gpu_reference
    hf_prefetch.dispatch_model(
        model, hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=prefetch_step), device="cuda"
    )
    try:
        _check_generate(model, ids, long_ids, expected, prefill)
        assert hf_prefetch.stats(model).misses == 0
    finally:
        hf_prefetch.remove_offload(model, device="cpu")


def test_all_layers_streamed_bitwise_equal_on_cuda(gpu_reference):
    model, ids, long_ids, expected, prefill = gpu_reference
    hf_prefetch.dispatch_model(
        model, hf_prefetch.PrefetchConfig(group_size=1, num_in_group=1, prefetch_step=2), device="cuda"
    )
    try:
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=200,
                do_sample=False,
                return_dict_in_generate=True,
            )
            assert torch.equal(out.sequences, expected.sequences)
            assert torch.equal(model(long_ids).logits, prefill)
    finally:
        hf_prefetch.remove_offload(model, device="cpu")


def test_memory_accounting_on_cuda(gpu_reference):
    model = gpu_reference[0]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    hf_prefetch.dispatch_model(
        model, hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=2), device="cuda"
    )
    try:
        state = hf_prefetch.get_state(model)
        plan = state.plan
        allocated = torch.cuda.memory_allocated() - before
        assert abs(allocated - (plan.resident_bytes + plan.pool_bytes)) <= 0.02 * (
            plan.resident_bytes + plan.pool_bytes
        )
        assert state.arena.pinned
        assert abs(state.arena.nbytes - plan.offloaded_bytes) <= 0.01 * plan.offloaded_bytes
        # The arena is page-locked with cudaHostRegister (PyTorch's is_pinned() only knows its own allocator):
        # registering the range again must fail with cudaErrorHostMemoryAlreadyRegistered (712).
        assert _register(state.arena.bytes_view(0, 1).data_ptr(), state.arena.nbytes) == 712
    finally:
        hf_prefetch.remove_offload(model, device="cpu")
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


def _interrupt_then_check(model, long_ids, prefill) -> None:
    """A KeyboardInterrupt inside layer 3's MLP, then three prefills bitwise equal to the resident model's (misses
    load what the interrupted forward left out); the dispatch is removed at the end."""
    mlp = model.model.layers[3].mlp
    try:
        mlp.forward = lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt), torch.no_grad():
            model(long_ids)
        del mlp.forward
        with torch.no_grad():
            for _ in range(3):
                assert torch.equal(model(long_ids).logits, prefill)
        assert hf_prefetch.stats(model).misses > 0
    finally:
        mlp.__dict__.pop("forward", None)
        hf_prefetch.remove_offload(model, device="cpu")


def test_interrupted_forward_on_cuda(gpu_reference):
    model, ids, long_ids, _, prefill = gpu_reference
    hf_prefetch.dispatch_model(
        model, hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=2), device="cuda"
    )
    _interrupt_then_check(model, long_ids, prefill)


def test_arena_of_a_dropped_model_is_unregistered():
    from hf_prefetch.host.arena import HostArena

    for _ in range(3):  # small arenas: freed memory is reused by the next one at once
        arena = HostArena([70_000, 4_000])
        assert arena.pin()
        del arena
    arena = HostArena([70_000])
    assert arena.pin()
    arena.release()
    assert not arena.pinned


def test_peak_memory_stays_inside_a_max_memory_budget_on_cuda(gpu_reference):
    model, ids, _, expected, _ = gpu_reference
    budget, reserve = 512 * 2**20, 64 * 2**20  # 8 layers of 86 MiB: 5 of them have to stream
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    hf_prefetch.dispatch_model(model, device="cuda", max_memory={0: budget}, reserve_bytes=reserve)
    try:
        plan = hf_prefetch.get_state(model).plan
        assert len(plan.rings[0].streamed) == 5 and plan.longest_run <= 2
        assert torch.cuda.memory_allocated() - before <= budget - reserve
        torch.cuda.reset_peak_memory_stats()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=200, do_sample=False)
        assert torch.cuda.max_memory_allocated() - before <= budget
        assert torch.equal(out, expected.sequences) and hf_prefetch.stats(model).misses == 0
        auto = hf_prefetch.plan(model, max_memory="auto", device="cuda", reserve_bytes=reserve)
        assert auto.budget.source == "free memory of cuda:0" and auto.link_gbps > 1
        assert not auto.rings[0].streamed  # the whole GPU is free for this small model
    finally:
        hf_prefetch.remove_offload(model, device="cpu")


def _layers_gb(model, num_layers: int) -> float:
    layer_bytes = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    return num_layers * layer_bytes / 2**30


@pytest.mark.parametrize("cpu_offload_params", [set(), {"mlp"}])
def test_uva_200_decode_steps_bitwise_equal_on_cuda(gpu_reference, cpu_offload_params):
    model, ids, long_ids, expected, prefill = gpu_reference
    gb = _layers_gb(model, 4)  # half the layers' bytes, as the half-streamed prefetch rows keep on the host
    hf_prefetch.dispatch_model(
        model, hf_prefetch.UVAConfig(cpu_offload_gb=gb, cpu_offload_params=cpu_offload_params), device="cuda"
    )
    try:
        plan = hf_prefetch.get_state(model).plan
        assert abs(plan.offloaded_bytes - gb * 2**30) < 0.05 * gb * 2**30
        _check_generate(model, ids, long_ids, expected, prefill)
    finally:
        hf_prefetch.remove_offload(model, device="cpu")


def test_uva_parameters_alias_pinned_host_memory_on_cuda(gpu_reference):
    from hf_prefetch.host.arena import _device_pointer

    model = gpu_reference[0]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    hf_prefetch.dispatch_model(model, hf_prefetch.UVAConfig(cpu_offload_gb=_layers_gb(model, 4)), device="cuda")
    try:
        state = hf_prefetch.get_state(model)
        plan, arena = state.plan, state.arena
        # The offloaded bytes take no device memory: only the resident weights were allocated.
        assert plan.offloaded_bytes > 0.4 * (plan.offloaded_bytes + plan.resident_bytes)
        allocated = torch.cuda.memory_allocated() - before
        assert abs(allocated - plan.resident_bytes) <= 0.02 * plan.resident_bytes
        # Each parameter is a CUDA tensor at the device address of its pinned host bytes.
        host_base = arena.bytes_view(0, 1).data_ptr()
        device_base = _device_pointer(host_base, state.device)
        assert len(state.offloaded) == sum(len(layer.offloaded) for layer in plan.rings[0].layers)
        for index, offloaded in enumerate(state.offloaded):
            assert offloaded.param.device == state.device
            assert offloaded.host.data_ptr() == host_base + arena.offsets[index]
            assert offloaded.param.data_ptr() == device_base + arena.offsets[index]
        # No copy anywhere: a value written to host memory is what a kernel reads.
        param, host = state.offloaded[0].param, state.offloaded[0].host
        original = host.view(-1)[0].item()
        host.view(-1)[0] = 7.0
        assert param.view(-1)[0].item() == 7.0
        host.view(-1)[0] = original
        # The arena is page-locked with cudaHostRegister: registering it again fails with error 712.
        assert _register(host_base, arena.nbytes) == 712
        with pytest.raises(RuntimeError, match=r"remove_offload\(model\) first"):
            model.half()
    finally:
        hf_prefetch.remove_offload(model, device="cpu")
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


def test_uva_remove_offload_restores_device_tensors_on_cuda(gpu_reference):
    import gc

    from hf_prefetch.host.arena import pinned_bytes

    model, _, long_ids, _, prefill = gpu_reference
    pinned_before = pinned_bytes()
    hf_prefetch.dispatch_model(model, hf_prefetch.UVAConfig(cpu_offload_gb=_layers_gb(model, 4)), device="cuda")
    state = hf_prefetch.get_state(model)
    host_range = range(
        state.arena.bytes_view(0, 1).data_ptr(), state.arena.bytes_view(0, 1).data_ptr() + state.arena.nbytes
    )
    finalizer = state.arena._unpin
    alias = state.offloaded[0].param.data  # a device view that outlives the dispatch: [Note: UVA lifetime]
    name = state.offloaded[0].full_name
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    try:
        hf_prefetch.remove_offload(model)  # to the execution device
        assert hf_prefetch.get_state(model) is None
        # Ordinary device tensors now: allocated by the caching allocator, outside the arena.
        assert torch.cuda.memory_allocated() - before >= 0.98 * state.plan.offloaded_bytes
        for param in model.parameters():
            assert param.device.type == "cuda" and param.data_ptr() not in host_range
        with torch.no_grad():
            assert torch.equal(model(long_ids).logits, prefill)
        # The view still reads the right values: the arena stays registered while it lives ...
        assert torch.equal(alias, model.get_parameter(name))
        assert finalizer.alive and pinned_bytes() - pinned_before == state.arena.nbytes
        # ... and is unregistered when the last reference goes.
        del alias, state
        gc.collect()
        assert not finalizer.alive and pinned_bytes() == pinned_before
    finally:
        if hf_prefetch.get_state(model) is not None:
            hf_prefetch.remove_offload(model, device="cpu")
        model.to("cpu")


def test_replace_switches_between_backends_on_cuda(gpu_reference):
    model, _, long_ids, _, prefill = gpu_reference
    hf_prefetch.dispatch_model(
        model, hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=2), device="cuda"
    )
    try:
        hf_prefetch.dispatch_model(
            model, hf_prefetch.UVAConfig(cpu_offload_gb=_layers_gb(model, 4)), device="cuda", replace=True
        )
        with torch.no_grad():
            assert torch.equal(model(long_ids).logits, prefill)
        hf_prefetch.dispatch_model(
            model,
            hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=2),
            device="cuda",
            replace=True,
        )
        with torch.no_grad():
            assert torch.equal(model(long_ids).logits, prefill)
        assert hf_prefetch.stats(model).misses == 0
    finally:
        hf_prefetch.remove_offload(model, device="cpu")


def test_remove_offload_and_redispatch_return_device_and_pinned_memory_on_cuda(gpu_reference):
    import gc

    from hf_prefetch.host.arena import pinned_bytes

    model, ids, _, expected, _ = gpu_reference

    def settle():
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    def torch_pinned_bytes():  # blocks PyTorch's own pinned allocator has handed out (the loader's staging ring)
        return torch.cuda.host_memory_stats().get("active_bytes.current", 0)

    def generate():
        with torch.no_grad():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=50, do_sample=False)

    settle()
    device_before = torch.cuda.memory_allocated()
    pinned_before, torch_pinned_before = pinned_bytes(), torch_pinned_bytes()
    hf_prefetch.dispatch_model(
        model, hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=2), device="cuda", timing=True
    )
    try:
        first = hf_prefetch.get_state(model)
        assert first.arena.pinned and pinned_bytes() - pinned_before == first.arena.nbytes
        assert torch.equal(generate(), expected.sequences[:, : ids.shape[1] + 50])
        del first

        hf_prefetch.dispatch_model(
            model,
            hf_prefetch.PrefetchConfig(group_size=4, num_in_group=3, prefetch_step=3),
            device="cuda",
            replace=True,
        )
        settle()
        state = hf_prefetch.get_state(model)
        # Only the new arena is registered and only the new pool and resident weights are on the device: the first
        # dispatch's arena was unregistered and its pool freed, not kept next to the new ones.
        assert state.arena.pinned and pinned_bytes() - pinned_before == state.arena.nbytes
        device_bytes = state.plan.resident_bytes + state.plan.pool_bytes
        assert abs(torch.cuda.memory_allocated() - device_before - device_bytes) <= 0.02 * device_bytes
        assert torch.equal(generate(), expected.sequences[:, : ids.shape[1] + 50])
        assert hf_prefetch.stats(model).misses == 0
        # Measured with the driver, not with our counter: the range is page-locked (registering it again fails
        # with cudaErrorHostMemoryAlreadyRegistered, 712) ...
        host_base, host_nbytes = state.arena.bytes_view(0, 1).data_ptr(), state.arena.nbytes
        streamed = state.offloaded[0].full_name
        assert _register(host_base, host_nbytes) == 712
        del state
    finally:
        hf_prefetch.remove_offload(model, device="cpu")
    settle()
    assert torch.cuda.memory_allocated() == device_before
    assert pinned_bytes() == pinned_before
    # Not a byte of the weights went through PyTorch's pinned allocator. (Its count may keep a few hundred bytes more:
    # small staging blocks of generate's non-blocking copies, freed lazily, when the allocator next processes events.)
    assert torch_pinned_bytes() - torch_pinned_before < 64 * 2**10
    assert all(t.device.type == "cpu" for t in [*model.parameters(), *model.buffers()])
    # ... and no longer after remove_offload: the streamed weights now live in that memory as ordinary pageable
    # CPU tensors, which registering afresh succeeds on.
    assert model.get_parameter(streamed).data_ptr() == host_base
    assert _register(host_base, host_nbytes) == 0
    assert int(torch.cuda.cudart().cudaHostUnregister(host_base)) == 0


def test_timing_after_load_state_dict_on_cuda(gpu_reference):
    # load_state_dict reloads the layers that hold their slots; their stall is then measured against the event of
    # that load, which must be a timing event too.
    model, ids, long_ids, _, prefill = gpu_reference
    hf_prefetch.dispatch_model(
        model, hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=4), device="cuda", timing=True
    )
    try:
        model.load_state_dict(model.state_dict())
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(model(long_ids).logits, prefill)
        s = hf_prefetch.stats(model)
        assert s.misses == 0 and s.stall_seconds >= 0 and s.compute_seconds > 0
    finally:
        hf_prefetch.remove_offload(model, device="cpu")


def test_a_replacement_the_container_cannot_hold_keeps_the_current_dispatch(gpu_reference, tmp_path, monkeypatch):
    from hf_prefetch.host import limits as host_memory

    model, _, long_ids, _, prefill = gpu_reference
    hf_prefetch.dispatch_model(
        model, hf_prefetch.PrefetchConfig(group_size=4, num_in_group=1, prefetch_step=1), device="cuda"
    )
    try:
        # From now on the container is at its memory limit: a larger arena cannot be had.
        cgroup = tmp_path / "sys/fs/cgroup/job"
        cgroup.mkdir(parents=True)
        (tmp_path / "proc/self").mkdir(parents=True)
        (tmp_path / "proc/self/cgroup").write_text("0::/job\n")
        (tmp_path / "proc/self/mountinfo").write_text("31 23 0:28 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n")
        (cgroup / "memory.max").write_text(f"{2**30}\n")
        (cgroup / "memory.current").write_text(f"{2**30}\n")
        (cgroup / "memory.stat").write_text("anon 1\nfile 0\nactive_file 0\ninactive_file 0\n")
        real = host_memory.host_limits
        monkeypatch.setattr(host_memory, "host_limits", lambda root=tmp_path: real(root))
        with pytest.raises(ValueError, match="cgroup memory limit"):
            hf_prefetch.dispatch_model(
                model, hf_prefetch.PrefetchConfig(group_size=1, prefetch_step=1), device="cuda", replace=True
            )
        assert hf_prefetch.get_state(model).plan.config.group_size == 4
        with torch.no_grad():
            assert torch.equal(model(long_ids).logits, prefill)
        assert hf_prefetch.stats(model).misses == 0
    finally:
        hf_prefetch.remove_offload(model, device="cpu")
        model.to("cpu")


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs with peer access")


@two_gpus
@pytest.mark.parametrize("prefetch_step", [1, 2, 3])
def test_shared_links_200_decode_steps_bitwise_equal_on_two_gpus(gpu_reference, prefetch_step):
    model, ids, long_ids, expected, prefill = gpu_reference
    before = torch.cuda.memory_allocated(1)
    config = hf_prefetch.PrefetchConfig(group_size=1, num_in_group=1, prefetch_step=prefetch_step)
    hf_prefetch.dispatch_model(model, config, device="cuda:0", links="all")
    try:
        state = hf_prefetch.get_state(model)
        assert state.plan.links[:2] == (0, 1)
        staging = state.engine._links.staging_bytes
        # The staging buffers, each rounded up by the caching allocator (to 2 MiB at most).
        assert 0 < staging <= torch.cuda.memory_allocated(1) - before <= staging + STAGES * 2**21
        _check_generate(model, ids, long_ids, expected, prefill)
        assert hf_prefetch.stats(model).misses == 0
        # Without a miss every copy went through the links: each helper carried its share of it.
        share = hf_prefetch.stats(model).copied_bytes / len(state.plan.links)
        for carried in [helper.copied_bytes for helper in state.engine._links.helpers]:
            assert abs(carried - share) <= 0.01 * share
    finally:
        hf_prefetch.remove_offload(model, device="cpu")
    assert torch.cuda.memory_allocated(1) == before  # the staging buffers left with the dispatch


@two_gpus
def test_shared_links_after_an_interrupted_forward_and_with_timing_on_two_gpus(gpu_reference):
    model, ids, long_ids, _, prefill = gpu_reference
    config = hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=2)
    hf_prefetch.dispatch_model(model, config, device="cuda:0", links=[0, 1], timing=True)
    with torch.no_grad():
        model(long_ids)
    assert hf_prefetch.stats(model).copy_seconds > 0  # timed copies through both links
    _interrupt_then_check(model, long_ids, prefill)


@two_gpus
def test_pipeline_placement_200_decode_steps_bitwise_equal_on_two_gpus(gpu_reference):
    from hf_prefetch.planning.layers import model_bytes

    model, ids, long_ids, expected, prefill = gpu_reference
    layer = model_bytes(model.model.layers[0])
    other = model_bytes(model) - 8 * layer
    reserve = 2**20
    # Each GPU holds about 2.5 of its 4 layers: both stream.
    budgets = {0: other + int(2.5 * layer) + reserve, 1: int(2.5 * layer) + reserve}
    # GPU 1's first matmul allocates cuBLAS's workspace (kept for the process, in memory_allocated): before counting.
    x = torch.ones(64, 64, device="cuda:1", dtype=torch.bfloat16)
    y = x @ x
    del x, y
    torch.cuda.synchronize(1)
    before = torch.cuda.memory_allocated(1)
    hf_prefetch.dispatch_model(model, max_memory=budgets, reserve_bytes=reserve, device="cuda:0")
    try:
        plan = hf_prefetch.get_state(model).plan
        assert [ring.device for ring in plan.rings] == [0, 1] and all(ring.streamed for ring in plan.rings)
        assert set(model.hf_device_map.values()) == {0, 1}
        for ring in plan.rings:
            for entry in ring.layers:
                assert next(model.get_submodule(entry.path).parameters()).device == torch.device("cuda", ring.device)
        _check_generate(model, ids, long_ids, expected, prefill)
        assert hf_prefetch.stats(model).misses == 0
    finally:
        hf_prefetch.remove_offload(model, device="cpu")
    gc.collect()  # generate's outputs (their caches hold GPU 1 tensors) may sit in reference cycles
    torch.cuda.synchronize(1)
    assert torch.cuda.memory_allocated(1) == before  # pools and layers left GPU 1 with the dispatch


@two_gpus
def test_pipeline_placement_from_a_checkpoint_on_two_gpus(gpu_reference, tmp_path):
    from hf_prefetch.planning.layers import model_bytes

    model, _, long_ids, _, _ = gpu_reference
    model.save_pretrained(tmp_path)
    # The reference is transformers' own load: `model.to(bfloat16)` also rounded its rotary `inv_freq` buffer to
    # bf16, which a load from the checkpoint (transformers' or ours) computes in float32.
    resident = LlamaForCausalLM.from_pretrained(tmp_path).to("cuda:0")
    with torch.no_grad():
        prefill = resident(long_ids).logits
    del resident
    torch.cuda.empty_cache()
    layer = model_bytes(model.model.layers[0])
    other = model_bytes(model) - 8 * layer
    budgets = {0: other + int(2.5 * layer) + 2**20, 1: int(2.5 * layer) + 2**20}
    loaded = hf_prefetch.from_pretrained(tmp_path, max_memory=budgets, reserve_bytes=2**20, device="cuda:0")
    try:
        plan = hf_prefetch.get_state(loaded).plan
        for ring in plan.rings:  # each layer's resident tensors were read onto its GPU
            for entry in ring.layers:
                for param in loaded.get_submodule(entry.path).parameters():
                    assert param.device == torch.device("cuda", ring.device)
        with torch.no_grad():
            assert torch.equal(loaded(long_ids).logits, prefill)
    finally:
        hf_prefetch.remove_offload(loaded)
