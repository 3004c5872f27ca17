"""Runs llama.cpp (through llama-cpp-python, built from source into a cache) on a GGUF in a child process.

The interop tier's independent check: if llama.cpp reads our GGUF and reproduces the golden logits, our
tensor names, metadata and kernel order are llama.cpp's. The build takes minutes once and is cached.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

VERSION = "0.3.36"

# The child loads models without llama.cpp's extra CPU buffer types (use_extra_bufts = False). With them, a build
# that reports AMX_INT8 = 1 (even GGML_NATIVE=OFF builds do) repacks quantized MoE tensors into AMX buffers and
# segfaults in llama_decode on Intel CPUs with AMX, on GGUFs llama.cpp's own quantizer wrote as well as on ours.
# The plain CPU buffers compute the same model on every CPU; llama-cpp-python's Llama() has no argument for the
# flag, so the default-params factory it calls is wrapped before the model loads.
CHILD = r"""
import json, sys
import numpy as np
import llama_cpp.llama_cpp as native
from llama_cpp import Llama
_default_model_params = native.llama_model_default_params
def _plain_cpu_buffers():
    params = _default_model_params()
    params.use_extra_bufts = False
    return params
native.llama_model_default_params = _plain_cpu_buffers
spec = json.loads(sys.argv[1])
llm = Llama(model_path=spec["model"], n_ctx=128, n_threads=1, n_batch=128, logits_all=True, verbose=False,
            seed=0, vocab_only=False, flash_attn=bool(spec.get("flash_attn")))
assert not llm.model_params.use_extra_bufts, "llama.cpp would load with extra buffer types"
llm.eval(spec["ids"])
scores = np.asarray(llm.scores[: len(spec["ids"])], dtype=np.float32)
np.save(spec["out"], scores)
if spec.get("text") is not None:
    with open(spec["out"] + ".tokens.json", "w") as fh:
        json.dump(llm.tokenize(spec["text"].encode(), add_bos=False), fh)
"""


class Unavailable(RuntimeError):
    """llama-cpp-python could not be built here (the message says why)."""


def target_dir() -> Path:
    root = os.environ.get("KTCONVERT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ktconvert")
    return Path(root) / "llama-cpp-python" / VERSION


def ensure_built(timeout: int = 1500) -> Path:
    """The cached install (built from the sdist on first use: about 4-5 minutes on two cores).

    A lock file serialises concurrent test runs: the second waits for the first build instead of starting its own.
    """
    import fcntl

    target = target_dir()
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{VERSION}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _build(target, timeout)


def _build(target: Path, timeout: int) -> Path:
    if (target / "llama_cpp" / "__init__.py").is_file() and (target / ".complete").is_file():
        return target
    env = {**os.environ, "CMAKE_ARGS": "-DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"}
    # --no-deps keeps the environment's numpy (a second copy in the target would shadow it); diskcache is the one
    # dependency that torch and ktconvert do not already bring (jinja2, typing-extensions, numpy).
    pip = [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target)]
    for what, cmd in ((f"llama-cpp-python {VERSION}", pip + [f"llama-cpp-python=={VERSION}"]),
                      ("diskcache", pip + ["diskcache>=5.6.1"])):
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise Unavailable(f"installing {what} failed: {exc}") from exc
        if proc.returncode != 0:
            raise Unavailable(f"installing {what} failed:\n" + "\n".join(proc.stderr.splitlines()[-10:]))
    (target / ".complete").write_text("ok\n")
    return target


def run(gguf: Path, ids: list[int], work: Path, text: str | None = None, *,
        flash_attn: bool = False) -> tuple[np.ndarray, list[int] | None]:
    """llama.cpp's logits for every position of ``ids`` (one thread, no sampling), and its tokens for ``text``.

    ``flash_attn``: llama.cpp's MiniMax-M3 runs its sparse attention only with flash attention on (off, it warns and
    attends densely, which is not the model)."""
    target = ensure_built()
    out = work / "llama_logits.npy"
    env = {**os.environ, "PYTHONPATH": str(target), "OMP_NUM_THREADS": "1"}
    spec = json.dumps({"model": str(gguf), "ids": [int(i) for i in ids], "out": str(out), "text": text,
                       "flash_attn": flash_attn})
    proc = subprocess.run([sys.executable, "-c", CHILD, spec], env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise AssertionError(f"llama.cpp could not run {gguf.name}:\n" + "\n".join(proc.stderr.splitlines()[-15:]))
    tokens = json.loads(Path(str(out) + ".tokens.json").read_text()) if text is not None else None
    return np.load(out), tokens


# llama.cpp's own quantizer (llama_model_quantize: the C entry point llama-quantize calls), in a child process.
QUANTIZE_CHILD = r"""
import json, sys
import llama_cpp
spec = json.loads(sys.argv[1])
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = spec["ftype"]
params.nthread = 1
params.pure = spec["pure"]
params.allow_requantize = spec["allow_requantize"]
params.dry_run = spec["dry_run"]
rc = llama_cpp.llama_model_quantize(spec["inp"].encode(), spec["out"].encode(), params)
sys.exit(0 if rc == 0 else 7)
"""


def quantize(inp: Path, out: Path, ftype: int, *, pure: bool = False, allow_requantize: bool = False,
             dry_run: bool = False) -> str:
    """``llama-quantize [--pure] [--allow-requantize] [--dry-run] inp out FTYPE`` through llama.cpp's C API (no
    imatrix); returns its log (stderr).

    Raises :class:`AssertionError` with llama.cpp's last log lines when it refuses or fails."""
    target = ensure_built()
    env = {**os.environ, "PYTHONPATH": str(target), "OMP_NUM_THREADS": "1"}
    spec = json.dumps({"inp": str(inp), "out": str(out), "ftype": int(ftype), "pure": pure,
                       "allow_requantize": allow_requantize, "dry_run": dry_run})
    proc = subprocess.run([sys.executable, "-c", QUANTIZE_CHILD, spec], env=env, capture_output=True, text=True,
                          timeout=300)
    if proc.returncode != 0:
        raise AssertionError(f"llama.cpp could not quantize {Path(inp).name}:\n"
                             + "\n".join((proc.stderr + proc.stdout).splitlines()[-8:]))
    return proc.stderr
