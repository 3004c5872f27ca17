"""The layer-major executor (ktconvert.model.executor): streamed from disk part by part, it computes bit for bit what
the in-memory model computes, in prefill and in decode, on every tiny family and every release format; and a budget
smaller than the model holds."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ktconvert.errors import UsageProblem
from ktconvert.families.config import FAMILIES
from ktconvert.formats.safetensors_write import to_bytes
from ktconvert.io.sizes import format_size
from ktconvert.model import from_pretrained, load_config
from ktconvert.model.executor import CheckpointWeights, LayerMajor, max_memory_for
from ktconvert.model.reference import build_skeleton
from ktconvert.model.tiny import FP8_VARIANTS, TINY_VARIANTS, tiny_name, tiny_tensors, write_tiny_model
from ktconvert.model.tiny_release import FORMATS as RELEASE_FORMATS

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: a prompt long enough to route every expert of the tiny models, with repeats (decode attends to real history)
PROMPT = torch.tensor([[1, 17, 250, 3, 99, 402, 17, 8, 77, 310, 5, 250, 64, 2, 128, 411]])


def _in_memory(model_dir):
    """Today's path: the whole model loaded, prefill as one forward, decode one position per forward."""
    ref = from_pretrained(model_dir)
    with torch.no_grad():
        pre = ref(PROMPT, ref.new_cache())
        cache = ref.new_cache()
        steps = [ref(PROMPT[:, t:t + 1], cache) for t in range(PROMPT.shape[1])]
    cat = [torch.cat([s.hidden_states[i] for s in steps], dim=1) for i in range(len(pre.hidden_states))]
    dec = (torch.cat([s.logits for s in steps], dim=1), cat, torch.cat([s.final_hidden for s in steps], dim=1))
    return (pre.logits, list(pre.hidden_states), pre.final_hidden), dec


def _streamed(model_dir, budget=None):
    cfg = load_config(model_dir)
    weights = CheckpointWeights(model_dir, cfg, budget=budget)
    skeleton = build_skeleton(cfg)
    weights.check_budget(skeleton)
    run = LayerMajor(skeleton, weights)
    with torch.no_grad():
        pre, dec = run.run(PROMPT), run.run(PROMPT, step=1)
    return ((pre.logits, list(pre.hidden_states), pre.final_hidden),
            (dec.logits, list(dec.hidden_states), dec.final_hidden), weights)


def _assert_identical(want, got, what):
    (wl, wh, wf), (gl, gh, gf) = want, got
    assert torch.equal(wl, gl), f"{what}: logits differ by {(wl - gl).abs().max().item()}"
    assert len(wh) == len(gh)
    for i, (a, b) in enumerate(zip(wh, gh)):
        assert torch.equal(a, b), f"{what}: hidden state {i} differs by {(a - b).abs().max().item()}"
    assert torch.equal(wf, gf), f"{what}: final hidden differs"


def _check(model_dir):
    pre, dec = _in_memory(model_dir)
    spre, sdec, weights = _streamed(model_dir)
    _assert_identical(pre, spre, "prefill")
    _assert_identical(dec, sdec, "decode")
    assert weights.stats.resident == 0  # everything dropped after the run
    return weights


@pytest.mark.parametrize("family,variant", [(f, None) for f in FAMILIES] + list(TINY_VARIANTS),
                         ids=lambda x: x or "base")
def test_streamed_run_is_bit_identical_to_the_in_memory_run(tmp_path, family, variant):
    d = tmp_path / tiny_name(family, variant)
    write_tiny_model(family, d, variant=variant)
    weights = _check(d)
    cfg = load_config(d)
    # routed experts came one at a time, only the picked ones: never more than every (layer, expert) pair per run
    assert 0 < weights.stats.experts <= 2 * len(cfg.mlp.moe_layers) * cfg.num_experts


@pytest.mark.parametrize("fmt", RELEASE_FORMATS)
def test_streamed_release_formats_decode_as_the_in_memory_loader(tmp_path, fmt):
    """MXFP4, MXFP8, RAWINT4, NVFP4, FP8 per-channel, GPTQ: decoded through formats.quantized, one expert's rows at
    a time, bit-identical to the whole-tensor decoding the in-memory loader uses."""
    write_tiny_model("qwen3_moe", tmp_path / "m", quant=fmt)
    _check(tmp_path / "m")


@pytest.mark.parametrize("family", sorted(FP8_VARIANTS))
def test_streamed_fp8_block_releases(tmp_path, family):
    write_tiny_model(family, tmp_path / "m", fp8=True)
    _check(tmp_path / "m")


def test_streamed_fused_mxfp4_release(tmp_path):
    """gpt-oss' stacked [E, in, out] MXFP4 experts: one expert's slab read per fetch."""
    write_tiny_model("gpt_oss", tmp_path / "m", quant="mxfp4")
    _check(tmp_path / "m")


@pytest.mark.parametrize("dtype", ["BF16", "F16"])
def test_streamed_half_precision_checkpoints(tmp_path, dtype):
    """A BF16 / F16 release (what most are): widened to float32 exactly as load_weights widens it."""
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(_tiny_config("qwen3_moe")))
    tensors = tiny_tensors("qwen3_moe")
    if dtype == "BF16":
        bits = {k: (torch.from_numpy(v).to(torch.bfloat16).view(torch.uint16).numpy()) for k, v in tensors.items()}
        data = to_bytes(bits, {"format": "pt"}, {k: "BF16" for k in bits})
    else:
        data = to_bytes({k: v.astype(np.float16) for k, v in tensors.items()}, {"format": "pt"})
    (d / "model.safetensors").write_bytes(data)
    _check(d)


def _tiny_config(family):
    from ktconvert.model.tiny import tiny_config

    return tiny_config(family)


@pytest.mark.parametrize("family,spec,fmt", [("qwen3_moe", "Q4_K", "gguf"), ("mixtral", "Q4_K_M", "gguf"),
                                             ("deepseek_v3", "Q8_0", "gguf"), ("qwen3_moe", "Q8_0", "safetensors")])
def test_streamed_converted_weights_load_as_the_in_memory_candidate(tmp_path, family, spec, fmt):
    """A GGUF (llama-arch q/k un-permuted for Mixtral, MLA for DeepSeek) or kernel-order safetensors, read part by
    part through WeightSource, runs bit-identically to the model inject's default loader fills whole."""
    _check_converted(tmp_path, family, spec, fmt)


def _check_converted(tmp_path, family, spec, fmt):
    from ktconvert.convert import convert, presets
    from ktconvert.model import build_model
    from ktconvert.model.executor import ConvertedWeights
    from ktconvert.model.inject import _load_defaults
    from ktconvert.model.ops.source import WeightSource

    write_tiny_model(family, tmp_path / "m")
    kw = {"recipe": spec} if spec in presets() else {"type": spec, "allow_fallback": True}
    convert(tmp_path / "m", tmp_path / "c", format=fmt, **kw)
    weights = tmp_path / "c" / "model.gguf" if fmt == "gguf" else tmp_path / "c"
    cfg = load_config(tmp_path / "m")
    whole = build_model(cfg)
    _load_defaults(whole, WeightSource(weights, cfg))
    streamed = ConvertedWeights(WeightSource(weights, cfg), cfg)
    run = LayerMajor(build_skeleton(cfg), streamed)
    with torch.no_grad():
        pre = whole(PROMPT, whole.new_cache())
        cache = whole.new_cache()
        steps = [whole(PROMPT[:, t:t + 1], cache) for t in range(PROMPT.shape[1])]
        spre, sdec = run.run(PROMPT), run.run(PROMPT, step=1)
    _assert_identical((pre.logits, list(pre.hidden_states), pre.final_hidden),
                      (spre.logits, list(spre.hidden_states), spre.final_hidden), "prefill")
    _assert_identical((torch.cat([s.logits for s in steps], 1),
                       [torch.cat([s.hidden_states[i] for s in steps], 1) for i in range(len(pre.hidden_states))],
                       torch.cat([s.final_hidden for s in steps], 1)),
                      (sdec.logits, list(sdec.hidden_states), sdec.final_hidden), "decode")
    assert streamed.stats.resident == 0 and streamed.source._blocks == {}


@pytest.fixture
def small_vocab_chunks(monkeypatch):
    """96-row vocabulary chunks: the tiny vocabulary of 512 is 5 whole chunks and a partial one."""
    from ktconvert.model import executor, modules

    monkeypatch.setattr(modules, "VOCAB_CHUNK", 96)
    monkeypatch.setattr(executor, "VOCAB_CHUNK", 96)
    return 96


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss", "deepseek_v4"])
def test_vocabulary_chunks_stay_bit_identical(tmp_path, small_vocab_chunks, family):
    """lm_head over vocabulary chunks, the embedding's rows read per chunk-sized window: the resident run takes the
    same chunks (VocabHead), so logits and hidden states stay bit-identical, prefill and decode; the streamed
    embedding reads the prompt's distinct rows only, and the head one chunk at a time."""
    d = tmp_path / tiny_name(family)
    write_tiny_model(family, d)
    cfg = load_config(d)
    weights = _check(d)
    assert weights.has_rows("embed") and weights.has_rows("head")
    embed_only = CheckpointWeights(d, cfg)
    with torch.no_grad():
        LayerMajor(build_skeleton(cfg), embed_only).embed(PROMPT)
    row = embed_only.ck[embed_only.vocab["embed"]].nbytes // cfg.vocab_size
    assert embed_only.stats.bytes_read == len(torch.unique(PROMPT)) * row  # 14 rows of 512, nothing else
    # one window at a time: the largest holds 8 of the 14 (ids below 96), in float32 beside their stored copy
    assert embed_only.stats.peak == 8 * (cfg.hidden_size * 4 + row)
    # decode: each lm_head chunk is read once for all 16 positions, not once per position
    reads, counted = [], CheckpointWeights(d, cfg)
    rows_state = counted.rows_state
    counted.rows_state = lambda kind, ids, span: (reads.append((kind, span)), rows_state(kind, ids, span))[1]
    with torch.no_grad():
        LayerMajor(build_skeleton(cfg), counted).run(PROMPT, step=1)
    assert [s for k, s in reads if k == "head"] == [(a, min(a + 96, 512)) for a in range(0, 512, 96)]


def test_tied_embeddings_stream_the_head_from_the_embedding(tmp_path, small_vocab_chunks):
    """tie_word_embeddings without lm_head.weight: the head reads the embedding's rows, chunk by chunk, and agrees bit
    for bit with the resident model, whose lm_head is the embedding."""
    from ktconvert.model.tiny import tiny_config

    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(tiny_config("qwen3_moe") | {"tie_word_embeddings": True}))
    tensors = {k: v for k, v in tiny_tensors("qwen3_moe").items() if k != "lm_head.weight"}
    (d / "model.safetensors").write_bytes(to_bytes(tensors, {"format": "pt"}))
    weights = _check(d)
    assert weights.vocab["head"] == weights.vocab["embed"] == "model.embed_tokens.weight"


@pytest.mark.parametrize("family,spec,fmt", [("qwen3_moe", "Q4_K_M", "gguf"), ("qwen3_moe", "Q8_0", "safetensors")])
def test_converted_vocabulary_rows_stay_bit_identical(tmp_path, small_vocab_chunks, family, spec, fmt):
    """A GGUF's quantized token_embd / output and kernel-order safetensors read by rows and chunks: bit-identical
    to the candidate inject loads whole."""
    _check_converted(tmp_path, family, spec, fmt)


def test_a_budget_smaller_than_the_model_holds(tmp_path):
    """Resident weights (float32, plus the stored copies being decoded) never pass the budget, which is far below
    the model's float32 size; a budget below one part's minimum is refused naming that minimum."""
    d = tmp_path / "m"
    write_tiny_model("deepseek_v3", d)
    cfg = load_config(d)
    skeleton = build_skeleton(cfg)
    model_bytes = sum(p.numel() * 4 for p in from_pretrained(d).parameters())
    need, where = CheckpointWeights(d, cfg).minimum(skeleton)
    assert need < model_bytes / 2
    pre, dec = _in_memory(d)
    least = max_memory_for(need)  # the weights get all but the budget's reserve
    spre, sdec, weights = _streamed(d, budget=least)
    _assert_identical(pre, spre, "prefill")
    _assert_identical(dec, sdec, "decode")
    assert 0 < weights.stats.peak <= need < least < model_bytes
    assert need <= weights.budget < need + 16
    with pytest.raises(UsageProblem) as exc:
        CheckpointWeights(d, cfg, budget=least - 1).check_budget(skeleton)
    assert f"{where}" in exc.value.message and "below" in exc.value.message
    assert f"the minimum {format_size(least)} ({least} bytes)" in exc.value.message


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_prefill_and_decode_in_one_pass_are_the_separate_runs(tmp_path, family):
    """run_many (golden --engine stream: prefill and its decode self-check over one read of the checkpoint) gives
    what two separate runs give, bit for bit, and reads less than they do together."""
    d = tmp_path / "m"
    write_tiny_model(family, d)
    pre, dec, alone = _streamed(d)
    cfg = load_config(d)
    weights = CheckpointWeights(d, cfg, budget=alone.stats.peak)
    weights.reuse = True  # as golden --engine stream runs it: dropped parts' memory handed to the next parts
    with torch.no_grad():
        got = LayerMajor(build_skeleton(cfg), weights).run_many(PROMPT, [None, 1])
    _assert_identical(pre, (got[0].logits, list(got[0].hidden_states), got[0].final_hidden), "prefill")
    _assert_identical(dec, (got[1].logits, list(got[1].hidden_states), got[1].final_hidden), "decode")
    assert weights.stats.bytes_read < alone.stats.bytes_read and weights.stats.resident == 0
    assert weights._pooled > 0 and weights.stats.peak <= alone.stats.peak  # memory was kept, within the budget


def test_an_fp8_release_decodes_within_the_budget(tmp_path):
    """An FP8 block release (DeepSeek-V3, MLA) decodes each weight to float32, 4x its stored bytes: the minimum counts
    that decoding beside the part's float32 weights, and a run at exactly that minimum stays inside it, bit-identical
    to the in-memory run. Before, a part's every tensor was decoded at once beside its float32 slots while the
    minimum counted the FP8 bytes: this run went 1.5 MB (59%) over, the DeepSeek-V3-shaped benchmark held 4.35 GiB
    under --max-memory 4GiB."""
    from ktconvert.formats import open_checkpoint, quantized

    d = tmp_path / "m"
    write_tiny_model("deepseek_v3", d, fp8=True)
    cfg = load_config(d)
    skeleton = build_skeleton(cfg)
    qmap = quantized.analyze(open_checkpoint(d))
    # independently of the executor: layer 0's (dense) float32 weights and its largest FP8 weight's float32 decoding
    mine = [w for n, w in qmap.weights.items() if n.startswith("model.layers.0.")]
    assert mine and all(w.fmt == "FP8" for w in mine)
    floor = 4 * sum(p.numel() for p in skeleton.model.layers[0].parameters()) + max(4 * int(np.prod(w.shape)) for w in mine)
    need, _ = CheckpointWeights(d, cfg).minimum(skeleton)
    assert need >= floor
    pre, dec = _in_memory(d)
    spre, sdec, weights = _streamed(d, budget=max_memory_for(need))
    _assert_identical(pre, spre, "prefill")
    _assert_identical(dec, sdec, "decode")
    assert 0 < weights.stats.peak <= need
    assert weights.stats.resident == 0


_RSS_CHILD = r"""
import json, sys
import torch
from ktconvert.golden.stream import compute_stream_golden
from ktconvert.model import load_config
from ktconvert.model.executor import CheckpointWeights
from ktconvert.model.reference import build_skeleton
model_dir, budget, run = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "run"
cfg = load_config(model_dir)
CheckpointWeights(model_dir, cfg, budget=budget).check_budget(build_skeleton(cfg))
if run:
    compute_stream_golden(model_dir, list(range(1, 17)), max_memory=budget)
# VmHWM: this process's own peak (ru_maxrss would carry the parent's peak across fork and exec)
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"maxrss": hwm * 1024}))
"""


@pytest.mark.slow
def test_peak_rss_of_a_streamed_golden_stays_near_its_budget(tmp_path):
    """A child process makes a streamed golden of a 400 MB (float32) qwen3_moe-shaped checkpoint within 16 MiB: its
    peak RSS (VmHWM) over a child that only imports, opens and checks the same checkpoint stays within the budget
    plus a fixed 32 MiB for activations and the allocator, far below the model (an executor holding every layer
    fails; so did glibc's heap keeping freed parts, 146 MiB, before ktconvert.io.heap.return_freed_memory). Measured: 26 MiB."""
    import subprocess
    import sys

    from verify_helpers import write_random_bf16_model

    d = tmp_path / "m"
    model_f32 = write_random_bf16_model(d, {"num_local_experts": 64, "num_hidden_layers": 4,
                                            "moe_intermediate_size": 512})
    assert model_f32 > 380 * 2**20
    budget = 16 * 2**20

    def child(mode):
        out = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(d), str(budget), mode], capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])["maxrss"]

    base, peak = child("open"), child("run")
    assert peak - base <= budget + 32 * 2**20, f"streamed run grew RSS by {(peak - base) / 2**20:.0f} MiB"


@pytest.mark.parametrize("step", [None, 1], ids=["prefill", "decode"])
def test_run_pair_teacher_forcing_names_the_faulty_layer(tmp_path, step):
    """Reference (the release, streamed) and candidate (a Q8_0 GGUF whose layer 1 has gate and up swapped, streamed)
    in lockstep: outputs bit-identical to separate runs; free-running error stays high after the fault, while the
    error each layer adds on the reference's input (teacher-forced) is high at layer 1 only."""
    from verify_helpers import write_gguf

    from ktconvert.model.executor import ConvertedWeights, run_pair
    from ktconvert.model.ops.source import WeightSource

    d = tmp_path / "m"
    write_tiny_model("deepseek_v3", d)  # layer 0 dense, layers 1 and 2 MoE
    cfg = load_config(d)
    broken = write_gguf(d, tmp_path / "broken.gguf", "Q8_0", faults=[("gate-up-swapped", 1)])
    ref = LayerMajor(build_skeleton(cfg), CheckpointWeights(d, cfg))
    cand = LayerMajor(build_skeleton(cfg), ConvertedWeights(WeightSource(broken, cfg), cfg))
    with torch.no_grad():
        pair = run_pair(ref, cand, PROMPT, step=step)
        alone_ref, alone_cand = ref.run(PROMPT, step=step), cand.run(PROMPT, step=step)
    assert torch.equal(pair.reference.logits, alone_ref.logits) and torch.equal(pair.candidate.logits, alone_cand.logits)
    assert all(torch.equal(a, b) for a, b in zip(pair.candidate.hidden_states, alone_cand.hidden_states))

    def nmse(a, b):
        return float(((a - b) ** 2).sum() / (b ** 2).sum())

    ref_h = pair.reference.hidden_states  # [embed, layer 0, layer 1, layer 2]
    free = [nmse(c, r) for c, r in zip(pair.candidate.hidden_states, ref_h)]
    forced = [nmse(f, r) for f, r in zip(pair.forced, ref_h)]
    assert forced[2] > 1e-2 and max(forced[1], forced[3]) < 1e-3  # only layer 1 adds error
    assert free[3] > 1e-2  # free-running, the fault's error carries into layer 2


#: real shapes (the layer count cut: every layer of a kind needs the same)
QWEN3_30B_A3B = dict(hidden_size=2048, vocab_size=151936, num_experts=128, moe_intermediate_size=768,
                     num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     num_hidden_layers=2, intermediate_size=6144)
DEEPSEEK_V3 = dict(hidden_size=7168, vocab_size=129280, n_routed_experts=256, moe_intermediate_size=2048,
                   num_experts_per_tok=8, num_attention_heads=128, num_key_value_heads=128, num_hidden_layers=3,
                   first_k_dense_replace=1, intermediate_size=18432, q_lora_rank=1536, kv_lora_rank=512,
                   qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_group=8, topk_group=4,
                   n_shared_experts=1)


def write_sparse_checkpoint(d, config: dict):
    """A BF16 safetensors checkpoint of ``config``'s real shapes whose data is a hole (a sparse file: only the header
    takes disk), for what reads headers only (the budget's minimum)."""
    import struct

    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(config))
    cfg = load_config(d)
    header, off = {}, 0
    for name, t in build_skeleton(cfg).state_dict().items():
        if not name.endswith("rotary_emb.inv_freq"):
            header[name] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [off, off + 2 * t.numel()]}
            off += 2 * t.numel()
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(d / "model.safetensors", "wb") as fh:
        fh.write(struct.pack("<Q", len(head)) + head)
        fh.truncate(8 + len(head) + off)
    return cfg


@pytest.mark.parametrize("family,shape,fits,refused", [("qwen3_moe", QWEN3_30B_A3B, 2**30, 64 * 2**20),
                                                      ("deepseek_v3", DEEPSEEK_V3, 4 * 2**30, 2**30)],
                         ids=["qwen3-30b-a3b", "deepseek-v3"])
def test_real_shaped_models_fit_small_budgets(tmp_path, family, shape, fits, refused):
    """Qwen3-30B-A3B's shapes (vocabulary 151936 x 2048: 1.2 GB in float32, read by rows and chunks) fit 1 GiB;
    DeepSeek-V3's (MLA, and layer 0's dense MLP of 18432: 1.6 GB in float32) fit 4 GiB, and 1 GiB is refused naming
    layer 0 and its MLP."""
    from ktconvert.model.tiny import tiny_config

    d = tmp_path / "m"
    cfg = write_sparse_checkpoint(d, tiny_config(family) | shape)
    skeleton = build_skeleton(cfg)
    need, where = CheckpointWeights(d, cfg).minimum(skeleton)
    assert need <= fits
    CheckpointWeights(d, cfg, budget=fits).check_budget(skeleton)
    with pytest.raises(UsageProblem) as exc:
        CheckpointWeights(d, cfg, budget=refused).check_budget(skeleton)
    least = max_memory_for(need)
    assert f"the minimum {format_size(least)} ({least} bytes)" in exc.value.message and where in exc.value.message
    if family == "deepseek_v3":
        assert where.startswith("layer 0 (largest module model.layers.0.mlp: 1.48 GiB)")
