"""The automatic loss chunk: fixed budgets on CPU and other devices, from free memory and vocabulary on CUDA.

The CUDA rule is tested on the CPU with the free-memory queries monkeypatched (``torch.cuda.mem_get_info``
and the caching allocator's reserved / allocated bytes).
"""

import pytest
import torch
import torch.distributed as dist

from lightning_cp.ops._plan import Plan, auto_chunk_size

GIB, MIB = 2**30, 2**20
V_QWEN = 151_936


@pytest.fixture
def cuda_memory(monkeypatch):
    """``cuda_memory(free, reserved=0, allocated=0)`` makes the CUDA queries report these bytes."""
    queried = []

    def set_memory(free: int, reserved: int = 0, allocated: int = 0) -> list:
        def mem_get_info(device=None):
            queried.append(device)
            return free, 80 * GIB

        monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated)
        return queried

    return set_memory


def _block_bytes(chunk: int, vocab: int) -> int:
    return chunk * vocab * 4


def test_cpu_and_other_devices_keep_their_fixed_budgets(cuda_memory):
    queried = cuda_memory(80 * GIB)
    for device, budget in (("cpu", 256 * MIB), ("mps", 512 * MIB)):
        chunk = auto_chunk_size(131_072, V_QWEN, device)
        assert budget - 4 * V_QWEN < _block_bytes(chunk, V_QWEN) <= budget
    assert queried == []


def test_cuda_with_ample_memory_takes_8192_tokens_up_to_a_4_gib_block(cuda_memory):
    queried = cuda_memory(70 * GIB)
    assert auto_chunk_size(131_072, 32_000, "cuda:1") == 8192
    chunk = auto_chunk_size(131_072, V_QWEN, "cuda:1")  # 8192 tokens would be 4.6 GiB
    assert 4 * GIB - 4 * V_QWEN < _block_bytes(chunk, V_QWEN) <= 4 * GIB
    assert queried == [torch.device("cuda:1")] * 2
    assert auto_chunk_size(3000, 32_000, "cuda") == 3000  # never more than the tokens


@pytest.mark.parametrize(
    ("free", "reserved", "allocated", "budget"),
    [
        (16 * GIB, 0, 0, 2 * GIB),  # 1/8 of the free memory
        (8 * GIB, 10 * GIB, 2 * GIB, 2 * GIB),  # plus what torch's cache holds unused
        (2 * GIB, 0, 0, 512 * MIB),  # never below the 512 MiB of other accelerators
    ],
)
def test_cuda_chunk_shrinks_with_the_free_memory(cuda_memory, free, reserved, allocated, budget):
    cuda_memory(free, reserved, allocated)
    chunk = auto_chunk_size(131_072, V_QWEN, "cuda")
    assert budget - 4 * V_QWEN < _block_bytes(chunk, V_QWEN) <= budget
    assert auto_chunk_size(131_072, 10**7, "cuda") == 128  # the floor for huge vocabularies


def test_a_tensor_parallel_vocabulary_gets_a_chunk_from_the_shapes_only(cuda_memory, monkeypatch):
    """TP ranks exchange statistics per chunk: different free memory must not give different chunks."""
    cuda_memory(70 * GIB)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: pytest.fail("free memory queried"))
    group = object()
    monkeypatch.setattr(dist, "get_world_size", lambda g=None: 2 if g is group else 1)
    plan = Plan.build(
        n_tokens=131_072,
        local_vocab=V_QWEN // 2,
        device=torch.device("cuda"),
        impl="torch",
        chunk_size=None,
        logit_scale=1.0,
        softcap=None,
        tp_group=group,
    )
    assert plan.chunk_size == auto_chunk_size(131_072, V_QWEN // 2, "mps")


@pytest.mark.gpu
def test_cuda_chunk_from_the_real_free_memory():
    chunk = auto_chunk_size(131_072, V_QWEN, "cuda")
    assert 512 * MIB - 4 * V_QWEN < _block_bytes(chunk, V_QWEN) <= 4 * GIB
