"""The cpu backend (NumPy + Numba). Importing it registers it as "cpu"; it patches nothing (the process tuning the
entry points install is ``llampy.tuning``)."""
from ...backend import register_backend
from .backend import CPUBackend

register_backend("cpu", CPUBackend)

__all__ = ["CPUBackend"]
