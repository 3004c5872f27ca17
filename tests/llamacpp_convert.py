"""llama.cpp's own Hugging Face converter (``convert_hf_to_gguf.py`` with its ``conversion`` package and the
``gguf-py`` it ships), from the pinned llama-cpp-python sdist, run in a child process.

Used where "what llama.cpp makes of this checkpoint" is the reference, e.g. gpt-oss's MXFP4 experts, which its
converter repacks losslessly into the MXFP4 ggml type. Only those sources are extracted (a few MB of the sdist)
into a cache directory beside ggml's reference and reused.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from ggml_ref import LLAMA_CPP_PYTHON_VERSION, RefUnavailable

_KEEP = ("convert_hf_to_gguf.py", "conversion", "gguf-py")

# The tiny models' tokenizer is not one of the pre-tokenizers llama.cpp recognises by hash; the GPT-2 one is what
# ktconvert writes for it (and what llama.cpp tokenizes it with), and it does not touch any tensor.
CHILD = r"""
import runpy, sys
root, model, out, outtype, raw_config = sys.argv[1:6]
sys.path[:0] = [root + "/gguf-py", root]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
if raw_config == "1":
    class _Unknown:
        @staticmethod
        def from_pretrained(*args, **kwargs):
            raise ValueError("config.json as written")
    base.AutoConfig = _Unknown
sys.argv = ["convert_hf_to_gguf.py", model, "--outfile", out, "--outtype", outtype]
runpy.run_path(root + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def cache_dir() -> Path:
    root = os.environ.get("KTCONVERT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ktconvert")
    return Path(root) / "llama-convert" / LLAMA_CPP_PYTHON_VERSION


def sources() -> Path:
    """The extracted converter (downloaded once with pip, like ggml's reference)."""
    target = cache_dir()
    if (target / ".complete").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{LLAMA_CPP_PYTHON_VERSION}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / ".complete").is_file():
            return target
        with tempfile.TemporaryDirectory(prefix="llama-convert-", dir=target.parent) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q",
                   f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", tmp]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise RefUnavailable(f"pip download of llama-cpp-python failed: {exc}") from exc
            sdists = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
            if proc.returncode != 0 or not sdists:
                raise RefUnavailable("pip download of llama-cpp-python failed:\n" + proc.stderr[-2000:])
            with tarfile.open(sdists[0], "r:gz") as tar:
                members = []
                for m in tar.getmembers():
                    parts = m.name.split("/")
                    if len(parts) >= 4 and parts[1:3] == ["vendor", "llama.cpp"] and parts[3] in _KEEP \
                            and ".." not in parts and (m.isfile() or m.isdir()):
                        m.name = "/".join(parts[3:])
                        members.append(m)
                tar.extractall(target, members=members, filter="data")
        (target / ".complete").write_text("ok\n")
    return target


def convert(model_dir: Path, out: Path, outtype: str = "f32", *, raw_config: bool = False) -> Path:
    """``convert_hf_to_gguf.py MODEL --outfile OUT --outtype OUTTYPE``; raises AssertionError with its log tail.

    ``raw_config``: the converter reads config.json as written, its fallback when transformers does not know the
    model. MiniMax-M3 needs it: transformers 5.23 knows minimax_m3_vl and its config drops the hub's
    sparse_attention_config and moe_layer_freq, which the converter's MiniMaxM3Model requires (conversion/minimax.py,
    set_gguf_parameters)."""
    root = sources()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(root), str(model_dir), str(out), outtype,
                           "1" if raw_config else "0"], env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 or not out.is_file():
        raise AssertionError("llama.cpp's converter failed:\n" + "\n".join(proc.stderr.splitlines()[-15:]))
    return out
