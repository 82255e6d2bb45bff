"""A loaded model: hyper-parameters, vocabulary, and weights placed per layer on backends.

Weights are views into the GGUF file's pages (``use_mmap=True``, the default): resident memory after loading stays
near the size of what is touched. Placement follows llama.cpp: the last ``n_gpu_layers`` repeating layers (and the
output head when ``n_gpu_layers > n_layer``) go to the accelerator devices, split across them by ``tensor_split``
(split mode 'layer'); everything else stays on the CPU. The architecture module only names tensors and shapes.
"""
from __future__ import annotations

import re
import warnings

from pathlib import Path
from types import SimpleNamespace

import numpy as np

from ..ggml.backend import Backend, BufferUsage, backend_init, tensor_alloc, tensor_set_bytes
from ..ggml.split import SplitBufferType
from ..ggml.tensor import Flags, Tensor
from ..ggml.types import GGMLType
from ..gguf.split import open_gguf
from . import arch as arch_mod
from .arch import LAYER
from .devices import AUTO, OffloadError, fit_layers, gpu_backends, parse_n_gpu_layers, parse_override_tensor, warn_no_gpu
from .hparams import HParams, load_hparams


class ModelLoadError(ValueError):
    pass


# tensor types no weight can have (ggml multiplies and scales by float and block-quantized weights only)
# the layers' matrices that split_mode 'row' splits by rows: those of the matrix products (llama.cpp puts a layer's
# MUL_MAT weights in the split buffer type, its other tensors in the main device's)
_ROW_SPLIT = re.compile(r"blk\.\d+\.(attn_(q|k|v|qkv|output)|ffn_(gate|up|down)(_shexp)?)\.weight$")

NOT_WEIGHTS = frozenset({GGMLType.I8, GGMLType.I16, GGMLType.I32, GGMLType.I64, GGMLType.F64})


class TensorLoader:
    """Handed to an architecture's ``load_tensors``: creates weight tensors, checking names and shapes."""

    def __init__(self, model: "Model"):
        self.model = model
        self.hp = model.hparams
        self.used: set[str] = set()

    def create(self, name: str, ne, il: int = -1, required: bool = True, suffix: str = "weight") -> Tensor | None:
        """The tensor ``name.suffix`` (``name`` may be a LAYER key, formatted with ``il``; no suffix: ``name``
        alone, as ssm_a and ssm_d are named), of shape ``ne``."""
        if name in LAYER:
            name = LAYER[name].format(il)
        full = f"{name}.{suffix}" if suffix else name
        info = self.model.reader.tensors.get(full)
        if info is None:
            if required:
                raise ModelLoadError(f"missing tensor {full!r} (architecture {self.hp.arch})")
            return None
        ne = tuple(int(n) for n in ne)
        got = tuple(info.ne) + (1,) * (len(ne) - len(info.ne))
        want = ne + (1,) * (len(got) - len(ne))
        if got != want:
            raise ModelLoadError(f"tensor {full!r} has shape {list(info.ne)}, expected {list(ne)}")
        if info.type in NOT_WEIGHTS:
            raise ModelLoadError(f"tensor {full!r} has type {info.type.name}: weights are float or block-quantized")
        self.used.add(full)
        t = self.model._weight(full, il)
        cb = self.model.progress_callback
        if cb is not None and cb(len(self.used) / max(len(self.model.reader.tensors), 1)) is False:
            raise ModelLoadError("loading was cancelled by the progress callback")
        return t

    def tied(self, name: str, suffix: str = "weight") -> Tensor:
        """The output head tied to an already created tensor: that tensor itself where the head runs on the CPU,
        else a copy of it in the head's device memory (llama.cpp duplicates it there)."""
        full = f"{name}.{suffix}"
        t = self.model.tensors[full]
        head = self.model.layer_backend[-1] if self.model.layer_backend else self.model.cpu
        if head is self.model.cpu or head.supports_buffer(t.storage.buffer):
            return t
        if not getattr(head, "supports_weight", lambda ty: True)(t.type):
            return t
        return self.model._place(full, head, name_as=f"output.{suffix}")


class Model:
    def __init__(self, path, n_gpu_layers: int | str = 0, split_mode: str = "layer", tensor_split=None,
                 use_mmap: bool = True, devices: list[Backend] | None = None, n_threads: int | None = None,
                 vocab_only: bool = False, main_gpu: int = 0, override_tensor=None, n_ctx_hint: int = 4096,
                 strict_offload: bool = False, progress_callback=None):
        """``n_gpu_layers``: layers on the accelerators (int; -1 or 'all': every one; 'auto': as many as fit in
        free device memory with a KV cache of ``n_ctx_hint`` cells). ``devices``: the accelerator backends (None:
        the CUDA GPUs when layers are asked for; ``split_mode`` 'none' takes ``main_gpu`` alone). ``tensor_split``:
        the share of layers per device. ``override_tensor``: 'REGEX=BUFTYPE,...' (llama.cpp's -ot), weights whose
        name matches go to that buffer type (CPU, CUDA0, ...). Without an accelerator a request for layers warns
        in one line and runs on the CPU (``strict_offload``: raises instead). ``progress_callback(fraction)``:
        called as each weight is placed (llama.cpp's progress_callback); returning False cancels the load."""
        self.path = Path(path)
        self.progress_callback = progress_callback
        self.reader = open_gguf(self.path)       # a split model's parts read as one file
        try:
            self._load(n_gpu_layers, split_mode, tensor_split, use_mmap, devices, n_threads, vocab_only, main_gpu,
                       override_tensor, n_ctx_hint, strict_offload)
        except BaseException:      # a file that does not load is not left open
            self.reader.close()
            raise

    def _load(self, n_gpu_layers, split_mode, tensor_split, use_mmap, devices, n_threads, vocab_only, main_gpu,
              override_tensor, n_ctx_hint, strict_offload) -> None:
        md = self.reader.metadata
        self.metadata = md
        from .vocab import Vocab
        if vocab_only:      # any GGUF with a vocabulary, whatever its architecture (llama.cpp's vocab_only)
            self.arch, self.hparams = self._vocab_only_hparams(md)
            self.vocab = Vocab.from_metadata(md)
            self.hparams.n_vocab = self.hparams.n_vocab or self.vocab.n_tokens
            # no backend either: `llampy tokenize` need not import the kernels
            self.use_mmap, self.devices, self.n_gpu_layers, self.split_mode = use_mmap, [], 0, "none"
            self.cpu, self.layer_backend = None, []
            self.tensors: dict[str, Tensor] = {}
            self.layers = [SimpleNamespace() for _ in range(self.hparams.n_layer)]
            return
        self.arch = arch_mod.arch_module(str(md.get("general.architecture", "")))
        self.hparams = load_hparams(md, self.arch, self.reader.tensors)   # checked against the tensors present
        self.vocab = Vocab.from_metadata(md)
        if self.hparams.n_vocab == 0:
            self.hparams.n_vocab = self.vocab.n_tokens
        self.use_mmap = use_mmap
        if split_mode not in ("layer", "none", "row"):
            raise ValueError(f"split_mode must be 'none', 'layer' or 'row', got {split_mode!r}")
        self.split_mode = split_mode
        self.override_tensor = parse_override_tensor(override_tensor)
        ngl = parse_n_gpu_layers(n_gpu_layers)
        self.cpu = backend_init("cpu", n_threads=n_threads)
        if devices is None and ngl != 0:
            devices, reason = gpu_backends(main_gpu, split_mode)
            if not devices and ngl != AUTO:
                warn_no_gpu(n_gpu_layers, reason, strict_offload)
        elif ngl not in (0, AUTO) and not devices:
            warn_no_gpu(n_gpu_layers, "no accelerator backend was given", strict_offload)
        self.devices = list(devices or [])
        n_layer = self.hparams.n_layer
        self.fit = None
        if ngl == AUTO:
            if self.devices:
                hp = self.hparams
                kv = n_ctx_hint * 2 * max(hp.n_embd_k_gqa(il) + hp.n_embd_v_gqa(il) for il in range(n_layer))
                free = sum(d.free_memory() for d in self.devices if hasattr(d, "free_memory"))
                self.fit = fit_layers(self.reader, n_layer, kv, free)
                ngl = self.fit.n_gpu_layers
            else:
                ngl = 0
        elif ngl < 0:
            ngl = n_layer + 1
        self.n_gpu_layers = ngl if self.devices else 0
        # split_mode 'row': the offloaded layers run on the main device, their matrices' rows split across all of
        # them in tensor_split's shares (llama.cpp's split buffer type; ggml/split.py)
        self.row_split = None
        if split_mode == "row" and len(self.devices) > 1 and self.n_gpu_layers:
            if not 0 <= main_gpu < len(self.devices):
                raise OffloadError(f"main_gpu {main_gpu} is not among the {len(self.devices)} devices")
            try:
                self.row_split = SplitBufferType(self.devices, tensor_split, self.devices[main_gpu])
            except ValueError as e:
                raise OffloadError(str(e)) from None
            tensor_split = [1.0 if i == main_gpu else 0.0 for i in range(len(self.devices))]
        self.layer_backend = self._assign_layers(tensor_split)
        self.tensors: dict[str, Tensor] = {}
        self.layers = [SimpleNamespace() for _ in range(self.hparams.n_layer)]
        loader = TensorLoader(self)
        try:
            self.arch.load_tensors(self, loader)
        except ModelLoadError:
            raise
        except ValueError as e:     # an architecture's own check of the file's shapes (jina-bert-v2's ffn_up rows)
            raise ModelLoadError(f"{self.hparams.arch}: {e}") from None
        unused = set(self.reader.tensors) - loader.used
        self.n_unused_tensors = len(unused)

    @staticmethod
    def _vocab_only_hparams(md: dict):
        """The architecture module (None when llampy has none) and what hyper-parameters the file gives; a
        vocabulary needs neither, so an unknown architecture or missing key is no error here."""
        arch = md.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelLoadError("missing metadata key 'general.architecture'")
        module = None
        if arch in arch_mod.ARCHITECTURES:
            module = arch_mod.arch_module(arch)
        try:
            hp = load_hparams(md, module)
        except (ValueError, KeyError, TypeError, IndexError):
            hp = HParams(arch=arch, name=str(md.get("general.name", "")))
        return module, hp

    # ------------------------------------------------------------------ placement
    def _assign_layers(self, tensor_split) -> list[Backend]:
        """Backend of each layer, plus the output head at index n_layer (llama.cpp's dev_layer / dev_output)."""
        n_layer = self.hparams.n_layer
        out = [self.cpu] * (n_layer + 1)
        n_gpu = min(max(self.n_gpu_layers, 0), n_layer + 1)
        if not self.devices or n_gpu == 0:
            return out
        if self.split_mode == "none":
            weights = [1.0] + [0.0] * (len(self.devices) - 1)
        else:
            weights = list(tensor_split) if tensor_split else [1.0] * len(self.devices)
            if len(weights) != len(self.devices) or sum(weights) <= 0:
                raise OffloadError(f"tensor_split {weights} does not match {len(self.devices)} devices")
        cum = np.cumsum(weights) / sum(weights)
        i_first = n_layer + 1 - n_gpu
        for il in range(i_first, n_layer + 1):
            frac = (il - i_first) / n_gpu
            out[il] = self.devices[int(np.searchsorted(cum, frac, side="right"))]
        return out

    @property
    def backends(self) -> list[Backend]:
        """All backends in the scheduler's priority order: accelerators first, the CPU last."""
        return self.devices + [self.cpu]

    def _weight(self, name: str, il: int) -> Tensor:
        if name in self.tensors:
            return self.tensors[name]
        backend = self.layer_backend[il] if il >= 0 else self.cpu
        if name.startswith("output"):                 # the head and its norm (llama.cpp's LAYER_OUTPUT)
            backend = self.layer_backend[-1]
        for pat, where in self.override_tensor:       # -ot: the first pattern that matches decides
            if pat.search(name):
                backend = self._backend_named(where)
                break
        else:
            if self.row_split is not None and backend is self.row_split.main and _ROW_SPLIT.match(name):
                info = self.reader.tensors[name]
                if all(getattr(d, "supports_weight", lambda ty: True)(GGMLType(info.type)) for d in self.devices):
                    t = self._place_rows(name)
                    self.tensors[name] = t
                    return t
        info = self.reader.tensors[name]
        if backend is not self.cpu and not getattr(backend, "supports_weight", lambda ty: True)(GGMLType(info.type)):
            backend = self.cpu                       # a type the device has no kernels for stays on the host
        t = self._place(name, backend)
        self.tensors[name] = t
        return t

    def _place(self, name: str, backend: Backend, name_as: str | None = None) -> Tensor:
        """A weight tensor holding the file's tensor ``name``, in ``backend``'s memory."""
        info = self.reader.tensors[name]
        t = Tensor(GGMLType(info.type), info.ne, name=name_as or name)
        t.flags |= Flags.WEIGHT
        buft = backend.get_default_buffer_type()
        from_file = getattr(buft, "buffer_from_file", None)
        if from_file is not None:    # a device that reads its own copy of the file (a remote stage): no upload
            tensor_alloc(from_file(name, info.nbytes), t, 0)
        elif self.use_mmap:    # host memory wraps the file's pages; a device's buffer type uploads them
            tensor_alloc(buft.buffer_from_host(info.data, BufferUsage.WEIGHTS), t, 0)
        else:
            tensor_alloc(buft.alloc_buffer(info.nbytes, BufferUsage.WEIGHTS), t, 0)
            tensor_set_bytes(t, info.data)
        return t

    def _place_rows(self, name: str) -> Tensor:
        """A weight matrix whose rows are split across the devices (split_mode 'row')."""
        info = self.reader.tensors[name]
        t = Tensor(GGMLType(info.type), info.ne, name=name)
        t.flags |= Flags.WEIGHT
        tensor_alloc(self.row_split.buffer_from_host(info.data, BufferUsage.WEIGHTS), t, 0)
        return t

    def _backend_named(self, where: str) -> Backend:
        if where == "CPU":
            return self.cpu
        for d in self.devices:
            if d.device == f"cuda:{where[4:]}":
                return d
        raise ModelLoadError(f"--override-tensor names {where}, which is not among the devices in use "
                             f"({', '.join(d.device for d in self.devices) or 'none'})")

    def tensor_by_name(self, name: str) -> Tensor:
        return self.tensors[name]

    @property
    def n_params(self) -> int:
        return sum(t.nelements for t in self.tensors.values())

    @property
    def size_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def desc(self) -> str:
        return f"{self.hparams.arch} {self.hparams.name} ({self.size_bytes / 2**20:.0f} MiB, {self.n_params / 1e6:.0f}M params)"

    def close(self) -> None:
        self.reader.close()


def load_model(path, **kw) -> Model:
    return Model(path, **kw)
