"""The step engine: a collection's tables linearized into one plan, run by a numba (CPU) or a
Triton (CUDA, or its interpreter on CPU tensors) backend, one forward and one backward a step."""

from .core import KERNELS, Engine, Forward, check_kernels, interpreting
from .plan import Plan, StepBatch, TablePlan

__all__ = ["KERNELS", "Engine", "Forward", "Plan", "StepBatch", "TablePlan", "check_kernels",
           "interpreting"]
