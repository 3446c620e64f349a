"""Applying parallelism to whole models."""

from loom.parallel.parallelize import ParallelState, parallelize
from loom.parallel.zero import ZeroOptimizer, make_optimizer

__all__ = ["ParallelState", "ZeroOptimizer", "make_optimizer", "parallelize"]
