"""The gated DeltaNet reference (Qwen3-Next's linear attention) against transformers 5.23's own layer on the CPU
(its torch fallback: chunked prefill), and its token-by-token decode against its own prefill."""

from __future__ import annotations

import pytest
import torch

from ktconvert.model.linear_attention import GatedDeltaNet

DIMS = dict(hidden=64, k_heads=2, v_heads=4, k_dim=16, v_dim=8, conv_kernel=4, eps=1e-6)


def _hf_layer():
    transformers = pytest.importorskip("transformers")
    if not transformers.__version__.startswith("5.23."):
        pytest.skip(f"compared with transformers 5.23, found {transformers.__version__}")
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    cfg = transformers.Qwen3NextConfig(
        hidden_size=DIMS["hidden"], linear_num_key_heads=DIMS["k_heads"], linear_num_value_heads=DIMS["v_heads"],
        linear_key_head_dim=DIMS["k_dim"], linear_value_head_dim=DIMS["v_dim"], linear_conv_kernel_dim=DIMS["conv_kernel"],
        num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], rms_norm_eps=DIMS["eps"])
    torch.manual_seed(0)
    layer = m.Qwen3NextGatedDeltaNet(cfg, 0).eval()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "proj" in name or "conv" in name else 0.5) + (1.0 if name == "norm.weight" else 0.0))
    return layer


@pytest.fixture(scope="module")
def layers():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    hf = _hf_layer()
    ours = GatedDeltaNet(**DIMS).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    yield hf, ours
    torch.set_num_threads(previous)


def test_prefill_matches_transformers_over_several_chunks(layers):
    hf, ours = layers
    x = torch.randn(2, 70, DIMS["hidden"])  # transformers' fallback works in chunks of 64: two of them here
    with torch.no_grad():
        want, got = hf(x), ours(x)
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-5
    with torch.no_grad():  # the delta rule matters: a plain decaying sum (beta = 0) is far off
        saved = ours.in_proj_ba.weight.clone()
        ours.in_proj_ba.weight[: DIMS["v_heads"]] = 0.0
        assert float((ours(x) - want).abs().max()) > 1e-2
        ours.in_proj_ba.weight.copy_(saved)


def test_decode_with_state_equals_prefill(layers):
    _, ours = layers
    x = torch.randn(1, 12, DIMS["hidden"])
    with torch.no_grad():
        whole = ours(x)
        state: dict = {}
        steps = [ours(x[:, :5], state)] + [ours(x[:, t: t + 1], state) for t in range(5, 12)]
    assert float((torch.cat(steps, dim=1) - whole).abs().max() / whole.abs().max()) <= 1e-5
    with torch.no_grad():  # without the state a token sees nothing before it
        assert float((ours(x[:, -1:]) - whole[:, -1:]).abs().max()) > 1e-3
