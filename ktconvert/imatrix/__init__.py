"""``ktconvert imatrix``: llama.cpp's importance matrix computed from the release itself (:mod:`.collect`)."""

from ktconvert.imatrix.collect import ImatrixRun, chunk_tokens, collect_imatrix, make_imatrix, text_tokens

__all__ = ["ImatrixRun", "chunk_tokens", "collect_imatrix", "make_imatrix", "text_tokens"]
