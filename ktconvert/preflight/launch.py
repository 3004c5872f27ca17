"""The kt-kernel part of an SGLang launch, from flags or a pasted command line.

Flags of sglang-kt 0.7.2 (``server_args.py``) and the seed-era MoE-LoRA flags of the development branch users
also ran (``--kt-moe-lora-*``, ``--kt-moe-sft-method``), which 0.7.2 does not have.
"""

from __future__ import annotations

import difflib
import shlex
from dataclasses import dataclass, field

# flag -> Launch attribute
FLAGS_072 = {
    "--model-path": "model_path", "--model": "model_path",
    "--kt-weight-path": "weight_path", "--kt-method": "method", "--kt-cpuinfer": "cpuinfer",
    "--kt-threadpool-count": "threadpools", "--kt-numa-nodes": "numa_nodes",
    "--kt-num-gpu-experts": "gpu_experts", "--kt-gpu-experts-ratio": "gpu_ratio",
    "--kt-expert-lora-path": "expert_lora_path", "--kt-lora-path": "kt_lora_path", "--lora-paths": "lora_paths",
    "--max-running-requests": "max_running_requests",
    "--kt-max-deferred-experts-per-token": None, "--kt-gpu-prefill-token-threshold": None,
    "--kt-enable-dynamic-expert-update": None, "--kt-expert-placement-strategy": None,
}
SEED_FLAGS = {
    "--kt-moe-lora-path": "moe_lora_path", "--kt-moe-lora-rank": "moe_lora_rank",
    "--kt-moe-lora-alpha": "moe_lora_alpha", "--kt-moe-sft-method": "moe_sft_method",
}
MULTI = {"numa_nodes", "lora_paths"}  # nargs="*" in server_args
BOOLEAN = {"--kt-enable-dynamic-expert-update"}
SGLANG_THREADPOOLS_DEFAULT = 2
SGLANG_METHOD_DEFAULT = "AMXINT4"


@dataclass
class Launch:
    model_path: str | None = None
    weight_path: str | None = None
    method: str | None = None
    cpuinfer: str | None = None
    threadpools: str | None = None
    numa_nodes: list[str] | None = None
    gpu_experts: str | None = None
    gpu_ratio: str | None = None
    expert_lora_path: str | None = None
    kt_lora_path: str | None = None
    lora_paths: list[str] | None = None
    max_running_requests: str | None = None
    moe_lora_path: str | None = None
    moe_lora_rank: str | None = None
    moe_lora_alpha: str | None = None
    moe_sft_method: str | None = None
    seed_flags: list[str] = field(default_factory=list)
    unknown_flags: list[str] = field(default_factory=list)
    abbreviated: list[str] = field(default_factory=list)  # "--kt-num-gpu-expert=--kt-num-gpu-experts"
    pasted: bool = False

    def merged(self, other: "Launch") -> "Launch":
        """``self`` with every attribute ``other`` sets (explicit flags over the pasted command)."""
        out = Launch(**{k: v for k, v in vars(self).items()})
        for k, v in vars(other).items():
            if k in ("seed_flags", "unknown_flags", "abbreviated"):
                setattr(out, k, sorted(set(getattr(out, k)) | set(v)))
            elif k == "pasted":
                out.pasted = out.pasted or v
            elif v is not None:
                setattr(out, k, v)
        return out


def parse_command(argv: list[str] | str) -> Launch:
    """The kt flags of a pasted launch command (``python -m sglang.launch_server ...``); other flags are kept
    out, unknown ``--kt-*`` flags are listed."""
    tokens = shlex.split(argv) if isinstance(argv, str) else list(argv)
    launch = Launch(pasted=True)
    known = {**FLAGS_072, **SEED_FLAGS}
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        i += 1
        if not tok.startswith("--"):
            continue
        flag, eq, value = tok.partition("=")
        if flag not in known:  # argparse takes a unique prefix of a flag as that flag
            full = [k for k in known if k.startswith(flag)]
            if len(full) == 1 and flag.startswith("--kt-"):
                launch.abbreviated.append(f"{flag}={full[0]}")
                flag = full[0]
        attr = known.get(flag)
        if flag in SEED_FLAGS:
            launch.seed_flags.append(flag)
        elif flag not in known and flag.startswith("--kt-"):
            launch.unknown_flags.append(flag)
        if flag in BOOLEAN:
            continue
        values: list[str] = [value] if eq else []
        if not eq:
            while i < len(tokens) and not tokens[i].startswith("--"):
                values.append(tokens[i])
                i += 1
                if attr not in MULTI:
                    break
        if attr is None:
            continue
        setattr(launch, attr, values if attr in MULTI else (values[0] if values else ""))
    return launch


def nearest_flag(flag: str) -> str | None:
    hits = difflib.get_close_matches(flag, [*FLAGS_072, *SEED_FLAGS], n=1, cutoff=0.6)
    return hits[0] if hits else None
