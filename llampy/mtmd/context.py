"""Prompts with images (llama.cpp's libmtmd): the text split on the media marker into chunks of tokens and images,
each image encoded by the projector (cached by a hash of its bytes) and decoded into the language model's cache as
a batch of embeddings between the model's begin/end-of-image text.

    mctx = MtmdContext("mmproj.gguf", model)
    chunks = mctx.tokenize("Describe <__media__> briefly.", [bitmap_from_file("cat.png")])
    n_past = mctx.eval_chunks(ctx, chunks, n_past=0, seq_id=0)      # logits of the last token are ready
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from ..llama.batch import Batch
from ..llama.context import CacheFull, ContextError
from .clip import Projector, ProjectorError
from .images import Bitmap, ImageError, preprocess
from .vision import Encoder

DEFAULT_MEDIA_MARKER = "<__media__>"


class MediaError(ValueError):
    """A prompt's images and markers do not fit together, or an image cannot go into the batch."""


@dataclass
class Chunk:
    """A run of text tokens, or one image: ``n_tokens`` positions either way (llama.cpp's mtmd_input_chunk)."""
    type: str                                   # "text" | "image"
    tokens: list = field(default_factory=list)  # text tokens
    bitmap: Bitmap | None = None
    n_tokens: int = 0
    entry: int = 0                              # which of the image's encoder inputs (tiled projectors: 0 overview)
    nx: int = 0                                 # M-RoPE: the image's tokens a row, and its rows (else 0)
    ny: int = 0

    @property
    def n_pos(self) -> int:
        """The positions the chunk advances the sequence by (mtmd_input_chunk_get_n_pos): an image's tokens, or with
        M-RoPE, where all its tokens share one position and differ by row and column, max(rows, columns)."""
        return max(self.nx, self.ny) if self.nx else self.n_tokens

    @property
    def id(self) -> str | None:
        return f"{self.bitmap.id}:{self.entry}" if self.bitmap is not None else None


class ImagePos:
    """One position of an image chunk in a flat prompt (``MtmdContext.flatten``): equal to the same position of an
    image of the same bytes, so that a prompt's common prefix with the cache extends over images already decoded."""
    __slots__ = ("chunk", "j")

    def __init__(self, chunk: Chunk, j: int):
        self.chunk, self.j = chunk, j

    def __eq__(self, other):
        return isinstance(other, ImagePos) and other.j == self.j and other.chunk.id == self.chunk.id

    def __hash__(self):
        return hash((self.chunk.id, self.j))

    def __repr__(self):
        return f"ImagePos({self.chunk.id[:8]}, {self.j})"


# the text around an image chunk, per projector type (mtmd_context's img_beg / img_end)
_WRAP = {"gemma3": ("<start_of_image>", "<end_of_image>"), "idefics3": ("", ""),
         "qwen2vl_merger": ("<|vision_start|>", "<|vision_end|>"),
         "qwen2.5vl_merger": ("<|vision_start|>", "<|vision_end|>")}
# tiled projectors (mtmd_context's slice template): the tokens before and after the overview, the text before
# each tile (row and column from 1), the tokens ending a row of tiles but the last
_TILES = {"idefics3": (("\n\n", "<fake_token_around_image>", "<global-img>"), ("<fake_token_around_image>",),
                       "<fake_token_around_image><row_{r}_col_{c}>", ("\n",))}
# image chunks whose tokens attend to each other both ways (mtmd_decode_use_non_causal)
_NON_CAUSAL = frozenset({"gemma3"})


class MtmdContext:
    def __init__(self, mmproj_path, model, n_threads: int | None = None, media_marker: str = DEFAULT_MEDIA_MARKER,
                 cache_images: int = 32, use_gpu: bool = True):
        """``use_gpu`` (llama.cpp's mtmd_context_params.use_gpu; False: --no-mmproj-offload): when the language
        model runs layers on an accelerator, the projector's weights and its encoder graph go to the first of its
        devices too, with the CPU beside it for the ops that device lacks. llama.cpp offloads the projector
        whenever a GPU backend exists; llampy starts its GPU backend only for a model that asks for GPU layers."""
        self.model = model
        gpu = None
        if use_gpu and getattr(model, "n_gpu_layers", 0) and getattr(model, "devices", None):
            gpu = model.devices[0]
        self.proj = Projector(mmproj_path, n_threads=n_threads, backend=gpu)
        try:
            self.proj.check_text_model(model.hparams.n_embd)
            if self.proj.hparams.proj_type not in _WRAP:
                raise ProjectorError(f"projector type {self.proj.hparams.proj_type}: image input is not "
                                     f"implemented yet (its preprocessing and chunk layout)")
            self.tiles = None
            if self.proj.hparams.proj_type in _TILES:
                ov_beg, ov_end, tile_tmpl, row_end = _TILES[self.proj.hparams.proj_type]
                look = self._lookup_tokens(set(ov_beg + ov_end + row_end))
                self.tiles = ([look[t] for t in ov_beg], [look[t] for t in ov_end], tile_tmpl,
                              [look[t] for t in row_end])
        except ProjectorError:
            self.proj.close()
            raise
        self.encoder = Encoder(self.proj)
        self.media_marker = media_marker
        self.img_beg, self.img_end = _WRAP[self.proj.hparams.proj_type]
        self.non_causal = self.proj.hparams.proj_type in _NON_CAUSAL
        # the language model's M-RoPE (qwen2-VL): an image's tokens placed by row and column
        self.mrope = getattr(model.hparams, "n_pos_per_embd", 1) == 4
        self._cache: OrderedDict[str, list] = OrderedDict()
        self._pre = None
        self.cache_images = cache_images
        self.n_encoded = 0                      # images run through the encoder (cache misses)

    @property
    def vision(self) -> bool:
        return True

    # ------------------------------------------------------------------ prompt -> chunks
    def tokenize(self, text: str, bitmaps: list, add_special: bool = True, parse_special: bool = True) -> list:
        """mtmd_tokenize: the text split on the marker, each marker replaced by the next image; the number of
        markers must equal the number of images. BOS (where the vocabulary adds one) starts the first chunk."""
        parts = text.split(self.media_marker)
        n_markers = len(parts) - 1
        if n_markers != len(bitmaps):
            raise MediaError(f"number of media markers in text ({n_markers}) does not match number of images "
                             f"({len(bitmaps)}); put one {self.media_marker} where each image goes")
        vocab = self.model.vocab
        chunks: list[Chunk] = []

        def add_text(s: str, special: bool | None = None):     # the model's own texts parse specials always
            toks = vocab.tokenize(s, add_special=False, parse_special=parse_special if special is None else special) \
                if s else []
            if not toks:
                return
            if chunks and chunks[-1].type == "text":
                chunks[-1].tokens.extend(toks)
                chunks[-1].n_tokens = len(chunks[-1].tokens)
            else:
                chunks.append(Chunk("text", list(toks), n_tokens=len(toks)))

        def add_ids(ids: list):
            if chunks and chunks[-1].type == "text":
                chunks[-1].tokens.extend(ids)
                chunks[-1].n_tokens = len(chunks[-1].tokens)
            elif ids:
                chunks.append(Chunk("text", list(ids), n_tokens=len(ids)))

        for i, part in enumerate(parts):
            add_text(part)
            if i < n_markers:
                bm = bitmaps[i]
                add_text(self.img_beg, True)
                if self.tiles is None:
                    ch = Chunk("image", bitmap=bm, n_tokens=self._n_image_tokens(bm))
                    if self.mrope:
                        ch.nx, ch.ny = self._grid(bm)
                    chunks.append(ch)
                else:
                    self._add_tiles(chunks, bm, add_text, add_ids)
                add_text(self.img_end, True)
        if add_special and vocab.add_bos and vocab.bos is not None:
            if chunks and chunks[0].type == "text":
                chunks[0].tokens.insert(0, vocab.bos)
                chunks[0].n_tokens += 1
            else:
                chunks.insert(0, Chunk("text", [vocab.bos], n_tokens=1))
        if add_special and vocab.add_eos and vocab.eos is not None:
            add_text_ids = [vocab.eos]
            if chunks and chunks[-1].type == "text":
                chunks[-1].tokens.extend(add_text_ids)
                chunks[-1].n_tokens += 1
            else:
                chunks.append(Chunk("text", add_text_ids, n_tokens=1))
        return chunks

    def flatten(self, chunks: list) -> list:
        """The prompt as one list: text tokens as they are, each image position an ImagePos. With M-RoPE the item
        count is not the position (an image's tokens share one): callers place items by ``seq_pos``."""
        out: list = []
        for ch in chunks:
            if ch.type == "text":
                out.extend(ch.tokens)
            else:
                out.extend(ImagePos(ch, j) for j in range(ch.n_tokens))
        return out

    def _lookup_tokens(self, texts: set) -> dict:
        """mtmd_context::lookup_token: the first token whose piece (specials rendered) is the text; a text no token
        spells is an error here (llama.cpp would put token -1 in the prompt)."""
        vocab, found = self.model.vocab, {}
        want = {t.encode(): t for t in texts}
        for i in range(vocab.n_tokens):
            t = want.get(vocab.token_to_piece(i, special=True))
            if t is not None and t not in found:
                found[t] = i
                if len(found) == len(want):
                    break
        missing = sorted(set(texts) - set(found))
        if missing:
            raise ProjectorError(f"projector type {self.proj.hparams.proj_type}: the language model's vocabulary has "
                                 f"no token for {', '.join(repr(m) for m in missing)}; is it the model the "
                                 f"projector belongs to?")
        return found

    def _add_tiles(self, chunks: list, bm: Bitmap, add_text, add_ids) -> None:
        """An image of a tiled projector (mtmd_tokenizer::add_media, llava-uhd style with the overview last): per tile
        its row/column text and its chunk, a row-end token between rows, then the overview between its tokens."""
        ov_beg, ov_end, tile_tmpl, row_end = self.tiles
        pre = self._preprocess(bm)
        n_tok = self.proj.n_image_tokens(self.proj.hparams.image_size, self.proj.hparams.image_size)
        for y in range(pre.grid_y):
            for x in range(pre.grid_x):
                add_text(tile_tmpl.format(r=y + 1, c=x + 1), True)
                chunks.append(Chunk("image", bitmap=bm, n_tokens=n_tok, entry=1 + y * pre.grid_x + x))
            if y != pre.grid_y - 1:
                add_ids(row_end)
        add_ids(ov_beg)
        chunks.append(Chunk("image", bitmap=bm, n_tokens=n_tok, entry=0))
        add_ids(ov_end)

    def _preprocess(self, bm: Bitmap):
        """The image's encoder inputs, kept for the encode that follows the tokenize (one image's, by its id)."""
        if self._pre is not None and self._pre[0] == bm.id:
            return self._pre[1]
        pre = preprocess(bm, self.proj.hparams)
        self._pre = (bm.id, pre)
        return pre

    @staticmethod
    def seq_pos(items: list, n: int) -> int:
        """The sequence position after the first n items of a flat prompt: n, less what each whole image among them
        saves (an image advances by Chunk.n_pos, M-RoPE's max(rows, columns), not by its token count)."""
        pos = n
        for it in items[:n]:
            if isinstance(it, ImagePos) and it.j == it.chunk.n_tokens - 1:
                pos += it.chunk.n_pos - it.chunk.n_tokens
        return pos

    def _grid(self, bm: Bitmap) -> tuple[int, int]:
        """The merged tokens a row and the rows of an image (clip_n_output_tokens_x / _y)."""
        hp = self.proj.hparams
        h, w = self._preprocess(bm).images[0].shape[:2]
        return w // hp.patch_size // hp.n_merge, h // hp.patch_size // hp.n_merge

    def _n_image_tokens(self, bm: Bitmap) -> int:
        hp = self.proj.hparams
        if hp.proj_type == "gemma3":          # every image becomes one image_size square
            return self.proj.n_image_tokens(hp.image_size, hp.image_size)
        h, w = self._preprocess(bm).images[0].shape[:2]
        return self.proj.n_image_tokens(w, h)

    # ------------------------------------------------------------------ images -> embeddings
    def encode(self, bitmap: Bitmap, entry: int | None = None) -> np.ndarray:
        """The image's embeddings [n_tokens, n_embd] (all its encoder inputs in entry order, or the one ``entry``),
        from the cache when these bytes were encoded before."""
        outs = self._cache.get(bitmap.id)
        if outs is not None:
            self._cache.move_to_end(bitmap.id)
        else:
            outs = [self.encoder.encode(px) for px in self._preprocess(bitmap).images]
            self._pre = None
            self.n_encoded += 1
            self._cache[bitmap.id] = outs
            while len(self._cache) > self.cache_images:
                self._cache.popitem(last=False)
        if entry is not None:
            return outs[entry]
        return np.concatenate(outs, axis=0) if len(outs) > 1 else outs[0]

    # ------------------------------------------------------------------ chunks -> the language model's cache
    def eval_chunks(self, ctx, chunks: list, n_past: int = 0, seq_id: int = 0, n_batch: int | None = None,
                    logits_last: bool = True) -> int:
        """mtmd_helper_eval_chunks: text in batches of n_batch, each image as an embeddings batch (non-causal
        where the model wants it); the last text token asks for logits. Returns the new n_past."""
        n_batch = int(n_batch or ctx.n_batch)
        for i, ch in enumerate(chunks):
            last = i == len(chunks) - 1
            if ch.type == "text":
                toks = ch.tokens
                for j in range(0, len(toks), n_batch):
                    part = toks[j:j + n_batch]
                    b = Batch.from_tokens(part, n_past, seq_id, logits_last=logits_last and last
                                          and j + n_batch >= len(toks))
                    ctx.decode(b)
                    n_past += len(part)
            else:
                n_past = self.eval_image(ctx, ch, n_past, seq_id, n_batch)
        return n_past

    def eval_image(self, ctx, chunk: Chunk, n_past: int, seq_id: int = 0, n_batch: int | None = None) -> int:
        embd = self.encode(chunk.bitmap, chunk.entry)
        n = len(embd)
        n_batch = int(n_batch or ctx.n_batch)
        if self.non_causal and n > min(n_batch, ctx.n_ubatch):
            raise MediaError(f"an image of {n} tokens does not fit in one batch (n_batch {n_batch}, n_ubatch "
                             f"{ctx.n_ubatch}): its tokens attend to each other, so raise the batch size to {n} "
                             f"or more")
        mpos = None
        if self.mrope:       # mtmd_image_tokens_get_decoder_pos: rows t, y, x, z of token i
            if chunk.nx * chunk.ny != n:
                raise MediaError(f"the image's {n} tokens are not its {chunk.nx}x{chunk.ny} grid")
            i = np.arange(n, dtype=np.int32)
            mpos = np.stack([np.full(n, n_past, np.int32), n_past + i // chunk.nx, n_past + i % chunk.nx,
                             np.zeros(n, np.int32)], axis=1)
        prev = ctx.causal_attn
        ctx.set_causal_attn(not self.non_causal)
        try:
            for j in range(0, n, n_batch):
                ctx.decode(Batch.from_embd(embd[j:j + n_batch], n_past + j, seq_id,
                                           mpos=None if mpos is None else mpos[j:j + n_batch]))
        except CacheFull:
            raise
        except ContextError as e:
            raise MediaError(f"decoding the image failed: {e}") from None
        finally:
            ctx.set_causal_attn(prev)
        return n_past + chunk.n_pos

    def close(self) -> None:
        self.proj.close()


def load_mtmd(mmproj_path, model, **kw) -> MtmdContext:
    return MtmdContext(mmproj_path, model, **kw)


__all__ = ["MtmdContext", "Chunk", "ImagePos", "MediaError", "ProjectorError", "ImageError", "DEFAULT_MEDIA_MARKER", "load_mtmd"]
