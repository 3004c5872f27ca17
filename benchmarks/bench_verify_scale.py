"""``verify`` and ``golden --engine stream`` at real size within a memory budget: wall time against the cold read
of the files each step reads, peak RSS of the whole process tree against the budget plus the fixed overhead, and
a planted fault named at its layer and expert.

Two synthetic checkpoints are written to disk (bench_convert.py's writer: sharded safetensors, per-expert
tensors, values cut from a random block) and removed afterwards, one at a time:

* **Qwen3-30B-A3B-shaped, BF16**: H 2048, 128 experts of I 768, top-8, 32/4 heads of 128, vocabulary 151936, as
  many layers as it takes to pass 8 GiB. Steps: ``golden --engine stream``; ``quantize`` to a Q8_0 GGUF, a
  Q4_K_M GGUF and an AMXINT8 kt-amx directory; ``verify --max-memory 1GiB`` of each (the kt-amx one through the
  real kernel: ``--kernel kt-kernel --kt-weights DIR``).
* **DeepSeek-V3-shaped FP8 release**: MLA (q_lora 1536, kv_lora 512, rope 64, nope 128, v 128, 128 heads), H 7168,
  vocabulary 129280, one dense layer (I 18432) and two MoE layers of 256 experts of I 2048 (top-8, 8 groups,
  4 picked, sigmoid router with its correction bias) plus the shared expert, every linear weight but the router
  F8_E4M3 with an F32 ``weight_scale_inv`` per 128x128 block, as DeepSeek ships it. Steps: ``golden --engine
  stream``, ``quantize --to kt-amx --type AMXINT4``, ``verify`` of it through the real kernel within
  ``--max-memory 4GiB``.

Weights are normal with std 0.02 (FP8: codes of normal values times 64, scale_inv about 0.02/64), norms are ones,
so hidden states stay at unit scale and routing depends on the token. **Planted fault**: after the clean verify
of the Q8_0 GGUF (Qwen) and of the AMXINT4 directory (DeepSeek), the bytes of one expert's gate and up projections
in one layer are swapped in place in the candidate, and verify runs again; the benchmark checks that the report
names that layer (teacher-forced, or as the layer of the expert that stands out from its layer's experts) and
says which expert. So that the prompt's tokens pick the
planted expert, the checkpoint gives it a reason to: Qwen's router row of that expert in that layer is 6x the
others' scale (picked by about 40% of the tokens), DeepSeek's correction bias of that expert is 1.0 (picked
by every token; the bias selects, it does not weight).

Every step is a fresh ``python -m ktconvert ...`` process, page cache dropped first (we run as root). Peak RSS is
sampled from /proc every 20 ms over the whole process tree (verify plus the kernel child), by this process. The
fixed overhead is the peak of the same step on a tiny model of the same family (the same code path, every
dimension small): interpreter, numpy, torch, the kernel child's kt_kernel import. The verdict per step is
``peak <= budget + overhead``. The cold read time of the files a step reads (golden: the source; verify: the
source and the candidate) is measured in the same run: page cache dropped, each file read with 16 MiB reads.
Beside the wall time, the step's CPU seconds (user + system, the kernel child's included): on a shared machine
the wall time also waits for other processes, the CPU time does not. The load average is printed at the end.

    python benchmarks/bench_verify_scale.py [--workdir DIR] [--layers N] [--skip-qwen] [--skip-deepseek]
                                            [--json FILE] [--tiny] [--no-drop-caches]

``--layers`` (Qwen) and ``--vocab`` make a smaller run for debugging; ``--tiny`` shrinks every dimension (the
test suite runs the whole code path that way in seconds).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_convert import (BLOCK, _cpu_model, _drop_caches, _nbytes, default_raws, measure,  # noqa: E402
                           write_checkpoint)

REPO = Path(__file__).resolve().parents[1]
QWEN = {"H": 2048, "I": 768, "E": 128, "K": 8, "heads": 32, "kv": 4, "hd": 128, "vocab": 151936}
QWEN_TINY = {"H": 256, "I": 256, "E": 16, "K": 4, "heads": 4, "kv": 2, "hd": 64, "vocab": 1024}
DEEPSEEK = {"H": 7168, "I": 2048, "dense_I": 18432, "E": 256, "K": 8, "heads": 128, "q_lora": 1536, "kv_lora": 512,
            "rope": 64, "nope": 128, "v": 128, "vocab": 129280, "groups": 8, "topk_groups": 4, "moe_layers": 2}
DEEPSEEK_TINY = {"H": 256, "I": 256, "dense_I": 256, "E": 16, "K": 4, "heads": 4, "q_lora": 128, "kv_lora": 64,
                 "rope": 16, "nope": 32, "v": 32, "vocab": 1024, "groups": 4, "topk_groups": 2, "moe_layers": 2}
FP8_BLOCK = 128
PROMPT_LEN = 12
ROUTER_STD = 0.08  # a router of some confidence: the top-k of a token is not decided by a rounding
QWEN_BUDGET, DEEPSEEK_BUDGET = "1GiB", "4GiB"
FAULT_EXPERT = {"qwen": 5, "deepseek": 17}


# ---------------------------------------------------------------------------------------------- the checkpoints
def _bf16(values: np.ndarray) -> bytes:
    """float32 -> BF16 bytes (round to nearest even)."""
    u = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2").tobytes()


def _raws(block: int) -> dict[str, np.ndarray]:
    """bench_convert's blocks of ``block`` bytes, with E4M3 codes of normal values (std 64, so scale_inv ~0.02/64
    gives std 0.02) and block scales around 0.02/64."""
    import torch

    raws = default_raws(block)
    # one BF16 value short of whole rows: a tensor longer than the block (the 151936-row embedding and lm_head) cycles
    # through it shifted by one value each time, so no two vocabulary rows are equal. With a block of whole rows, rows
    # 16384 apart were the same: every golden logit came 9-10 times, each position's top-2 an exact tie, and top-1
    # agreement was never judged at full size
    raws["BF16"] = raws["BF16"][:-2]
    g = torch.Generator().manual_seed(1)
    n = len(raws["F8_E4M3"])
    raws["F8_E4M3"] = (torch.randn(n, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn) \
        .view(torch.uint8).numpy()
    rng = np.random.default_rng(2)
    raws["F32"] = (rng.uniform(0.9, 1.1, 1 << 20).astype(np.float32) * (0.02 / 64)).view(np.uint8)
    return raws


def _router(rows: int, cols: int, boost: int | None, seed: int) -> bytes:
    w = np.random.default_rng(seed).standard_normal((rows, cols), dtype=np.float32) * ROUTER_STD
    if boost is not None:
        w[boost] *= 6.0
    return _bf16(w)


def qwen_model(d: dict, layers: int, fault_layer: int) -> tuple[dict, list, dict]:
    """(config.json, stored tensors, exact bytes of the norms and routers) of a Qwen3-MoE checkpoint."""
    H, I, E, heads, kv, hd, vocab = d["H"], d["I"], d["E"], d["heads"], d["kv"], d["hd"], d["vocab"]
    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": H,
              "moe_intermediate_size": I, "intermediate_size": 3 * I, "num_experts": E, "num_experts_per_tok": d["K"],
              "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd,
              "vocab_size": vocab, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
              "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False,
              "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}
    ones = {H: _bf16(np.ones(H)), hd: _bf16(np.ones(hd))}
    stored, fill = [("model.embed_tokens.weight", "BF16", (vocab, H))], {}
    for L in range(layers):
        p = f"model.layers.{L}."
        for n, size in (("input_layernorm", H), ("post_attention_layernorm", H), ("self_attn.q_norm", hd),
                        ("self_attn.k_norm", hd)):
            stored.append((p + n + ".weight", "BF16", (size,)))
            fill[p + n + ".weight"] = ones[size]
        stored += [(p + "self_attn.q_proj.weight", "BF16", (heads * hd, H)),
                   (p + "self_attn.k_proj.weight", "BF16", (kv * hd, H)),
                   (p + "self_attn.v_proj.weight", "BF16", (kv * hd, H)),
                   (p + "self_attn.o_proj.weight", "BF16", (H, heads * hd)),
                   (p + "mlp.gate.weight", "BF16", (E, H))]
        fill[p + "mlp.gate.weight"] = _router(E, H, FAULT_EXPERT["qwen"] % E if L == fault_layer else None, L)
        for e in range(E):
            stored += [(p + f"mlp.experts.{e}.gate_proj.weight", "BF16", (I, H)),
                       (p + f"mlp.experts.{e}.up_proj.weight", "BF16", (I, H)),
                       (p + f"mlp.experts.{e}.down_proj.weight", "BF16", (H, I))]
    stored += [("model.norm.weight", "BF16", (H,)), ("lm_head.weight", "BF16", (vocab, H))]
    fill["model.norm.weight"] = ones[H]
    return config, stored, fill


def qwen_layers_for(d: dict, size_gib: float) -> int:
    layers = 1
    while sum(_nbytes(s, t) for _, t, s in qwen_model(d, layers, -1)[1]) < size_gib * (1 << 30):
        layers += 1
    return layers


def deepseek_model(d: dict, fault_layer: int) -> tuple[dict, list, dict]:
    """(config.json, stored tensors, exact bytes of norms, routers and biases) of a DeepSeek-V3 FP8 release:
    one dense layer, then ``moe_layers`` MoE layers."""
    H, I, E, heads, vocab = d["H"], d["I"], d["E"], d["heads"], d["vocab"]
    ql, kl, rope, nope, v = d["q_lora"], d["kv_lora"], d["rope"], d["nope"], d["v"]
    layers = 1 + d["moe_layers"]
    config = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": H,
              "intermediate_size": d["dense_I"], "moe_intermediate_size": I, "n_routed_experts": E,
              "n_shared_experts": 1, "num_experts_per_tok": d["K"], "n_group": d["groups"],
              "topk_group": d["topk_groups"], "topk_method": "noaux_tc", "scoring_func": "sigmoid",
              "norm_topk_prob": True, "routed_scaling_factor": 2.5, "first_k_dense_replace": 1, "moe_layer_freq": 1,
              "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": heads,
              "q_lora_rank": ql, "kv_lora_rank": kl, "qk_rope_head_dim": rope, "qk_nope_head_dim": nope,
              "v_head_dim": v, "vocab_size": vocab, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
              "rope_theta": 10000, "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1,
                                                    "mscale": 1.0, "mscale_all_dim": 1.0,
                                                    "original_max_position_embeddings": 4096},
              "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
              "num_nextn_predict_layers": 0, "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1,
              "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                      "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}}
    stored, fill = [("model.embed_tokens.weight", "BF16", (vocab, H))], {}

    def fp8(name, shape):
        stored.extend([(name, "F8_E4M3", shape), (name + "_scale_inv", "F32",
                                                  (math.ceil(shape[0] / FP8_BLOCK), math.ceil(shape[1] / FP8_BLOCK)))])

    def norm(name, size):
        stored.append((name, "BF16", (size,)))
        fill[name] = _bf16(np.ones(size))

    for L in range(layers):
        p = f"model.layers.{L}."
        norm(p + "input_layernorm.weight", H)
        norm(p + "post_attention_layernorm.weight", H)
        fp8(p + "self_attn.q_a_proj.weight", (ql, H))
        norm(p + "self_attn.q_a_layernorm.weight", ql)
        fp8(p + "self_attn.q_b_proj.weight", (heads * (nope + rope), ql))
        fp8(p + "self_attn.kv_a_proj_with_mqa.weight", (kl + rope, H))
        norm(p + "self_attn.kv_a_layernorm.weight", kl)
        fp8(p + "self_attn.kv_b_proj.weight", (heads * (nope + v), kl))
        fp8(p + "self_attn.o_proj.weight", (H, heads * v))
        if L == 0:
            for n, shape in (("gate", (d["dense_I"], H)), ("up", (d["dense_I"], H)), ("down", (H, d["dense_I"]))):
                fp8(p + f"mlp.{n}_proj.weight", shape)
            continue
        stored += [(p + "mlp.gate.weight", "BF16", (E, H)), (p + "mlp.gate.e_score_correction_bias", "F32", (E,))]
        fill[p + "mlp.gate.weight"] = _router(E, H, None, L)
        bias = np.zeros(E, np.float32)
        if L == fault_layer:
            bias[FAULT_EXPERT["deepseek"] % E] = 1.0
        fill[p + "mlp.gate.e_score_correction_bias"] = bias.tobytes()
        for n, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            fp8(p + f"mlp.shared_experts.{n}_proj.weight", shape)
        for e in range(E):
            for n, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
                fp8(p + f"mlp.experts.{e}.{n}_proj.weight", shape)
    norm("model.norm.weight", H)
    stored.append(("lm_head.weight", "BF16", (vocab, H)))
    return config, stored, fill


def stored_bytes(stored: list) -> int:
    return sum(_nbytes(s, t) for _, t, s in stored)


# ---------------------------------------------------------------------------------------------- measuring
def _files(path: Path) -> list[Path]:
    return sorted(p for p in ([path] if path.is_file() else path.rglob("*")) if p.is_file())


def cold_read(paths: list[Path], drop: bool) -> dict:
    """Seconds to read every file under ``paths`` with 16 MiB reads, page cache dropped first (``drop``)."""
    dropped = _drop_caches() if drop else False
    total, t0 = 0, time.monotonic()
    buf = bytearray(16 << 20)
    for p in paths:
        for f in _files(p):
            with open(f, "rb", buffering=0) as fh:
                os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
                while n := fh.readinto(buf):
                    total += n
    s = time.monotonic() - t0
    return {"seconds": round(s, 1), "bytes": total, "mb_per_s": round(total / max(s, 1e-9) / 1e6), "dropped": dropped}


def _cli(*args) -> list[str]:
    return [sys.executable, "-m", "ktconvert", *map(str, args)]


def step(name: str, cmd: list[str], drop: bool, ok=(0,), reads: float | None = None) -> dict:
    """One ktconvert process: wall, peak RSS of its tree, its JSON stdout (when there is one), failure text."""
    out = {"step": name, "command": " ".join(["ktconvert", *cmd[3:]])}
    try:
        m = measure(cmd, drop=drop, ok=ok)
    except SystemExit as exc:  # a failed step is a figure too: record it and go on
        out.update(failed=str(exc)[-600:])
        print(json.dumps(out), flush=True)
        return out
    out.update(wall_s=m["wall_s"], cpu_s=m["cpu_s"], peak_rss_tree_mib=m["peak_rss_mib"], exit_code=m["code"],
               page_cache_dropped=m["page_cache_dropped"])
    if reads:
        out["cold_read_s"] = reads
        out["ratio"] = round(m["wall"] / max(reads, 1e-9), 2)
    try:
        out["report"] = json.loads(m["stdout"])
    except ValueError:
        out["stdout_tail"] = m["stdout"][-400:]
    print(json.dumps({k: v for k, v in out.items() if k != "report"}), flush=True)
    return out


def _verify_figures(rep: dict) -> dict:
    """The figures the table shows, from a verify report."""
    run = rep.get("run", {})
    out = {"verdict": rep.get("verdict"), "passed": rep.get("verdict") == "pass", "run": run,
           "breaches": [b if isinstance(b, str) else b.get("message", b) for b in rep.get("breaches", [])][:6],
           "kernel": rep.get("kernel")}
    phases = rep.get("phases", {})
    out["localization"] = {ph: v.get("localization") for ph, v in phases.items() if isinstance(v, dict)}
    out["forced"] = {ph: v.get("forced") for ph, v in phases.items() if isinstance(v, dict)}
    return out


def swap_gate_up(candidate: Path, layer: int, expert: int) -> list[str]:
    """Swap, in place, the bytes of ``expert``'s gate and up projections in ``layer`` of a GGUF (slices of the
    merged ``ffn_{gate,up}_exps``) or a kt-amx directory (every numa part's weight and scale). Returns the tensors
    touched."""
    from ktconvert.formats import open_checkpoint

    ck = open_checkpoint(candidate)
    pairs = []
    if candidate.suffix == ".gguf":
        g, u = ck[f"blk.{layer}.ffn_gate_exps.weight"], ck[f"blk.{layer}.ffn_up_exps.weight"]
        assert g.nbytes == u.nbytes and g.shape[0] == u.shape[0]
        per = g.nbytes // g.shape[0]
        pairs.append((g.file, g.offset + expert * per, u.file, u.offset + expert * per, per, g.name, u.name))
    else:
        prefix = f"blk.{layer}.ffn_gate_exps.{expert}."
        for name in sorted(n for n in ck if n.startswith(prefix)):
            g, u = ck[name], ck[name.replace("ffn_gate_exps", "ffn_up_exps")]
            assert g.nbytes == u.nbytes
            pairs.append((g.file, g.offset, u.file, u.offset, g.nbytes, g.name, u.name))
    if not pairs:
        raise SystemExit(f"{candidate}: no gate/up tensors of expert {expert} in layer {layer}")
    for fa, oa, fb, ob, n, *_ in pairs:
        with open(fa, "r+b") as ha, open(fb, "r+b") as hb:
            ha.seek(oa)
            a = ha.read(n)
            hb.seek(ob)
            b = hb.read(n)
            ha.seek(oa)
            ha.write(b)
            hb.seek(ob)
            hb.write(a)
    return [x for p in pairs for x in p[5:]]


def fault_named(rep: dict, layer: int, expert: int) -> dict:
    """Whether the report names the planted layer and expert in every phase. The layer: the teacher-forced layer
    (the first that alone adds more than the limit), or the layer of the expert that stands out from its layer's
    experts (``localization.outlier``); the expert: that outlier, or the localised layer's worst expert. On random
    weights a 4-bit candidate's own error can break the limits first at a later layer, where the outlier still
    names the broken expert and its layer."""
    phases = {ph: v.get("localization") or {} for ph, v in rep.get("phases", {}).items() if isinstance(v, dict)}
    want = f"layer {layer}"
    outliers = {ph: loc.get("outlier") or {} for ph, loc in phases.items()}
    layer_ok = bool(phases) and all(loc.get("forced_layer") == want or outliers[ph].get("layer") == want
                                    for ph, loc in phases.items())
    text = json.dumps(phases)
    experts = [outliers[ph].get("expert") if outliers[ph].get("layer") == want else loc.get("expert")
               for ph, loc in phases.items()]
    expert_ok = bool(phases) and all(e == expert for e in experts)
    return {"layer_named": layer_ok, "expert_named": expert_ok, "experts_reported": experts,
            "localization": phases, "mentions_expert": f"expert {expert}" in text}


# ---------------------------------------------------------------------------------------------- the runs
def _prompt(vocab: int, n: int) -> str:
    return ",".join(str(3 + (i * 7919) % (vocab - 3)) for i in range(n))


def run_family(kind: str, root: Path, d: dict, layers: int, budget: str, drop: bool, candidates: list[tuple],
               fault: tuple[str, int, int], threads: int, prompt_len: int = PROMPT_LEN, save=lambda: None,
               res: dict | None = None) -> dict:
    """Write the checkpoint, golden it, convert and verify every candidate, plant the fault, clean up.

    ``candidates``: ``(label, quantize args, relative candidate path, verify args with {cand})``; ``fault``:
    ``(label of the candidate to break, layer, expert)``."""
    src, golden = root / f"{kind}-src", root / f"{kind}-golden"
    if kind == "qwen":
        config, stored, fill = qwen_model(d, layers, fault[1])
        rules = REPO / "rules" / "optimize" / "qwen3_moe.yaml"
    else:
        config, stored, fill = deepseek_model(d, fault[1])
        rules = REPO / "rules" / "optimize" / "deepseek_v3.yaml"
    need = stored_bytes(stored)
    free = shutil.disk_usage(root).free
    res = res if res is not None else {}
    res.update({"model": kind, "layers": config["num_hidden_layers"], "dims": d, "budget": budget, "steps": [],
                "prompt_tokens": prompt_len})
    want = int(need * (1.6 if kind == "qwen" else 1.45)) + (1 << 30)  # the source, its largest conversion, slack
    if free < want:
        res["skipped"] = f"{free / 2**30:.1f} GiB free on {root}, the checkpoint and its conversion need about " \
                         f"{want / 2**30:.1f} GiB"
        print(json.dumps(res), flush=True)
        return res
    t0 = time.monotonic()
    block = BLOCK if need > (1 << 30) else 1 << 20  # a small model's values need no 64 MiB of random numbers
    written = write_checkpoint(src, 0, config=config, stored=stored, raws=_raws(block), fill=fill)
    res["checkpoint"] = {"bytes": written, "gib": round(written / 2**30, 2), "write_s": round(time.monotonic() - t0, 1)}
    print(json.dumps(res["checkpoint"]), flush=True)
    try:
        src_cold = cold_read([src], drop)
        res["source_cold_read"] = src_cold
        prompt = _prompt(d["vocab"], prompt_len)
        res["steps"].append(step("golden --engine stream", _cli(
            "golden", src, golden, "--engine", "stream", "--max-memory", budget, "--prompt-ids", prompt,
            "--threads", threads), drop, reads=src_cold["seconds"]))
        save()
        for label, qargs, rel, vargs in candidates:
            out = root / f"{kind}-{label}"
            q = step(f"quantize {label}", _cli("quantize", src, out, *qargs, "-o", "json"), drop)
            res["steps"].append(q)
            save()
            if "failed" in q:
                continue
            cand = out / rel if rel else out
            cold = cold_read([src, cand], drop)
            verify = _cli("verify", "--model", src, "--rules", rules, "--golden", golden, "--max-memory", budget,
                          "-o", "json", *[str(a).format(cand=cand) for a in vargs])
            v = step(f"verify {label}", verify, drop, ok=(0, 1), reads=cold["seconds"])
            v["cold_read"] = cold
            if "report" in v:
                v.update(_verify_figures(v.pop("report")))
            res["steps"].append(v)
            save()
            if label == fault[0]:
                touched = swap_gate_up(cand, fault[1], fault[2])
                f = step(f"verify {label}, expert {fault[2]} gate/up swapped in layer {fault[1]}", verify, drop,
                         ok=(0, 1), reads=cold["seconds"])
                if "report" in f:
                    rep = f.pop("report")
                    f.update(_verify_figures(rep))
                    f["fault"] = {"layer": fault[1], "expert": fault[2], "tensors": touched,
                                  **fault_named(rep, fault[1], fault[2])}
                res["steps"].append(f)
                save()
            shutil.rmtree(out, ignore_errors=True)
    finally:
        shutil.rmtree(src, ignore_errors=True)
        shutil.rmtree(golden, ignore_errors=True)
    return res


def qwen_candidates(budget: str, jobs: int) -> list[tuple]:
    common = ["--max-memory", budget, "--jobs", jobs]
    return [("Q8_0", ["--type", "Q8_0", *common], "model.gguf", ["--weights", "{cand}"]),
            ("AMXINT8", ["--to", "kt-amx", "--type", "AMXINT8", *common], "",
             ["--kernel", "kt-kernel", "--kt-weights", "{cand}"]),
            ("Q4_K_M", ["--recipe", "Q4_K_M", *common], "model.gguf", ["--weights", "{cand}"])]


def deepseek_candidates(budget: str, jobs: int) -> list[tuple]:
    return [("AMXINT4", ["--to", "kt-amx", "--type", "AMXINT4", "--max-memory", budget, "--jobs", jobs], "",
             ["--kernel", "kt-kernel", "--kt-weights", "{cand}"])]


def overhead(kind: str, root: Path, d_tiny: dict, budget: str, threads: int, prompt_len: int) -> dict:
    """The fixed overhead: the same steps on a tiny model of the family (no working set to speak of); peak RSS
    of the process tree per step."""
    cands = qwen_candidates(budget, 1) if kind == "qwen" else deepseek_candidates(budget, 1)
    (root / "overhead").mkdir(exist_ok=True)
    r = run_family(kind, root / "overhead", d_tiny, 2, budget, False, cands, ("", -1, 0), threads, prompt_len)
    return {s["step"]: s.get("peak_rss_tree_mib") for s in r["steps"]}


def table(results: dict) -> str:
    rows = ["| model | step | wall s | CPU s | cold read s | ratio | peak RSS tree MiB | overhead MiB | budget + overhead "
            "| within | finding |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for fam in results["models"]:
        over = fam.get("overhead", {})
        if "budget" not in fam:  # --overhead-only
            rows += [f"| {kind} (tiny) | {name} | | | | | {mib} | | | | overhead |" for kind in [fam.get("model", "")]
                     for name, mib in over.items()]
            continue
        budget_mib = _mib(fam["budget"])
        if fam.get("skipped"):
            rows.append(f"| {fam['model']} | skipped: {fam['skipped']} | | | | | | | | | |")
            continue
        for s in fam["steps"]:
            if "failed" in s:
                rows.append(f"| {fam['model']} | {s['step']} | failed: {s['failed'][-160:]} | | | | | | | | |")
                continue
            o = over.get(s["step"].split(",")[0])
            quantize = s["step"].startswith("quantize")
            limit = None if quantize or o is None else budget_mib + o
            within = "" if limit is None else ("yes" if s["peak_rss_tree_mib"] <= limit else "NO")
            finding = ""
            if "fault" in s:
                fz = s["fault"]
                finding = f"layer named: {fz['layer_named']}, expert named: {fz['expert_named']}"
            elif "passed" in s:
                finding = "passed" if s["passed"] else "failed"
            rows.append(f"| {fam['model']} | {s['step']} | {s['wall_s']} | {s.get('cpu_s', '')} | {s.get('cold_read_s', '')} | "
                        f"{s.get('ratio', '')} | {s['peak_rss_tree_mib']} | {'' if quantize else o} | "
                        f"{'' if limit is None else limit} | {within} | {finding} |")
    return "\n".join(rows)


def _mib(size: str) -> int:
    from ktconvert.io.sizes import parse_size

    return parse_size(size) >> 20


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=None, help="where to write the checkpoints (default: a temp dir)")
    ap.add_argument("--layers", type=int, default=0, help="Qwen layers (default: enough for --size-gib)")
    ap.add_argument("--size-gib", type=float, default=8.0, help="Qwen checkpoint size to reach (BF16)")
    ap.add_argument("--vocab", type=int, default=0, help="a smaller vocabulary for both models (debugging)")
    ap.add_argument("--prompt-len", type=int, default=PROMPT_LEN, help="prompt tokens of the golden")
    ap.add_argument("--moe-layers", type=int, default=0, help="DeepSeek's MoE layers (default 2)")
    ap.add_argument("--qwen-budget", default=QWEN_BUDGET, help="Qwen's --max-memory (default 1GiB)")
    ap.add_argument("--deepseek-budget", default=DEEPSEEK_BUDGET, help="DeepSeek's --max-memory (default 4GiB)")
    ap.add_argument("--skip-qwen", action="store_true")
    ap.add_argument("--skip-deepseek", action="store_true")
    ap.add_argument("--skip-overhead", action="store_true", help="do not run the tiny models for the overhead")
    ap.add_argument("--overhead-only", action="store_true", help="only the tiny models' runs (the overhead)")
    ap.add_argument("--tiny", action="store_true", help="every dimension small: the code path in seconds")
    ap.add_argument("--no-drop-caches", action="store_true", help="leave the page cache alone (cold reads are warm)")
    ap.add_argument("--jobs", type=int, default=2, help="quantize --jobs")
    ap.add_argument("--threads", type=int, default=1, help="golden --threads (verify takes the golden's)")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here as JSON (after every step)")
    args = ap.parse_args(argv)
    drop = not args.no_drop_caches
    qwen, ds = (QWEN_TINY, DEEPSEEK_TINY) if args.tiny else (QWEN, DEEPSEEK)
    if args.vocab:
        qwen, ds = {**qwen, "vocab": args.vocab}, {**ds, "vocab": args.vocab}
    if args.moe_layers:
        ds = {**ds, "moe_layers": args.moe_layers}
    base = Path(tempfile.mkdtemp(prefix="bench-verify-scale-", dir=args.workdir))
    results: dict = {"machine": {"cpu": _cpu_model(), "cpus": os.cpu_count(), "python": sys.version.split()[0]},
                     "argv": sys.argv[1:] if argv is None else list(argv),
                     "load_average_start": [round(x, 2) for x in os.getloadavg()], "models": []}

    def save():
        results["load_average_now"] = [round(x, 2) for x in os.getloadavg()]
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))

    plan = []
    if not args.skip_qwen:
        layers = max(args.layers or qwen_layers_for(qwen, args.size_gib if not args.tiny else 0.001), 2)
        plan.append(("qwen", qwen, QWEN_TINY, layers, args.qwen_budget, qwen_candidates,
                     ("Q8_0", layers // 2, FAULT_EXPERT["qwen"] % qwen["E"])))
    if not args.skip_deepseek:
        plan.append(("deepseek", ds, DEEPSEEK_TINY, 1 + ds["moe_layers"], args.deepseek_budget, deepseek_candidates,
                     ("AMXINT4", 1, FAULT_EXPERT["deepseek"] % ds["E"])))
    try:
        for kind, d, tiny, layers, budget, cands, fault in plan:
            fam: dict = {"model": kind}
            results["models"].append(fam)
            if not args.skip_overhead:  # first: a short run, so a long one cut short still has it
                fam["overhead"] = overhead(kind, base, tiny, budget, args.threads, args.prompt_len)
                save()
            if not args.overhead_only:
                run_family(kind, base, d, layers, budget, drop, cands(budget, args.jobs), fault, args.threads,
                           args.prompt_len, save, fam)
            save()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    results["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    save()
    print(table(results))
    print(f"load average (1, 5, 15 min): start {results['load_average_start']}, end {results['load_average_end']} "
          f"on {results['machine']['cpus']} CPUs ({results['machine']['cpu']})")
    return results


if __name__ == "__main__":
    main()
