"""Memory for the states a load fills in: one anonymous mapping that the kernel may back with huge pages.

A load allocates the optimizer states it reads (two thirds of an AdamW checkpoint) and writes every byte of
them once. On fresh memory each 4 KiB page first costs a page fault, in which the kernel zeroes the page:
for a gigabyte, a quarter of a million faults, which cost more than copying the bytes from the page cache
(several times more on a virtual machine). `Arena` hands out tensors from one anonymous mapping advised for
transparent huge pages (`madvise(MADV_HUGEPAGE)`: taken where the kernel's setting is `madvise` or
`always`), so that a fault brings in 2 MiB at once. Where the advice is not available (another OS, huge
pages off), the mapping is plain memory, as `torch.empty`'s.

Each tensor has a storage of its own size (DCP's writer copies a tensor that views a larger storage, and
`torch.save` would write all of it), 64-byte aligned like torch's allocator's; the mapping is unmapped once
the last of them is gone.
"""

from __future__ import annotations

import mmap

import torch

_ALIGN = 64  # torch's CPU allocator's alignment (vectorised kernels expect it)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class Arena:
    """Uninitialised CPU tensors carved from one mapping of `nbytes` (the sum of `Arena.size` of each)."""

    def __init__(self, nbytes: int) -> None:
        self.mapping = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux: a hint the kernel may ignore
            try:
                self.mapping.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass
        self.used = 0

    @staticmethod
    def size(numel: int, dtype: torch.dtype) -> int:
        """The bytes a tensor of `numel` elements of `dtype` takes in an arena."""
        return _aligned(numel * dtype.itemsize)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-d tensor of `numel` uninitialised elements of `dtype` (its memory zero until written)."""
        nbytes = numel * dtype.itemsize
        if nbytes == 0:
            return torch.empty(numel, dtype=dtype)
        start, end = self.used, self.used + self.size(numel, dtype)
        if end > len(self.mapping):
            raise ValueError(f"arena of {len(self.mapping)} bytes has no room for {nbytes} more at {start}")
        self.used = end
        # the memoryview keeps the mapping alive as long as the tensor lives
        return torch.frombuffer(memoryview(self.mapping)[start : start + nbytes], dtype=dtype)
