"""LoRA adapters in llama.cpp's GGUF layout, applied at run time (llama-adapter.cpp).

An adapter file has ``general.type`` "adapter", ``adapter.type`` "lora", the base model's
``general.architecture`` and optionally ``adapter.lora.alpha``; for each adapted weight ``W`` (named as in the
base model) a pair ``W.lora_a`` [n_in, rank] and ``W.lora_b`` [rank, n_out] (ggml order). A context applies a list
of (adapter, scale): every product ``W @ x`` the graph helpers build becomes

    W @ x + s * (B @ (A @ x)),    s = scale * alpha / rank  (or scale when alpha is 0)

as extra nodes added by ``llama/graph.py`` (llama.cpp's build_lora_mm); architecture files never see them. The
token embedding's pair is flipped (A [rank, n_vocab] indexed by token, B [rank, n_embd]), as llama.cpp's
build_inp_embd reads it.

An activated LoRA (aLoRA) also has ``adapter.alora.invocation_tokens`` (an array of u32 token ids): the server
applies it only from its invocation sequence on (server/slots.py); the adapter itself is an ordinary LoRA here.
"""
from __future__ import annotations

from ..ggml.backend import BufferUsage, tensor_alloc
from ..ggml.tensor import Flags, Tensor
from ..ggml.types import GGMLType
from ..gguf import GGUFReader
from .model import ModelLoadError


class LoraError(ModelLoadError):
    pass


class LoraWeight:
    __slots__ = ("a", "b")

    def __init__(self, a: Tensor, b: Tensor):
        self.a, self.b = a, b

    @property
    def rank(self) -> int:
        return self.b.ne[0]

    def scale(self, alpha: float, adapter_scale: float) -> float:
        """llama_adapter_lora_weight::get_scale."""
        return adapter_scale * alpha / self.rank if alpha else adapter_scale


class LoraAdapter:
    """A LoRA adapter loaded for ``model``: its A/B pairs placed beside the base weights they adapt."""

    def __init__(self, model, path):
        self.path = str(path)
        self.reader = GGUFReader(path)
        md = self.reader.metadata
        try:
            if md.get("general.type") != "adapter":
                raise LoraError(f"{self.path}: general.type is {md.get('general.type')!r}, a LoRA adapter has "
                                f"'adapter'")
            if md.get("adapter.type") != "lora":
                raise LoraError(f"{self.path}: adapter.type is {md.get('adapter.type')!r}, not 'lora'")
            if md.get("general.architecture") != model.hparams.arch:
                raise LoraError(f"{self.path}: adapter for {md.get('general.architecture')!r}, the model is "
                                f"{model.hparams.arch!r}")
            self.alpha = float(md.get("adapter.lora.alpha", 0.0))
            self.alora_invocation_tokens: list[int] = self._invocation_tokens()
            self.weights: dict[str, LoraWeight] = self._load(model)
        except BaseException:
            self.reader.close()
            raise

    def _invocation_tokens(self) -> list[int]:
        """adapter.alora.invocation_tokens, as llama_adapter_lora_init reads it (an array of u32, else refused)."""
        key = "adapter.alora.invocation_tokens"
        if key not in self.reader.metadata:
            return []
        from ..gguf.constants import GGUFValueType as VT
        sig = self.reader.value_types[key]
        if sig[0] != VT.ARRAY:
            raise LoraError(f"{self.path}: invalid gguf type for {key}")
        if sig[1] != VT.UINT32:
            raise LoraError(f"{self.path}: invalid gguf element type for {key}")
        # llama_token is an int32: ids are taken as ggml copies them
        return [int(t) for t in self.reader.metadata[key].view("<i4")]

    def _load(self, model) -> dict[str, LoraWeight]:
        pairs: dict[str, dict[str, object]] = {}
        for name, info in self.reader.tensors.items():
            for part in ("a", "b"):
                if name.endswith(f".lora_{part}"):
                    pairs.setdefault(name[:-len(".lora_a")], {})[part] = info
                    break
            else:
                raise LoraError(f"{self.path}: tensor {name!r} is neither a lora_a nor a lora_b")
        out = {}
        for base, ab in pairs.items():
            if "a" not in ab or "b" not in ab:
                raise LoraError(f"{self.path}: LoRA tensor pair for {base!r} is missing one component")
            w = model.tensors.get(base)
            if w is None:
                raise LoraError(f"{self.path}: LoRA tensor {base!r} does not exist in the base model "
                                f"(wrong base model?)")
            a, b = ab["a"], ab["b"]
            if base.endswith("token_embd.weight"):
                ok = w.ne[0] == b.ne[1] and w.ne[1] == a.ne[1] and a.ne[0] == b.ne[0]
            else:
                ok = w.ne[0] == a.ne[0] and w.ne[1] == b.ne[1]
                if ok and a.ne[1] != b.ne[0]:
                    raise LoraError(f"{self.path}: {base}.lora_a is not transposed")
            if not ok:
                raise LoraError(f"{self.path}: tensor {base!r} has an incorrect shape (wrong base model?)")
            backend = next((be for be in model.backends if w.storage.buffer is not None
                            and be.supports_buffer(w.storage.buffer)), model.cpu)
            out[base] = LoraWeight(self._place(a, backend), self._place(b, backend))
        return out

    @staticmethod
    def _place(info, backend) -> Tensor:
        t = Tensor(GGMLType(info.type), info.ne, name=info.name)
        t.flags |= Flags.WEIGHT
        tensor_alloc(backend.get_default_buffer_type().buffer_from_host(info.data, BufferUsage.WEIGHTS), t, 0)
        return t

    def get(self, w: Tensor) -> LoraWeight | None:
        return self.weights.get(w.name)

    def close(self) -> None:
        self.weights = {}
        self.reader.close()

    def __repr__(self) -> str:
        inv = f", aLoRA invocation {self.alora_invocation_tokens}" if self.alora_invocation_tokens else ""
        return f"LoraAdapter({self.path!r}, {len(self.weights)} weights, alpha {self.alpha:g}{inv})"


def parse_lora_args(lora: list | None = None, lora_scaled: list | None = None) -> list[tuple[str, float]]:
    """(path, scale) pairs from llama.cpp's --lora F (scale 1) and --lora-scaled F S."""
    out = [(p, 1.0) for p in (lora or [])]
    out += [(p, float(s)) for p, s in (lora_scaled or [])]
    return out
