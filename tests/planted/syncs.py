"""Planted host syncs for the detector's GPU tests. Each line that syncs carries a marker
comment; the tests find the expected line by its marker, so editing this file cannot silently
break the attribution they check."""

from __future__ import annotations

import ctypes

import torch

from backends.base import Capabilities, CGSupport
from backends.features import LOGITS_SOFT_CAP, SLIDING_WINDOW
from backends.torch_naive import TorchNaiveBackend


def item(x):
    return x.sum().item()  # planted: item


def cpu(x):
    return x.cpu()  # planted: cpu


def tolist(x):
    return x.tolist()  # planted: tolist


def cuda_synchronize(x):
    torch.cuda.synchronize()  # planted: cuda_synchronize


def event_synchronize(x):
    event = torch.cuda.Event()
    event.record()
    event.synchronize()  # planted: event_synchronize


def _cudart():
    for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    # PyTorch wheels ship the runtime beside torch/lib; loading torch made it resident.
    import glob
    import os

    for path in glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "*", "lib", "libcudart.so*")):
        return ctypes.CDLL(path)
    raise OSError("libcudart not found")


def raw_cuda_memcpy_d2h(x):
    num_bytes = x.numel() * x.element_size()
    host = ctypes.create_string_buffer(num_bytes)
    # One line each: Python 3.12 names a multi-line call by its first line, 3.11 by its last.
    pointer, size = ctypes.c_void_p(x.data_ptr()), ctypes.c_size_t(num_bytes)
    _cudart().cudaMemcpy(host, pointer, size, 2)  # planted: raw_cuda_memcpy_d2h


def raw_stream_synchronize(x):
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    _cudart().cudaStreamSynchronize(stream)  # planted: raw_stream_synchronize


PLANTED = [item, cpu, tolist, cuda_synchronize, event_synchronize, raw_cuda_memcpy_d2h, raw_stream_synchronize]


# Controls: none of these blocks the host.
def nonblocking_copy_into_pinned(x):
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x, non_blocking=True)


def pinned_h2d_nonblocking(x):
    host = torch.ones(x.shape, dtype=x.dtype, pin_memory=True)
    x.copy_(host, non_blocking=True)


def triton_kernel_launch(x):
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(pointer, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        tl.store(pointer + offsets, tl.load(pointer + offsets, mask=mask) + 1, mask=mask)

    add_one[(triton.cdiv(x.numel(), 256),)](x, x.numel(), BLOCK=256)


def torch_kernel(x):
    x.mul_(2).add_(1)


CONTROLS = [nonblocking_copy_into_pinned, pinned_h2d_nonblocking, triton_kernel_launch, torch_kernel]


class SeqLensCpuInBuild(TorchNaiveBackend):
    """Claims it needs no host lengths, then copies them from the device in build()."""

    name = "planted_seq_lens_cpu_in_build"
    capabilities = Capabilities(
        kinds=frozenset({"mha", "mla"}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
        features=frozenset({SLIDING_WINDOW, LOGITS_SOFT_CAP}),
        cuda_graphs=CGSupport.NEVER,
        needs_cpu_seq_lens=False,
        devices=frozenset({"cuda"}),
    )

    def build(self, common):
        metadata = super().build(common)
        metadata.seq_lens = common.seq_lens.cpu().tolist()  # planted: seq_lens_cpu_in_build
        return metadata
