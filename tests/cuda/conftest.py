"""The CUDA backend's tests: run by `make test-cuda` (on a GPU, or under TRITON_INTERPRET=1 on the CPU with torch's
CPU build). Without torch and triton, or without a GPU or the interpreter, they are not collected: `make test`
stays GPU-free; `make test-cuda` installs the extra and sets the interpreter where there is no GPU."""
import os

collect_ignore_glob = []
try:
    import torch
    import triton  # noqa: F401
    _usable = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
except ImportError:
    _usable = False
if not _usable:
    if os.environ.get("LLAMPY_TEST_CUDA") == "1":
        raise RuntimeError("LLAMPY_TEST_CUDA=1 but torch/triton are missing, or there is neither a GPU nor "
                           "TRITON_INTERPRET=1")
    collect_ignore_glob = ["test_*.py"]
