"""GPU tests: the same bitwise equality with real asynchronous copies, and the memory accounting."""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_prefetch
from hf_prefetch.host import _clear_last_cuda_error

pytestmark = pytest.mark.gpu


def _model(num_layers: int = 8) -> LlamaForCausalLM:
    # ~90 MB of bf16 weights per layer: a layer's copy (~2 ms) takes far longer than its decode step, so a missing
    # wait or fork shows up as wrong tokens.
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=num_layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=1024,
        max_position_embeddings=4096,
    )
    return LlamaForCausalLM(config).to(torch.bfloat16).eval()


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
    hf_prefetch.dispatch_model(model, device="cuda", group_size=2, num_in_group=1, prefetch_step=prefetch_step)
    try:
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
        assert hf_prefetch.stats(model).misses == 0
    finally:
        hf_prefetch.remove_offload(model, device="cpu")


def test_all_layers_streamed_bitwise_equal_on_cuda(gpu_reference):
    model, ids, long_ids, expected, prefill = gpu_reference
    hf_prefetch.dispatch_model(model, device="cuda", group_size=1, num_in_group=1, prefetch_step=2)
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
    hf_prefetch.dispatch_model(model, device="cuda", group_size=2, num_in_group=1, prefetch_step=2)
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
        buffer = state.arena.bytes_view(0, 1)
        err = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), state.arena.nbytes, 0)
        _clear_last_cuda_error()
        assert int(err) == 712
    finally:
        hf_prefetch.remove_offload(model, device="cpu")
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


def test_interrupted_forward_on_cuda(gpu_reference):
    model, ids, long_ids, _, prefill = gpu_reference
    hf_prefetch.dispatch_model(model, device="cuda", group_size=2, num_in_group=1, prefetch_step=2)
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


def test_arena_of_a_dropped_model_is_unregistered():
    from hf_prefetch.host import HostArena

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
