"""The cold-start helper's process: the same first batch on the same model, its kernel calls in reverse order, so
that it compiles into the shared kernel cache what the main process needs last (ggml/backends/cpu/warm.py)."""
from __future__ import annotations

import json
import sys


def start(llm, n_tokens: int):
    """From ``Llama``: start the helper for a first batch of n_tokens where the cpu kernel cache lacks this
    model's matmul kernels; returns its Popen, or None."""
    from ..ggml.backends.cpu import warm
    if llm.model.n_gpu_layers or not warm.cold(t.type for t in llm.model.reader.tensors.values()):
        return None
    c = llm.ctx
    kw = {"n_ctx": c.n_ctx, "n_batch": c.n_batch, "n_ubatch": c.n_ubatch, "n_seq_max": c.n_seq_max,
          "type_k": c.kv.type_k.name, "type_v": c.kv.type_v.name}
    return warm.spawn([sys.executable, "-m", "llampy.llama.warm", str(llm.model_path), str(int(n_tokens)),
                       json.dumps(kw)])


def main(argv) -> int:
    from ..ggml.backends.cpu import warm
    from ..ggml.types import GGMLType
    from .batch import Batch
    from .context import Context
    from .model import Model
    warm.leave_with_parent()
    path, n, kw = argv[0], int(argv[1]), json.loads(argv[2])
    for k in ("type_k", "type_v"):
        if k in kw:
            kw[k] = GGMLType[kw[k]]
    warm.reverse_plans()
    ctx = Context(Model(path), **kw)
    ctx.decode(Batch.from_tokens(list(range(n))))        # the first prompt's batch
    if n > 1:
        ctx.decode(Batch.from_tokens([0], pos0=n))       # then a decode step's
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
