"""The CUDA backend (extra ``cuda``: torch and triton). Importing it registers the backend as 'cuda'."""
from .backend import CUDABackend, device_count, torch_device  # noqa: F401
