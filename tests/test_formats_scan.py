"""scan_checkpoint on its own: counts merged across decode blocks, experts scanned one at a time."""

from __future__ import annotations

import numpy as np

from formats_helpers import write_gguf
from ktconvert.formats import detect_layout, open_checkpoint, scan_checkpoint


def test_counts_are_merged_across_blocks_and_progress_covers_every_byte(tmp_path):
    import gguf

    big = np.ones((64, 32), np.float32)
    big[[1, 20, 63], 3] = np.nan  # in three different 1 KiB blocks
    big[40, :5] = -np.inf
    q = np.ones((64, 32), np.float32)
    q[10:12] = np.nan
    with np.errstate(invalid="ignore"):  # gguf-py casts the NaN rows to int8 while quantizing
        q8 = gguf.quants.quantize(q, gguf.GGMLQuantizationType.Q8_0)  # NaN rows get a NaN block scale
    p = write_gguf(tmp_path / "m.gguf", "qwen3moe", {"token_embd.weight": big,
                                                     "output.weight": (q8, gguf.GGMLQuantizationType.Q8_0)})
    ck = open_checkpoint(p)
    done = []
    res = scan_checkpoint(ck, progress=done.append, chunk_bytes=1024)
    assert {(f.kind, f.tensor, f.count) for f in res.findings} == {
        ("nan", "token_embd.weight", 3), ("inf", "token_embd.weight", 5), ("nan", "output.weight", 64)}
    assert sum(done) == ck.total_bytes == res.scanned_bytes


def test_experts_of_a_stacked_tensor_are_reported_by_index(tmp_path):
    gate = np.ones((6, 8, 32), np.float32)
    gate[4] = 0
    gate[5, 0, 0] = np.inf
    p = write_gguf(tmp_path / "e.gguf", "qwen3moe", {"blk.0.ffn_gate_exps.weight": gate,
                                                     "blk.0.ffn_up_exps.weight": np.ones((6, 8, 32), np.float32),
                                                     "blk.0.ffn_down_exps.weight": np.ones((6, 32, 8), np.float32)})
    ck = open_checkpoint(p)
    res = scan_checkpoint(ck, matches=detect_layout(ck).matches)
    assert sorted((f.kind, f.expert, f.where) for f in res.findings) == [
        ("all-zero", 4, "blk.0.ffn_gate_exps.weight[expert 4]"), ("inf", 5, "blk.0.ffn_gate_exps.weight[expert 5]")]
    # without layout matches nothing is known to be an expert: no all-zero check, Inf still found
    assert [(f.kind, f.expert) for f in scan_checkpoint(ck).findings] == [("inf", None)]
