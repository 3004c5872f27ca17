"""``golden --engine stream``: golden outputs from the release itself with ktconvert's reference modules, layer by
layer from disk within a memory budget (:mod:`ktconvert.model.executor`); transformers is not needed.

The run is the layer-major executor over the prompt twice: prefill (every position through each layer in one call,
the golden's tensors) and decode (one position per call against each layer's own cache), whose distance from the
prefill logits is recorded as the producer's self-check, as the transformers engine records its own. Both runs go
through one pass over the checkpoint (:meth:`~ktconvert.model.executor.LayerMajor.run_many`): each layer is read
once for the two.

The reference modules follow transformers 5 operation by operation (tests/test_reference_models.py), so a streamed
golden equals the transformers golden within the goldens' tolerance (tests/test_golden_stream.py) and
``--engine transformers`` stays the proof of this engine.
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import numpy as np

from ktconvert import __version__
from ktconvert.formats import Release, open_release
from ktconvert.io.procstats import TreePeak

ENGINES = ("auto", "transformers", "stream")
STREAM_IMPLEMENTATION = "ktconvert-reference"
#: the default ``--max-memory``: this share of the memory available when the run starts
DEFAULT_SHARE = 0.5


def available_memory() -> int:
    """Bytes of memory available now (``MemAvailable``; the physical pages free where /proc/meminfo is absent)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_budget() -> int:
    """:data:`DEFAULT_SHARE` of :func:`available_memory`."""
    return int(available_memory() * DEFAULT_SHARE)


def float32_bytes(model_dir: str | os.PathLike | Release) -> int:
    """What the whole model takes in float32 (logical sizes, quantized weights decoded; scales not counted)."""
    return open_release(model_dir).float32_bytes()


def pick_engine(engine: str, model_dir, budget: int) -> str:
    """``auto``: transformers when it is installed and the float32 model fits ``budget``, else stream."""
    if engine != "auto":
        return engine
    try:
        import transformers  # noqa: F401
    except ImportError:
        return "stream"
    return "transformers" if float32_bytes(model_dir) <= budget else "stream"


def source_records(model_dir: str | os.PathLike | Release) -> dict[str, dict]:
    """Per weight file: its size and the sha256 of its safetensors header (8-byte length + JSON), which names and
    places every tensor; hashing a whole multi-hundred-gigabyte release would take longer than the run."""
    return open_release(model_dir).source_records()


def compute_stream_golden(model_dir: str | os.PathLike | Release, prompt_ids: list[int], *, threads: int = 1,
                          max_memory: int, decode_check: bool = True):
    """The golden tensors of ``prompt_ids`` from the streamed reference model (nothing is written): a
    :class:`ktconvert.golden.run.GoldenRun` whose producer records the engine, the budget and what the run
    read and held."""
    import torch

    from ktconvert.golden.run import GoldenRun
    from ktconvert.model.executor import CheckpointWeights, LayerMajor
    from ktconvert.model.reference import build_skeleton

    began = time.perf_counter()
    release = open_release(model_dir)
    cfg = release.config
    weights = CheckpointWeights(release, cfg, budget=max_memory)
    weights.reuse = True  # the run's only provider: a dropped part's memory goes to the next part, within the budget
    skeleton = build_skeleton(cfg)
    weights.check_budget(skeleton)
    run = LayerMajor(skeleton, weights)
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    peaks = TreePeak()
    try:
        with peaks, torch.no_grad():
            decode_diff = float("nan")
            if decode_check:  # prefill and decode in one pass over the checkpoint
                out, dec = run.run_many(ids, [None, 1])
                decode_diff = float((dec.logits - out.logits).abs().max())
            else:
                out = run.run(ids)
    finally:
        torch.set_num_threads(previous)
    tensors = {
        "input_ids": ids.numpy().astype(np.int64),
        "logits": out.logits.float().numpy(),
        "hidden_states": torch.stack(out.hidden_states).float().numpy(),
        "final_hidden": out.final_hidden.float().numpy(),
    }
    producer = {
        "tool": f"ktconvert {__version__}",
        "engine": "stream",
        "transformers": None,
        "torch": str(torch.__version__),
        "python": platform.python_version(),
        "dtype": "float32",
        "threads": threads,
        "device": "cpu",
        "attn_implementation": STREAM_IMPLEMENTATION,
        "experts_implementation": STREAM_IMPLEMENTATION,
    }
    st = weights.stats
    stream = {"max_memory": int(max_memory), "peak_resident_weights": int(st.peak), "bytes_read": int(st.bytes_read),
              "experts_loaded": int(st.experts), "seconds": round(time.perf_counter() - began, 3), **peaks.as_dict()}
    return GoldenRun(tensors=tensors, producer=producer, decode_max_abs_diff=decode_diff, stream=stream)
