"""A sequence's KV cache to bytes and back (llama.cpp's llama_state_seq_get_data / set_data and the slot files of
llama-server's --slot-save-path): the tokens it holds, their positions, and every layer's K and V rows.

One file holds one or more sequences (``save_seqs``/``load_seqs``: a server's slots, a prompt cache), each under
its own key, beside a header that names what the rows fit: the architecture, layer count, KV heads and head sizes,
cache types, vocabulary size. Restoring into a context whose model differs raises StateError; so does a sequence
larger than its room in the cache. The format is NumPy's .npz (no pickles), not llama.cpp's.
"""
from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np

from ..ggml.backend import tensor_get, tensor_set
from .context import ContextError

MAGIC = "llampy-seq-state/1"


class StateError(ContextError):
    pass


def _header(ctx) -> dict:
    hp, kv = ctx.model.hparams, ctx.kv
    h = {"magic": MAGIC, "arch": hp.arch, "n_layer": hp.n_layer, "n_vocab": hp.n_vocab,
         "n_head_kv": [hp.n_head_kv(il) for il in range(hp.n_layer)], "n_embd_head_k": hp.n_embd_head_k,
         "n_embd_head_v": hp.n_embd_head_v}
    if _parts(kv)[1] is not None:          # a recurrent memory: the state rows' sizes
        h["n_embd_r"], h["n_embd_s"] = hp.n_embd_r(), hp.n_embd_s()
    if _parts(kv)[0] is not None:
        h["type_k"], h["type_v"] = kv.type_k.name, kv.type_v.name
    return h


def _n_tokens(state: dict) -> int:
    """The tokens a saved sequence holds: a recurrent state counts them, a KV cache has a cell for each."""
    return int(state["rs_n_tok"][0]) if "rs_n_tok" in state else len(state["pos"])


def _parts(mem):
    """(the KV cache, the recurrent memory) of a context's memory, None for the part it does not have."""
    if hasattr(mem, "recr"):
        return mem.attn, mem.recr
    if hasattr(mem, "seq_state_get"):
        return None, mem
    return mem, None


def seq_get(ctx, seq_id: int) -> dict:
    """The cells of ``seq_id``, in position order: {"pos": int32[n], "k<il>", "v<il>": their rows per layer}. A cell
    shared with another sequence is copied too (it then belongs to this one alone once restored). A recurrent
    memory gives its state rows instead; a hybrid's, both."""
    kv, recr = _parts(ctx.kv)
    out = recr.seq_state_get(seq_id) if recr is not None else {}
    if kv is None:
        return out
    cells = np.flatnonzero(kv.seq[:, seq_id] & (kv.pos >= 0))
    cells = cells[np.argsort(kv.pos[cells], kind="stable")]
    out["pos"] = kv.pos[cells].astype(np.int32)
    for il in range(len(kv.k)):
        if kv.k[il] is None:
            continue
        out[f"k{il}"] = tensor_get(kv.k[il])[..., cells, :]      # [.., n_head_kv, n, row]: these cells' rows
        if kv.v[il] is not None:    # None: V inside K (MLA)
            out[f"v{il}"] = tensor_get(kv.v[il])[..., cells, :]
    return out


def seq_set(ctx, seq_id: int, state: dict) -> int:
    """Replace ``seq_id``'s cells with ``state``'s (from seq_get): cells found as a decode would find them, rows
    written per layer. Returns the number of cells restored. On a failure the sequence is left empty."""
    kv, recr = _parts(ctx.kv)
    if recr is not None:
        try:
            n_tok = recr.seq_state_set(seq_id, state)
        except (KeyError, ValueError) as e:
            raise StateError(f"the saved sequence does not fit this model's state: {e}") from None
        if kv is None:
            return n_tok
    pos = np.asarray(state["pos"], dtype=np.int32)
    n = len(pos)
    kv.seq_rm(seq_id, -1, -1)
    if n == 0:
        return 0
    seq_ids = [(seq_id,)] * n
    try:
        idxs = kv.find_slot(n, seq_ids)
    except ValueError as e:
        raise StateError(f"the saved sequence ({n} cells) does not fit: {e}") from None
    for il in range(len(kv.k)):
        if kv.k[il] is None:
            continue
        for name, t in ((f"k{il}", kv.k[il]), (f"v{il}", kv.v[il])):
            if t is None:           # V inside K (MLA)
                continue
            rows = np.asarray(state[name])
            cur = tensor_get(t)
            want = cur.shape[:-2] + (n, cur.shape[-1])
            if rows.shape != want or rows.dtype != cur.dtype:
                raise StateError(f"saved rows {name} have shape {rows.shape}, the cache wants {want}")
            cur[..., idxs, :] = rows
            tensor_set(t, cur)
    kv.apply(idxs, pos, seq_ids)
    return n


def save_seqs(path, ctx, seqs: dict) -> int:
    """Write {key: (tokens, seq_id)} to ``path`` (atomically: a temporary file, then a rename); returns its size in
    bytes. ``key`` names the sequence in the file (a slot's number, "prompt")."""
    arrays = {"header": np.frombuffer(json.dumps(_header(ctx)).encode(), np.uint8),
              "keys": np.frombuffer(json.dumps([str(k) for k in seqs]).encode(), np.uint8)}
    for key, (tokens, seq_id) in seqs.items():
        st = seq_get(ctx, seq_id)
        if _n_tokens(st) != len(tokens):
            raise StateError(f"sequence {seq_id} holds {_n_tokens(st)} cells but {len(tokens)} tokens were given")
        arrays[f"{key}/tokens"] = np.asarray(tokens, dtype=np.int32)
        for name, a in st.items():
            arrays[f"{key}/{name}"] = a
    f = io.BytesIO()
    np.savez(f, **arrays)
    data = f.getvalue()
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return len(data)


def read_seqs(path, ctx) -> tuple[dict, int]:
    """{key: state} of a file written by save_seqs, each state a dict with "tokens", "pos" and the rows; checked
    against ``ctx``'s model and cache. Returns it and the file's size."""
    try:
        data = Path(path).read_bytes()
        z = np.load(io.BytesIO(data), allow_pickle=False)
        header = json.loads(bytes(z["header"]).decode())
        keys = json.loads(bytes(z["keys"]).decode())
    except (OSError, ValueError, KeyError, UnicodeDecodeError) as e:
        raise StateError(f"{path}: not a llampy state file ({e})") from None
    want = _header(ctx)
    if header != want:
        diff = [k for k in want if header.get(k) != want[k]]
        raise StateError(f"{path}: saved for another model or cache ({', '.join(diff) or 'magic'} differ)")
    out = {}
    for key in keys:
        names = [n for n in z.files if n.startswith(f"{key}/")]
        out[key] = {n.split("/", 1)[1]: z[n] for n in names}
    return out, len(data)


def load_seq(state: dict, ctx, seq_id: int) -> list:
    """Restore one state of read_seqs into ``seq_id``; returns its tokens."""
    tokens = [int(t) for t in state["tokens"]]
    if len(tokens) != _n_tokens(state):
        raise StateError("a saved sequence's tokens and cells disagree")
    seq_set(ctx, seq_id, state)
    return tokens


class LlamaState:
    """llama-cpp-python's LlamaState: what ``Llama.save_state()`` returns and ``load_state()`` takes. ``input_ids``:
    the tokens the cache holds; ``scores``: the logits of the last decode's outputs (its last row gives the next
    token); ``llama_state``: the context's cache as bytes (Context.state_save); ``seed``: the Llama's seed."""

    def __init__(self, input_ids, scores, n_tokens: int, llama_state: bytes, llama_state_size: int,
                 seed: int | None):
        self.input_ids = np.asarray(input_ids, dtype=np.intc)
        self.scores = np.asarray(scores, dtype=np.single)
        self.n_tokens, self.llama_state, self.llama_state_size, self.seed = n_tokens, llama_state, \
            llama_state_size, seed

    def save(self, path) -> None:
        """To a file (a prompt cache: ``llampy run --prompt-cache``), atomically."""
        f = io.BytesIO()
        np.savez(f, magic=np.frombuffer(b"llampy-state/1", np.uint8), input_ids=self.input_ids, scores=self.scores,
                 llama_state=np.frombuffer(self.llama_state, np.uint8),
                 seed=np.array([-1 if self.seed is None else self.seed], np.int64))
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(f.getvalue())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path) -> "LlamaState":
        try:
            z = np.load(io.BytesIO(Path(path).read_bytes()), allow_pickle=False)
            if bytes(z["magic"]) != b"llampy-state/1":
                raise ValueError("wrong magic")
            ids, state, seed = z["input_ids"], bytes(z["llama_state"]), int(z["seed"][0])
            return cls(ids, z["scores"], len(ids), state, len(state), None if seed < 0 else seed)
        except (OSError, ValueError, KeyError) as e:
            raise StateError(f"{path}: not a llampy state file ({e})") from None
