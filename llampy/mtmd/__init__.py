"""Multimodal input (llama.cpp's libmtmd): projector GGUFs, the vision encoder's graph, images into the batch."""
from .clip import Projector, ProjectorError
from .context import Chunk, DEFAULT_MEDIA_MARKER, MediaError, MtmdContext, load_mtmd
from .images import Bitmap, ImageError, bitmap_from_bytes, bitmap_from_file

__all__ = ["Projector", "ProjectorError", "Chunk", "DEFAULT_MEDIA_MARKER", "MediaError", "MtmdContext", "load_mtmd",
           "Bitmap", "ImageError", "bitmap_from_bytes", "bitmap_from_file"]
