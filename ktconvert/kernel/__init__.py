"""Optional: the real kt-kernel CPU MoE, called directly (``kt_kernel_ext``), always in a child process.

``KernelSession(method)`` runs one method in one child; :func:`probe_kernel` says what is installed;
:mod:`ktconvert.kernel.methods` holds what each method reads and the launches it cannot run. Importing this
package never imports kt_kernel.
"""

from ktconvert.kernel.methods import (
                                     METHODS,
                                     runs_here,
                                     shape_problems,
                                     type_problems,
)
from ktconvert.kernel.runner import (
                                     KernelCrashed,
                                     KernelInfo,
                                     KernelRefused,
                                     KernelSession,
                                     KernelUnavailable,
                                     bf16_bits_to_f32,
                                     f32_to_bf16_bits,
                                     probe_kernel,
)

__all__ = ["METHODS", "runs_here", "shape_problems", "type_problems", "KernelCrashed", "KernelInfo",
           "KernelRefused", "KernelSession", "KernelUnavailable", "bf16_bits_to_f32", "f32_to_bf16_bits",
           "probe_kernel"]
