"""Optional: the real kt-kernel (``kt_kernel_ext``), driven directly, always in a child process.

Importing ``kt_kernel`` sets flush-to-zero for the whole process (subnormal floats become 0), which would silently
change every exact computation ktconvert does, so nothing here imports it: :mod:`ktconvert.kernel.kt_child`
is a separate script run with ``python -m`` (one method per process, as kt-kernel needs), and
:mod:`ktconvert.kernel.run` starts it and reads its results.
"""
