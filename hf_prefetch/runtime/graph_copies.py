"""The CUDA driver call torch does not make for us: a host-to-device copy recorded into a CUDA-graph capture from
page-locked memory that torch's own allocator did not pin. Loaded lazily, so `import hf_prefetch` touches no CUDA
library.
"""

from __future__ import annotations

import ctypes

import torch

__all__ = ["captured_copy", "is_dense"]


def captured_copy(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> None:
    """Copy host tensor `src` into device tensor `dst` on `stream`, inside a CUDA-graph capture."""
    # In a capture torch copies from host memory only if its own allocator pinned it; ours is page-locked with
    # cudaHostRegister (exact size), so the copy goes to the driver: one cuMemcpyHtoDAsync of the tensor's bytes,
    # recorded as a memcpy node of the graph. Host and slot tensors have the same shape and strides.
    if src.stride() != dst.stride() or not is_dense(dst):
        raise RuntimeError(
            f"hf_prefetch: cannot capture the copy of a tensor of shape {tuple(dst.shape)}, strides {dst.stride()} "
            f"from host strides {src.stride()}: a captured copy needs the same dense layout on both sides."
        )
    nbytes = dst.numel() * dst.element_size()
    result = _driver().cuMemcpyHtoDAsync_v2(dst.data_ptr(), src.data_ptr(), nbytes, stream.cuda_stream)
    if result != 0:
        raise RuntimeError(
            f"hf_prefetch: cuMemcpyHtoDAsync of {nbytes} bytes in a CUDA-graph capture failed (CUresult {result})."
        )


def is_dense(tensor: torch.Tensor) -> bool:
    """Whether its elements fill numel() consecutive elements of memory, in some order of the dimensions."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(tensor.shape, tensor.stride(), strict=True) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


_cuda_driver = None


def _driver() -> ctypes.CDLL:
    global _cuda_driver
    if _cuda_driver is None:
        driver = ctypes.CDLL("libcuda.so.1")  # the CUDA driver, loaded by torch already
        driver.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        driver.cuMemcpyHtoDAsync_v2.restype = ctypes.c_int
        _cuda_driver = driver
    return _cuda_driver
