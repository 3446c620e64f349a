"""Applying parallelism to whole models."""

from loom.parallel.parallelize import ParallelState, parallelize

__all__ = ["ParallelState", "parallelize"]
