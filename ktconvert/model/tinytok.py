"""A small byte-level BPE tokenizer, trained here by a fixed procedure, written as ``tokenizer.json``.

The merges come from a built-in corpus with deterministic tie-breaking, so the files are identical on
every machine and need neither the ``tokenizers`` trainer nor a download. Vocabulary: 256 byte tokens
(GPT-2's byte-to-unicode alphabet), then the merges in training order, then ``<s>`` and ``</s>``.
"""

from __future__ import annotations

import json
import re
from collections import Counter

BOS, EOS = "<s>", "</s>"

CORPUS = """\
A mixture of experts model sends each token to a few experts chosen by a router. The router scores every
expert, keeps the best ones, and mixes their outputs with the scores as weights. Shared experts see every
token. Dense layers come first in some models, and the rest of the layers hold the routed experts.
The quick brown fox jumps over the lazy dog, and the lazy dog sleeps in the sun.
Quantized weights live in blocks of thirty two or two hundred and fifty six values, each with a scale.
When the layout is wrong the model still runs, but it prints the the the and nobody knows why.
Prefill reads the whole prompt at once; decode reads one token at a time and keeps a cache of keys and values.
Attention looks back over the cache, the router picks experts, the experts run, and the next token appears.
The rules say which module runs where: attention on the GPU, experts on the CPU, the head on the GPU.
Golden outputs come from the reference implementation and every conversion is compared against them.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 512 1024. Symbols: ( ) [ ] { } < > = + - * / . , ; : ! ?
"""

PROMPT_TEXT = "The router picks experts for each token, and the experts run on the CPU while attention runs on the GPU."

# ASCII form of GPT-2's pre-tokenizer pattern (the corpus is ASCII, so it splits exactly as ByteLevel does)
_PRETOKENIZE = re.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (the ByteLevel alphabet)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(keep, chars)}


def train_merges(text: str, count: int) -> list[tuple[str, str]]:
    """``count`` BPE merges over ``text``: most frequent adjacent pair first, ties by the pair's strings."""
    alphabet = bytes_to_unicode()
    words = Counter(tuple(alphabet[b] for b in piece.encode("utf-8")) for piece in _PRETOKENIZE.findall(text))
    merges: list[tuple[str, str]] = []
    while len(merges) < count:
        pairs: Counter = Counter()
        for word, freq in words.items():
            for a, b in zip(word, word[1:]):
                pairs[(a, b)] += freq
        if not pairs:
            raise ValueError(f"corpus supports only {len(merges)} merges, {count} requested")
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        merged: Counter = Counter()
        for word, freq in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += freq
        words = merged
    return merges


def tokenizer_files(vocab_size: int) -> dict[str, str]:
    """``tokenizer.json`` and ``tokenizer_config.json`` contents for a ``vocab_size``-token BPE."""
    alphabet = bytes_to_unicode()
    n_merges = vocab_size - 256 - 2
    merges = train_merges(CORPUS, n_merges)
    vocab: dict[str, int] = {}
    for b in range(256):
        vocab[alphabet[b]] = b
    for a, b in merges:
        vocab[a + b] = len(vocab)
    if len(vocab) != 256 + n_merges:
        raise ValueError("merges produced a duplicate token")
    bos_id, eos_id = vocab_size - 2, vocab_size - 1
    added = [
        {"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
        for i, tok in ((bos_id, BOS), (eos_id, EOS))
    ]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": None,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [[a, b] for a, b in merges],
        },
    }
    config = {
        "add_prefix_space": False,
        "added_tokens_decoder": {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in added},
        "bos_token": BOS,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS,
        "model_max_length": 256,
        "pad_token": None,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    return {
        "tokenizer.json": json.dumps(tokenizer, ensure_ascii=False, indent=2) + "\n",
        "tokenizer_config.json": json.dumps(config, ensure_ascii=False, indent=2, sort_keys=True) + "\n",
    }
