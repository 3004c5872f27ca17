"""A Hugging Face ``tokenizer.json`` (byte-level BPE) as the GGUF ``tokenizer.ggml.*`` fields llama.cpp reads.

llama.cpp needs, besides tokens and merges, the name of the pre-tokenizer (``tokenizer.ggml.pre``): it
re-implements each one and picks it by that name. convert_hf_to_gguf identifies it by hashing a test
tokenization; without the ``tokenizers`` runtime we identify it by the pre-tokenizer's own definition in
``tokenizer.json``, for the pre-tokenizers of the families ktconvert converts. Anything else is refused with a
way out (``--no-tokenizer`` writes ``tokenizer.ggml.model = none``, which llama.cpp loads as a vocabulary of
``vocab_size`` placeholder tokens).
"""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ktconvert.errors import InputError
from ktconvert.io.datafile import read_json

NO_TOKENIZER_FIX = "pass --no-tokenizer to write tokenizer.ggml.model = none, or convert the tokenizer with llama.cpp"

# The Split patterns of the pre-tokenizers ktconvert recognises (as tokenizer.json spells them), by llama.cpp name.
_SPLIT_PATTERNS = {
    ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",): "qwen2",
    ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",): "llama-bpe",
    ("\\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+",
     "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"): "deepseek-v3",
}


@dataclass(frozen=True)
class GgufVocab:
    """What goes into ``tokenizer.ggml.*``. ``tokens`` has exactly ``n_vocab`` entries (the embedding rows).

    ``special`` is gguf-py's ``SpecialVocab`` of the model directory, the object convert_hf_to_gguf writes the
    merges, special token ids, ``add_bos``/``add_eos``/``add_sep`` flags (from tokenizer_config.json and the
    tokenizer's post-processor) and chat template (tokenizer_config.json, else ``chat_template.jinja`` with
    ``additional_chat_templates/``, else ``chat_template.json``) with; ``add_to_gguf`` writes them."""

    model: str
    pre: str | None
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]
    special: object = None

    @property
    def chat_template(self):
        return getattr(self.special, "chat_template", None)

    @property
    def add_special(self) -> dict:
        return dict(getattr(self.special, "add_special_token", {}) or {})

    @property
    def special_ids(self) -> dict:
        return dict(getattr(self.special, "special_token_ids", {}) or {})


def _load(path: Path) -> dict:
    return read_json(path, path.name, fix=NO_TOKENIZER_FIX)


def _pre_name(pre, path: Path) -> str:
    if isinstance(pre, dict) and pre.get("type") == "Sequence":
        steps = pre.get("pretokenizers") or []
    else:
        steps = [pre] if pre else []
    splits, byte_level = [], None
    for s in steps:
        if not isinstance(s, dict):
            break
        if s.get("type") == "Split" and isinstance(s.get("pattern"), dict):
            splits.append(s["pattern"].get("Regex") or s["pattern"].get("String"))
        elif s.get("type") == "ByteLevel":
            byte_level = s
        else:
            splits.append(f"<{s.get('type')}>")
    if byte_level is not None and not splits and byte_level.get("use_regex", True):
        return "gpt-2"
    if byte_level is not None and not byte_level.get("use_regex", True):
        name = _SPLIT_PATTERNS.get(tuple(splits))
        if name:
            return name
    raise InputError("its pre-tokenizer is not one ktconvert can name for llama.cpp "
                     f"({json.dumps(pre)[:120]}...)", path=str(path), where="pre_tokenizer", fix=NO_TOKENIZER_FIX)


def convert_tokenizer(model_dir: Path, n_vocab: int, config: dict | None) -> GgufVocab | None:
    """The GGUF vocabulary of the HF tokenizer in ``model_dir``; ``None`` when there is no ``tokenizer.json``.

    ``n_vocab`` is the number of embedding rows: llama.cpp needs exactly that many tokens, so ids the tokenizer
    does not use become ``[PAD<id>]`` placeholders of type UNUSED, as convert_hf_to_gguf writes them.
    """
    tj = model_dir / "tokenizer.json"
    if not tj.is_file():
        return None
    data = _load(tj)
    model = data.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise InputError(f"tokenizer model is {model.get('type')!r}; ktconvert converts byte-level BPE tokenizers",
                         path=str(tj), where="model.type", fix=NO_TOKENIZER_FIX)
    if model.get("byte_fallback"):
        raise InputError("a BPE tokenizer with byte_fallback is a SentencePiece tokenizer in disguise; llama.cpp "
                         "needs its tokenizer.model scores", path=str(tj), where="model.byte_fallback",
                         fix=NO_TOKENIZER_FIX)
    pre = _pre_name(data.get("pre_tokenizer"), tj)
    by_id: dict[int, tuple[str, int]] = {}
    for tok, i in model["vocab"].items():
        if type(i) is int and i >= 0:
            by_id[i] = (tok, 1)  # NORMAL
    for a in data.get("added_tokens") or []:
        if isinstance(a, dict) and type(a.get("id")) is int and isinstance(a.get("content"), str):
            by_id[a["id"]] = (a["content"], 3 if a.get("special") else 4)  # CONTROL / USER_DEFINED
    top = max(by_id, default=-1) + 1
    if top > n_vocab:
        raise InputError(f"token id {top - 1} does not fit the {n_vocab} embedding rows", path=str(tj),
                         where="model.vocab", fix="the tokenizer belongs to another model")
    tokens, types = [], []
    for i in range(n_vocab):
        tok, ty = by_id.get(i, (f"[PAD{i}]", 5))  # UNUSED
        tokens.append(tok)
        types.append(ty)
    merges = []
    for m in model.get("merges") or []:
        merges.append(" ".join(m) if isinstance(m, list) else str(m))
    sv = _special_vocab(model_dir, n_vocab)
    _byte_level_adds_nothing(sv, data.get("post_processor"))
    return GgufVocab(model="gpt2", pre=pre, tokens=tuple(tokens), token_types=tuple(types),
                     merges=tuple(sv.merges) if sv.merges else tuple(merges), special=sv)


def _byte_level_adds_nothing(sv, post_processor) -> None:
    """A ByteLevel post-processor adds no BOS and no EOS, and llama.cpp's converter (the gguf-py of llama.cpp 0.3.36,
    newer than the pinned one) writes ``add_bos_token``/``add_eos_token`` = false for it. What the post-processor says
    wins over tokenizer_config.json's flags there: alone, ByteLevel makes both false; in a chain, a template or
    RoBERTa step beside it keeps the flags it sets and ByteLevel makes the others false."""
    steps = post_processor.get("processors", [post_processor]) if isinstance(post_processor, dict) else []
    kinds = {p.get("type") for p in steps if isinstance(p, dict)}
    if "ByteLevel" not in kinds:
        return
    alone = not kinds & {"TemplateProcessing", "RobertaProcessing"}
    for typ in ("bos", "eos"):
        if alone:
            sv.add_special_token[typ] = False
        else:
            sv.add_special_token.setdefault(typ, False)


def _special_vocab(model_dir: Path, n_vocab: int):
    """gguf-py's ``SpecialVocab`` (what convert_hf_to_gguf uses), after every file it opens has been read through
    ktconvert's checks, so that a malformed or non-regular one is a one-line error naming it, not a traceback."""
    from gguf import SpecialVocab

    from ktconvert.io.files import regular_file_size

    for name in ("tokenizer_config.json", "config.json", "chat_template.json"):
        p = model_dir / name
        if p.exists() or p.is_symlink():
            data = read_json(p, name, fix=NO_TOKENIZER_FIX)
            tmpl = data.get("chat_template")
            if name != "config.json" and tmpl is not None and not isinstance(tmpl, (str, list)):
                raise InputError("chat_template is neither a string nor a list of named templates",
                                 path=str(p), where="chat_template", fix="fix chat_template, or remove it")
    jinja = [model_dir / "chat_template.jinja"]
    if jinja[0].exists() or jinja[0].is_symlink():
        extra = model_dir / "additional_chat_templates"
        jinja += sorted(extra.glob("*.jinja")) if extra.is_dir() else []
    for p in jinja:
        if p.exists() or p.is_symlink():
            regular_file_size(p, p.name, limit=64 * 1024**2, fix="remove or replace the template file")
            try:
                p.read_bytes().decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InputError(f"the chat template is not UTF-8 text (byte {exc.start})", path=str(p),
                                 fix="save the template as UTF-8") from None
    try:
        with quiet_gguf():
            return SpecialVocab(model_dir, load_merges=True, n_vocab=n_vocab)
    except Exception as exc:  # what gguf-py refuses (a negative special token id, merges of an unknown form)
        raise InputError(f"gguf-py cannot read its special tokens: {exc}", path=str(model_dir / "tokenizer.json"),
                         fix=NO_TOKENIZER_FIX) from None


@contextmanager
def quiet_gguf():
    """gguf-py's informational warnings (logging, which would reach stderr) held back while its readers run."""
    log = logging.getLogger("gguf")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)
