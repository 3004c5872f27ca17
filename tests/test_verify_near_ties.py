"""Top-1 agreement is judged only where the golden's top-2 gap is clear of the profile's noise."""

from __future__ import annotations

import math

import numpy as np

from ktconvert.verify.metrics import compare_logits, tie_margins
from ktconvert.verify.profile import Profile, evaluate


def _golden():
    g = np.zeros((4, 8))
    g[:, 0] = 3.0
    g[0, 1] = 2.999  # position 0: a near-tie (gap 0.001)
    g[1, 1] = 1.0  # positions 1-3: clear (gap 2 or 3)
    return g


def _profile(**logits) -> Profile:
    return Profile("t", "test", {"logits": {"nmse_max": 1e-4, "top1_agreement_min": 0.9, **logits}})


def test_a_flipped_near_tie_is_shown_not_judged():
    g = _golden()
    c = g.copy()
    c[0, 1] = 3.001  # the near-tie flips
    s = _profile().compare(g, c).summary()
    assert s["top1_agreement_raw"] == 0.75
    assert s["top1_agreement"] == 1.0 and s["top1_positions_judged"] == 3
    assert s["top1_near_ties"] == [0] and s["top1_near_tie_flips"] == [0]
    assert s["first_top1_mismatch"] is None
    assert evaluate(_profile(), "decode", s, []) == []


def test_a_flipped_clear_position_is_judged_and_named():
    g = _golden()
    c = g.copy()
    c[2, 5] = 9.0  # a clear position flips
    s = _profile().compare(g, c).summary()
    assert s["top1_agreement"] == 2 / 3 and s["first_top1_mismatch"] == 2
    (breach,) = [b for b in evaluate(_profile(), "decode", s, []) if b.metric == "top1_agreement"]
    assert "first mismatch: position 2" in breach.where and "1 near-tie position(s) set aside" in breach.where


def test_the_margin_follows_nmse_max_and_the_position_scale():
    g = _golden()
    m = tie_margins(g, 1e-4)
    rms = np.sqrt(np.mean(g * g, axis=-1))
    assert np.allclose(m, 0.01 * rms)
    assert np.all(tie_margins(g, None) == 0)  # no nmse limit: nothing set aside
    assert np.all(tie_margins(g, 1e-4, 0.5) == 0.5)  # an explicit margin wins
    s = _profile(top1_tie_margin=0).compare(g, g).summary()
    assert s["top1_near_ties"] == [] and s["top1_positions_judged"] == 4


def test_a_nonfinite_candidate_position_is_never_set_aside():
    g = _golden()
    c = g.copy()
    c[0, 3] = math.nan
    st = compare_logits(g, c, 5, tie_margins(g, 1e-4))
    s = st.summary()
    assert 0 not in s["top1_near_ties"] and s["first_top1_mismatch"] == 0
    assert st.per_position()[0]["near_tie"] is False
