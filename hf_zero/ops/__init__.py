"""hf_zero's C++ operators (csrc/), built with torch's extension tooling on first use."""
from hf_zero.ops.cpu_adam import (
    CPUAdam,
    adam_step,
    adam_step_with_state,
    cpu_adam_kernel,
)

__all__ = ["CPUAdam", "adam_step", "adam_step_with_state", "cpu_adam_kernel"]
