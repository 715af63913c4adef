"""Tests of trioserve.engine.sampling on made-up logits.

The sampler's distribution is compared with a plain reference written here
from the standard definitions (full sorts, one row at a time, numpy), and its
draws are compared with that distribution.
"""

from __future__ import annotations

import math

import attrs
import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray

from trioserve.engine.sampling import (
    RowState,
    SamplingError,
    distribution,
    make_generator,
    penalise,
    sample,
    settings_problem,
)
from trioserve.errors import EngineError, TrioserveError
from trioserve.vocabulary.sampling import SamplingSettings

F32 = NDArray[np.float32]
F64 = NDArray[np.float64]


# -- a reference sampler, from the definitions -------------------------------


def ref_penalise(x: F32, counts: NDArray[np.int64], s: SamplingSettings) -> F32:
    """float32, like the sampler, so that the two agree to the bit."""
    c = counts.astype(np.float32)
    rep = np.float32(s.rep_pen)
    pen = np.where(x > 0, x / rep, x * rep)
    pen = pen - np.float32(s.freq_pen) * c - np.float32(s.pres_pen)
    return np.where(counts > 0, pen, x).astype(np.float32)


def ref_distribution(
    logits: F32,
    s: SamplingSettings,
    counts: NDArray[np.int64] | None = None,
    banned: NDArray[np.bool_] | None = None,
) -> F64:
    return ref_distribution_and_doubt(logits, s, counts, banned)[0]


def ref_distribution_and_doubt(
    logits: F32,
    s: SamplingSettings,
    counts: NDArray[np.int64] | None = None,
    banned: NDArray[np.bool_] | None = None,
    rounding: float = 1e-6,
) -> tuple[F64, bool]:
    """The reference distribution, and whether one of its cut-offs fell so
    close to a threshold that float rounding may decide it either way: within
    ``rounding`` of it, relatively (the sampler's float32 probabilities are
    that far from exact)."""

    def _close(a: F64 | float, b: float) -> bool:
        return bool(np.any(np.abs(np.asarray(a) - b) <= rounding * max(abs(b), 1e-3)))

    x = logits.astype(np.float32).copy()
    if counts is not None:
        x = ref_penalise(x, counts, s)
    if banned is not None:
        x[banned] = -np.inf
    vocab = len(x)
    out = np.zeros(vocab)
    doubt = False
    if s.temperature == 0:
        out[int(np.argmax(x))] = 1.0
        return out, doubt
    # Descending by logit, ties by id.
    order = sorted(range(vocab), key=lambda i: (-float(x[i]), i))
    z = x.astype(np.float64)[order] / s.temperature
    p = np.exp(z - z.max())
    p /= p.sum()

    def renorm(keep: NDArray[np.bool_]) -> F64:
        keep = keep.copy()
        keep[0] = True
        q: F64 = np.where(keep, p, 0.0)
        return np.asarray(q / q.sum(), dtype=np.float64)

    if s.top_k > 0:
        p = renorm(np.arange(vocab) < s.top_k)
    if 0 < s.top_p < 1:
        before = np.concatenate([[0.0], np.cumsum(p)[:-1]])
        doubt |= _close(before[p > 0], s.top_p)
        p = renorm(before < s.top_p)
    if s.top_a > 0:
        doubt |= _close(p[p > 0], s.top_a * p.max() ** 2)
        p = renorm(p >= s.top_a * p.max() ** 2)
    if s.min_p > 0:
        doubt |= _close(p[p > 0], s.min_p * p.max())
        p = renorm(p >= s.min_p * p.max())
    if 0 < s.typical < 1:
        nonzero = p > 0
        logp = np.log(np.where(nonzero, p, 1.0))
        entropy = -np.sum(np.where(nonzero, p * logp, 0.0))
        distance = np.where(nonzero, np.abs(-logp - entropy), np.inf)
        by_typicality = sorted(range(vocab), key=lambda i: (float(distance[i]), i))
        keep = np.zeros(vocab, dtype=bool)
        mass = 0.0
        for i in by_typicality:
            doubt |= _close(mass, s.typical) and p[i] > 0
            if mass >= s.typical:
                break
            keep[i] = True
            mass += p[i]
        # Not renorm(): the argmax need not be among the most typical.
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    out[order] = p
    return out, doubt


# -- strategies ----------------------------------------------------------------

settings_st = st.builds(
    SamplingSettings,
    temperature=st.one_of(st.just(0.0), st.floats(0.05, 3.0)),
    top_k=st.one_of(st.just(0), st.integers(1, 60)),
    top_p=st.one_of(st.just(0.0), st.just(1.0), st.floats(0.05, 0.99)),
    top_a=st.one_of(st.just(0.0), st.floats(0.01, 2.0)),
    min_p=st.one_of(st.just(0.0), st.floats(0.001, 0.5)),
    typical=st.one_of(st.just(0.0), st.floats(0.05, 0.99)),
    skew=st.one_of(st.just(0.0), st.floats(-2.0, 2.0)),
    rep_pen=st.one_of(st.just(1.0), st.floats(0.5, 2.0)),
    freq_pen=st.one_of(st.just(0.0), st.floats(-1.0, 1.0)),
    pres_pen=st.one_of(st.just(0.0), st.floats(-1.0, 1.0)),
)


def make_logits(seed: int, vocab: int, scale: float, ties: bool) -> F32:
    """Continuous random logits, or logits on a coarse grid (many ties, as
    bf16 logits have)."""
    x = np.random.default_rng(seed).normal(size=vocab) * scale
    if ties:
        x = np.round(x * 4) / 4
    return x.astype(np.float32)


logits_st = st.builds(
    make_logits,
    seed=st.integers(0, 2**32 - 1),
    vocab=st.sampled_from([2, 7, 50, 300, 1500]),
    scale=st.sampled_from([0.5, 2.0, 6.0]),
    ties=st.booleans(),
)


def t(x: NDArray[np.generic]) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x))


def make_counts(seed: int, vocab: int) -> NDArray[np.int64]:
    rng = np.random.default_rng(seed)
    counts = np.zeros(vocab, dtype=np.int64)
    hit = rng.choice(vocab, size=max(1, vocab // 4), replace=False)
    counts[hit] = rng.integers(1, 5, size=len(hit))
    return counts


# -- the distribution -------------------------------------------------------------


@given(logits_st, settings_st, st.booleans(), st.booleans(), st.integers(0, 2**32 - 1))
@settings(deadline=None)
def test_distribution_matches_the_reference(
    logits: F32, s: SamplingSettings, with_counts: bool, with_bans: bool, seed: int
) -> None:
    vocab = len(logits)
    counts = make_counts(seed, vocab) if with_counts else None
    banned = None
    if with_bans and vocab > 2:
        # Ban some of the likeliest tokens, never all.
        banned = np.zeros(vocab, dtype=bool)
        banned[np.argsort(-logits)[: vocab // 3]] = True
    got = distribution(
        t(logits)[None],
        [s],
        counts=None if counts is None else t(counts)[None],
        banned=None if banned is None else t(banned)[None],
    )[0].numpy()
    want, doubt = ref_distribution_and_doubt(logits, s, counts, banned)
    assume(not doubt)
    assert got.sum() == pytest.approx(1.0)
    # Filtered-out and banned tokens have probability exactly 0; tokens the
    # reference keeps with a non-negligible probability are kept.
    assert np.all(got[want == 0] == 0)
    assert np.all(got[want > 1e-12] > 0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    if banned is not None:
        assert np.all(got[banned] == 0)


@given(logits_st, st.integers(0, 2**32 - 1), settings_st)
@settings(deadline=None)
def test_greedy_is_the_argmax(logits: F32, seed: int, s: SamplingSettings) -> None:
    s = SamplingSettings(
        temperature=0.0, rep_pen=s.rep_pen, freq_pen=s.freq_pen, pres_pen=s.pres_pen
    )
    counts = make_counts(seed, len(logits))
    before = torch.get_rng_state()
    got = sample(t(logits)[None], [s], [make_generator(seed)], counts=t(counts)[None])
    # np.argmax takes the first maximum: ties go to the lower id.
    assert int(got[0]) == int(np.argmax(ref_penalise(logits, counts, s)))
    assert torch.equal(torch.get_rng_state(), before)


@given(logits_st, st.integers(0, 2**32 - 1), settings_st)
@settings(deadline=None)
def test_penalties_change_exactly_the_ids_in_counts(
    logits: F32, seed: int, s: SamplingSettings
) -> None:
    counts = make_counts(seed, len(logits))
    original = logits.copy()
    got = penalise(t(logits)[None], t(counts)[None], [s])[0].numpy()
    assert np.array_equal(logits, original)  # the input is not changed in place
    untouched = counts == 0
    assert np.array_equal(got[untouched], logits[untouched])
    np.testing.assert_array_equal(got, ref_penalise(logits, counts, s))
    # Every id in the context moves, in the direction the penalties say.
    touched = counts > 0
    shift = s.freq_pen * counts[touched] + s.pres_pen
    rep_moves = (s.rep_pen != 1) & (logits[touched] != 0)
    changed = got[touched] != logits[touched]
    # Each penalty alone always moves the ids it touches; together they can
    # cancel out (rep_pen 0.5 doubles a logit of 1.0, pres_pen 1.0 takes the
    # 1.0 back), which the comparison with the reference above covers.
    if s.rep_pen == 1:
        assert np.all(changed[np.abs(shift) > 1e-3])
    elif s.freq_pen == 0 and s.pres_pen == 0:
        assert np.all(changed[rep_moves])
    if s.rep_pen > 1 and s.freq_pen >= 0 and s.pres_pen >= 0:
        assert np.all(got[touched] <= logits[touched])


FILTERS: dict[str, st.SearchStrategy[float]] = {
    "top_k": st.integers(1, 40),
    "top_p": st.floats(0.05, 0.99),
    "top_a": st.floats(0.01, 3.0),
    "min_p": st.floats(0.001, 1.0),
    "typical": st.floats(0.05, 0.99),
}


@given(logits_st, st.floats(0.1, 2.0), st.sampled_from(sorted(FILTERS)), st.data())
@settings(deadline=None)
def test_filters_only_remove_tokens(
    logits: F32, temperature: float, name: str, data: st.DataObject
) -> None:
    base = SamplingSettings(temperature=temperature, top_k=0, top_p=1.0, rep_pen=1.0)
    value = data.draw(FILTERS[name], label=name)
    filtered = attrs.evolve(base, **{name: value})  # type: ignore[arg-type]
    x = t(logits)[None]
    full = distribution(x, [base])[0].numpy()
    kept = distribution(x, [filtered])[0].numpy()
    assert kept.sum() == pytest.approx(1.0)
    assert np.all((kept > 0) <= (full > 0))
    # Kept tokens keep their relative probabilities (renormalised), where
    # float32 holds them with its full precision (above its smallest normal
    # number: a probability of 1e-42 keeps a few bits, so its ratio none).
    normal = (kept > 0) & (full >= np.finfo(np.float32).tiny) & (kept >= np.finfo(np.float32).tiny)
    ratio = kept[normal] / full[normal]
    np.testing.assert_allclose(ratio, ratio[0], rtol=1e-4)
    if name == "typical":
        # Typical sampling keeps the most typical token, which need not be
        # the argmax: the one whose surprisal is closest to the entropy.
        p = full[full > 0]
        entropy = -np.sum(p * np.log(p))
        surprisal = -np.log(np.where(full > 0, full, 1.0))
        distance = np.where(full > 0, np.abs(surprisal - entropy), np.inf)
        most_typical = distance <= distance.min() + 1e-9
        assert np.any(kept[most_typical] > 0)
    else:
        assert kept[int(np.argmax(logits))] > 0


# -- the draw ------------------------------------------------------------------


@given(logits_st, settings_st, st.integers(0, 2**63 - 1))
@settings(deadline=None)
def test_banned_ids_are_never_drawn(logits: F32, s: SamplingSettings, seed: int) -> None:
    vocab = len(logits)
    banned = np.zeros(vocab, dtype=bool)
    banned[np.argsort(-logits)[: max(1, vocab // 2)]] = True
    if banned.all():
        banned[-1] = False
    rows = 32
    x = t(np.tile(logits, (rows, 1)))
    generators = [make_generator(seed + i) for i in range(rows)]
    for _ in range(4):
        got = sample(x, [s] * rows, generators, banned=t(np.tile(banned, (rows, 1))))
        assert not banned[got.numpy()].any()


@given(logits_st, settings_st, st.integers(0, 2**63 - 1))
@settings(deadline=None)
def test_allowed_mask_is_respected(logits: F32, s: SamplingSettings, seed: int) -> None:
    vocab = len(logits)
    allowed = np.random.default_rng(seed % 2**32).random(vocab) < 0.2
    allowed[int(np.argmin(logits))] = True  # at least one, and an unlikely one
    rows = 16
    x = t(np.tile(logits, (rows, 1)))
    got = sample(
        x,
        [s] * rows,
        [make_generator(seed + i) for i in range(rows)],
        allowed=t(np.tile(allowed, (rows, 1))),
    )
    assert allowed[got.numpy()].all()
    # A row of all True is no constraint.
    everything = torch.ones((rows, vocab), dtype=torch.bool)
    generators = [make_generator(seed + i) for i in range(rows)]
    free = sample(x, [s] * rows, generators, allowed=everything)
    generators = [make_generator(seed + i) for i in range(rows)]
    assert torch.equal(free, sample(x, [s] * rows, generators))


def _draws(seed: int, n: int, s: SamplingSettings, logits: torch.Tensor) -> list[int]:
    g = make_generator(seed)
    return [int(sample(logits, [s], [g])[0]) for _ in range(n)]


def test_same_seed_same_draws_and_different_seeds_differ() -> None:
    logits = torch.zeros(1, 64)  # uniform: every draw is informative
    s = SamplingSettings(temperature=1.0, top_k=0, top_p=1.0, rep_pen=1.0)
    first = _draws(7, 200, s, logits)
    assert first == _draws(7, 200, s, logits)
    others = [_draws(seed, 200, s, logits) for seed in (8, 9, 107)]
    for other in others:
        # Two independent sequences of 200 uniform draws over 64 ids agree in
        # about 3 places; far fewer than 40 is a sure sign of independence.
        assert sum(a == b for a, b in zip(first, other, strict=True)) < 40
    assert len(set(first)) > 40


def test_make_generator_accepts_any_int_and_none() -> None:
    logits = torch.zeros(1, 1000)
    s = SamplingSettings(temperature=1.0, top_k=0, top_p=1.0)
    assert _draws(-1, 20, s, logits) == _draws(2**64 - 1, 20, s, logits)
    assert _draws(2**80 + 3, 20, s, logits) == _draws(3, 20, s, logits)
    unseeded = [tuple(_draws_unseeded(s, logits)) for _ in range(3)]
    assert len(set(unseeded)) == 3


def _draws_unseeded(s: SamplingSettings, logits: torch.Tensor) -> list[int]:
    g = make_generator(None)
    return [int(sample(logits, [s], [g])[0]) for _ in range(20)]


@given(
    st.lists(
        st.tuples(logits_st.filter(lambda x: len(x) > 1), settings_st), min_size=2, max_size=6
    ),
    st.integers(0, 2**32),
)
@settings(deadline=None)
def test_a_mixed_batch_samples_each_row_as_alone(
    rows: list[tuple[F32, SamplingSettings]], seed: int
) -> None:
    vocab = min(len(x) for x, _ in rows)
    logits = torch.stack([t(x[:vocab]) for x, _ in rows])
    counts = torch.stack([t(make_counts(seed + i, vocab)) for i in range(len(rows))])
    all_settings = [s for _, s in rows]
    batch_gens = [make_generator(seed + i) for i in range(len(rows))]
    alone_gens = [make_generator(seed + i) for i in range(len(rows))]
    for _ in range(3):
        together = sample(logits, all_settings, batch_gens, counts=counts)
        for i, s in enumerate(all_settings):
            alone = sample(logits[i : i + 1], [s], [alone_gens[i]], counts=counts[i : i + 1])
            assert int(alone[0]) == int(together[i])


def _chi_square(observed: NDArray[np.int64], expected: F64) -> tuple[float, int]:
    support = expected > 0
    assert observed[~support].sum() == 0, "drew a token of probability 0"
    n = observed.sum()
    e = expected[support] * n
    return float(np.sum((observed[support] - e) ** 2 / e)), int(support.sum()) - 1


def _frequencies(logits: torch.Tensor, s: SamplingSettings, draws: int) -> NDArray[np.int64]:
    rows = 1000
    x = logits.expand(rows, -1).contiguous()
    generators = [make_generator(10_000 + i) for i in range(rows)]
    counts = np.zeros(logits.shape[1], dtype=np.int64)
    for _ in range(draws // rows):
        np.add.at(counts, sample(x, [s] * rows, generators).numpy(), 1)
    return counts


CHI_SQUARE_SETTINGS = [
    SamplingSettings(temperature=1.0, top_k=0, top_p=1.0, rep_pen=1.0),
    SamplingSettings(temperature=0.7, top_k=5, top_p=0.9, rep_pen=1.0),
    SamplingSettings(temperature=1.3, top_k=0, top_p=0.95, min_p=0.02, rep_pen=1.0),
    SamplingSettings(temperature=1.0, top_k=0, top_p=1.0, typical=0.8, rep_pen=1.0),
    SamplingSettings(temperature=1.0, top_k=8, top_p=1.0, top_a=0.2, rep_pen=1.0),
]


@pytest.mark.parametrize("s", CHI_SQUARE_SETTINGS)
def test_frequencies_match_the_filtered_distribution(s: SamplingSettings) -> None:
    logits = torch.tensor([[2.0, 1.5, 1.4, 0.3, 0.0, -0.5, -1.0, -3.0, 1.45, 0.1]])
    expected = distribution(logits, [s])[0].numpy()
    observed = _frequencies(logits, s, 20_000)
    stat, dof = _chi_square(observed, expected)
    # The 0.999 quantile of chi-square is below 30 for up to 9 degrees of
    # freedom; a wrong distribution gives thousands with 20000 draws.
    assert dof >= 1
    assert stat < 30, (stat, observed, expected)


@pytest.mark.parametrize("skew", [-1.0, 0.6])
def test_skew_bends_the_draw_as_exllamav2_does(skew: float) -> None:
    s = SamplingSettings(temperature=1.0, top_k=0, top_p=1.0, rep_pen=1.0, skew=skew)
    logits = torch.tensor([[1.0, 0.2, 0.5, -0.3, 0.0, 0.9]])
    p = distribution(logits, [s])[0].numpy()
    # u' = u ** exp(-skew) over the candidates in descending order, so the
    # CDF there becomes F ** exp(skew).
    order = np.argsort(-p, kind="stable")
    cdf = np.cumsum(p[order]) ** math.exp(skew)
    bent = np.zeros_like(p)
    bent[order] = np.diff(np.concatenate([[0.0], cdf]))
    observed = _frequencies(logits, s, 20_000)
    stat, _ = _chi_square(observed, bent)
    assert stat < 30, (stat, observed, bent)
    plain_stat, _ = _chi_square(observed, p)
    assert plain_stat > 100  # and the skew did change the draw


# -- failures ------------------------------------------------------------------


def test_rows_that_cannot_be_sampled_fail_alone() -> None:
    vocab = 20
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(0))
    logits[2, 3] = float("nan")
    logits[3, 4] = float("inf")
    banned = torch.zeros(5, vocab, dtype=torch.bool)
    banned[1] = True
    s = SamplingSettings(temperature=1.0)
    bad = SamplingSettings(temperature=-1.0)
    generators = [make_generator(i) for i in range(5)]
    with pytest.raises(SamplingError) as caught:
        sample(logits, [s, s, s, s, bad], generators, banned=banned)
    error = caught.value
    assert isinstance(error, TrioserveError)
    assert error.rows == (1, 2, 3, 4)
    assert "banned" in error.reasons[1]
    assert "nan" in error.reasons[2]
    assert "+inf" in error.reasons[3]
    assert "temperature" in error.reasons[4] and "-1.0" in error.reasons[4]
    assert str(error).startswith("cannot sample rows [1, 2, 3, 4]")
    assert error.ids is not None
    assert error.ids[1:].tolist() == [-1, -1, -1, -1]
    # Row 0 was sampled as if alone; the failed rows' generators were untouched.
    alone = sample(logits[:1], [s], [make_generator(0)])
    assert int(error.ids[0]) == int(alone[0])
    for i in range(1, 5):
        assert torch.equal(generators[i].get_state(), make_generator(i).get_state())
    with pytest.raises(SamplingError):
        distribution(logits, [s] * 5, banned=banned)


def test_greedy_all_masked_row_raises_too() -> None:
    logits = torch.zeros(1, 5)
    allowed = torch.zeros(1, 5, dtype=torch.bool)
    with pytest.raises(SamplingError, match="every token is banned"):
        sample(logits, [SamplingSettings(temperature=0.0)], [make_generator(0)], allowed=allowed)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", float("nan")),
        ("top_k", -1),
        ("top_p", 1.5),
        ("top_a", -0.1),
        ("min_p", 2.0),
        ("typical", -0.5),
        ("skew", float("inf")),
        ("rep_pen", 0.0),
        ("freq_pen", float("nan")),
        ("pres_pen", float("-inf")),
    ],
)
def test_settings_problem_names_the_field(field: str, value: float) -> None:
    problem = settings_problem(SamplingSettings(**{field: value}))  # type: ignore[arg-type]
    assert problem is not None
    assert problem.startswith(field)
    assert repr(value) in problem
    assert settings_problem(SamplingSettings()) is None


def test_mismatched_arguments_are_engine_errors() -> None:
    logits = torch.zeros(2, 5)
    s = SamplingSettings()
    with pytest.raises(EngineError, match="one entry per row"):
        sample(logits, [s], [make_generator(0)])
    with pytest.raises(EngineError, match="generators"):
        sample(logits, [s, s], [make_generator(0)])
    with pytest.raises(EngineError, match="banned must have the logits' shape"):
        sample(logits, [s, s], [make_generator(0)] * 2, banned=torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(EngineError, match="bool"):
        sample(logits, [s, s], [make_generator(0)] * 2, allowed=torch.zeros(2, 5))


def test_the_callers_logits_are_not_changed() -> None:
    logits = torch.randn(2, 30, dtype=torch.bfloat16)
    copy = logits.clone()
    counts = torch.ones(2, 30, dtype=torch.int64)
    banned = torch.zeros(2, 30, dtype=torch.bool)
    banned[:, 0] = True
    sample(logits, [SamplingSettings()] * 2, [make_generator(0)] * 2, counts=counts, banned=banned)
    assert torch.equal(logits, copy)


def test_large_vocabulary_paths_agree_with_the_reference() -> None:
    # A real vocabulary size: top_k rows use topk, top_k == 0 rows with top_p
    # try 512 and 4096 candidates before a full sort.
    vocab = 49152
    rng = np.random.default_rng(5)
    peaky = (rng.normal(size=vocab) * 2.5).astype(np.float32)
    peaky[:50] += 12
    flat = (np.round(rng.normal(size=vocab) * 4) / 4).astype(np.float32)
    # 6,000 likely tokens over a long tail: top_p's cut-off needs the full sort
    # and falls among tokens of about 1e-4 each, far from rounding's reach.
    wide = (rng.normal(size=vocab) - 8).astype(np.float32)
    wide[:6000] = rng.normal(size=6000).astype(np.float32) * 0.5
    cases = [
        (peaky, SamplingSettings(top_k=0, top_p=0.9)),
        (flat, SamplingSettings(top_k=0, top_p=0.5, temperature=0.5)),
        (wide, SamplingSettings(top_k=0, top_p=0.9)),
        (flat, SamplingSettings(top_k=0, top_p=1.0, min_p=0.05)),
        (wide, SamplingSettings(top_k=0, top_p=0.99, min_p=0.05, typical=0.9)),
        (flat, SamplingSettings(top_k=0, top_p=1.0, top_a=0.5, skew=0.5)),
        (flat, SamplingSettings(top_k=100, top_p=0.8)),
        (peaky, SamplingSettings(top_k=0, top_p=1.0, typical=0.7)),
    ]
    for logits, s in cases:
        got = distribution(t(logits)[None], [s])[0].numpy()
        # The sampler's probabilities come from a float32 softmax, whose sum over
        # 49,152 terms is off by up to about 1e-5 relatively (how far depends on
        # the instruction set: the vector width sets the order of the additions):
        # a cut-off that close to its threshold is rounding's choice. Measured on
        # these logits, doubled, and no case may come that close.
        x = t(logits)[None] / s.temperature
        error = float((torch.softmax(x, 1).double() / torch.softmax(x.double(), 1) - 1).abs().max())
        want, doubt = ref_distribution_and_doubt(logits, s, rounding=max(2 * error, 1e-6))
        assert not doubt, s
        assert np.all(got[want == 0] == 0)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-8)


# -- the samplers of ExLlamaV2's front ends ------------------------------------------

#: Drawn over the whole vocabulary (plain), over top_k candidates, and in
#: descending order (top_p): the three ways a row's candidates are built.
KINDS = [
    SamplingSettings(temperature=1.0, top_k=0, top_p=1.0, rep_pen=1.0),
    SamplingSettings(temperature=1.0, top_k=4, top_p=1.0, rep_pen=1.0),
    SamplingSettings(temperature=1.0, top_k=0, top_p=0.999999, rep_pen=1.0),
]


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs], dtype=torch.float64).log().to(torch.float32)


def dist(s: SamplingSettings, probs: list[float], **kwargs: object) -> list[float]:
    out = distribution(logits_of(probs), [s], **kwargs)  # type: ignore[arg-type]
    return [float(v) for v in out[0]]


@pytest.mark.parametrize("base", KINDS)
def test_xtc_removes_all_top_choices_but_the_least(base: SamplingSettings) -> None:
    probs = [0.5, 0.3, 0.15, 0.05]
    fired = attrs.evolve(base, xtc_probability=1.0, xtc_threshold=0.1)
    # 0.5 and 0.3 go; 0.15, the least likely over the threshold, stays.
    assert dist(fired, probs) == pytest.approx([0.0, 0.0, 0.75, 0.25])
    half = attrs.evolve(fired, xtc_probability=0.5)
    assert dist(half, probs) == pytest.approx([0.25, 0.15, 0.45, 0.15])
    # A protected token is neither removed nor counted.
    guard = torch.tensor([True, False, False, False])
    assert dist(fired, probs, xtc_protected=guard) == pytest.approx(
        [0.5 / 0.7, 0, 0.15 / 0.7, 0.05 / 0.7]
    )
    # One token over the threshold: nothing happens.
    assert dist(attrs.evolve(fired, xtc_threshold=0.4), probs) == pytest.approx(probs)


@pytest.mark.parametrize("base", KINDS)
def test_mirostat_cuts_tokens_more_surprising_than_mu(base: SamplingSettings) -> None:
    probs = [0.5, 0.25, 0.125, 0.125]  # surprises of 1, 2, 3 and 3 bits
    s = attrs.evolve(base, mirostat=True, mirostat_tau=1.1, mirostat_eta=0.1)
    # The first step starts at mu = 2 tau = 2.2 bits: p >= 0.22 stays.
    assert dist(s, probs) == pytest.approx([2 / 3, 1 / 3, 0, 0])
    assert dist(s, probs, states=[RowState(mu=3.2)]) == pytest.approx(probs)
    assert dist(s, probs, states=[RowState(mu=0.5)]) == pytest.approx([1, 0, 0, 0])


def test_mirostat_mu_follows_the_surprise_of_each_draw() -> None:
    probs = [0.5, 0.25, 0.125, 0.125]
    s = attrs.evolve(KINDS[0], mirostat=True, mirostat_tau=1.1, mirostat_eta=0.1)
    state = RowState()
    generator = make_generator(5)
    mu = 2.2
    for _ in range(20):
        before = dist(s, probs, states=[state])
        token = int(sample(logits_of(probs), [s], [generator], states=[state])[0])
        assert before[token] > 0
        mu += 0.1 * (1.1 - -math.log2(before[token]))
        assert state.mu == pytest.approx(mu)


@pytest.mark.parametrize("base", KINDS)
def test_temperature_last_applies_it_after_the_filters(base: SamplingSettings) -> None:
    probs = [0.5, 0.3, 0.15, 0.05]
    s = attrs.evolve(base, min_p=0.2, temperature=2.0, temperature_last=True)
    # min_p sees the probabilities at temperature 1 (0.05 < 0.1 goes), then
    # the temperature bends the three that are left.
    kept = np.array([0.5, 0.3, 0.15]) ** 0.5
    assert dist(s, probs) == pytest.approx([*(kept / kept.sum()), 0.0])
    # Before the filters, temperature 2 would have kept 0.05 (sqrt: 0.22 >= 0.2 * 0.71).
    first = dist(attrs.evolve(s, temperature_last=False), probs)
    assert first[3] > 0


@pytest.mark.parametrize("base", KINDS)
def test_dynamic_temperature_follows_the_entropy(base: SamplingSettings) -> None:
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    s = attrs.evolve(base, min_temp=0.5, max_temp=1.5, temp_exponent=2.0)
    h = -(probs * np.log(probs)).sum() / math.log(4)
    temperature = 0.5 + 1.0 * h**2.0
    bent = probs ** (1 / temperature)
    assert dist(s, list(probs)) == pytest.approx(list(bent / bent.sum()))
    # Uniform probabilities have the most entropy: max_temp, which changes nothing there.
    assert dist(s, [0.25] * 4) == pytest.approx([0.25] * 4)


@pytest.mark.parametrize("base", KINDS)
def test_smoothing_factor_makes_the_logits_quadratic(base: SamplingSettings) -> None:
    logits = torch.tensor([[3.0, 2.0, 0.0, -1.0]])
    s = attrs.evolve(base, smoothing_factor=0.5, temperature=0.8)
    d = logits[0].double() - 3.0
    expected = torch.softmax(-0.5 * d * d / 0.8, dim=0)
    got = distribution(logits, [s])[0]
    assert got.tolist() == pytest.approx(expected.tolist())


def test_bias_is_added_to_the_logits_greedy_included() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    greedy = SamplingSettings(temperature=0.0, rep_pen=1.0)
    ban = torch.tensor([[-100.0, 0.0, 0.0, 0.0]])
    force = torch.tensor([[0.0, 0.0, 0.0, 100.0]])
    assert sample(logits, [greedy], [make_generator(1)], bias=ban).tolist() == [1]
    assert sample(logits, [greedy], [make_generator(1)], bias=force).tolist() == [3]
    warm = SamplingSettings(temperature=1.0, top_k=0, top_p=1.0, rep_pen=1.0)
    forced = distribution(logits, [warm], bias=force)[0]
    assert float(forced[3]) == pytest.approx(1.0) and float(forced[:3].max()) < 1e-40
    # A banned id stays banned whatever its bias.
    banned = torch.tensor([[False, False, False, True]])
    assert sample(logits, [greedy], [make_generator(1)], bias=force, banned=banned).tolist() == [0]


NEW = [
    SamplingSettings(temperature=1.0, xtc_probability=1.0, xtc_threshold=0.05),
    SamplingSettings(temperature=0.7, top_k=0, mirostat=True, mirostat_tau=3.0),
    SamplingSettings(temperature=1.0, top_k=0, top_p=0.95, min_temp=0.3, max_temp=2.0),
    SamplingSettings(temperature=1.3, smoothing_factor=0.2, temperature_last=True, min_p=0.02),
    SamplingSettings(temperature=0.0, rep_pen=1.0),
    SamplingSettings(),
]


def test_rows_with_different_new_samplers_draw_as_alone() -> None:
    """One batch of rows with different samplers draws, and moves each
    row's mirostat mu, exactly as each row alone."""
    logits = torch.from_numpy(make_logits(3, 300, 4.0, ties=True)).repeat(len(NEW), 1)
    logits += torch.randn(logits.shape, generator=torch.Generator().manual_seed(1))
    guard = torch.zeros(300, dtype=torch.bool)
    guard[:5] = True
    together_states = [RowState() for _ in NEW]
    alone_states = [RowState() for _ in NEW]
    gens_together = [make_generator(i) for i in range(len(NEW))]
    gens_alone = [make_generator(i) for i in range(len(NEW))]
    for _ in range(10):
        together = sample(
            logits, NEW, gens_together, states=together_states, xtc_protected=guard
        ).tolist()
        alone = [
            int(
                sample(
                    logits[i : i + 1],
                    [s],
                    [gens_alone[i]],
                    states=[alone_states[i]],
                    xtc_protected=guard,
                )[0]
            )
            for i, s in enumerate(NEW)
        ]
        assert together == alone
        assert [s.mu for s in together_states] == [s.mu for s in alone_states]
    assert together_states[1].mu is not None and together_states[0].mu is None


def test_a_row_with_bad_new_settings_fails_alone() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    bad = [
        SamplingSettings(mirostat_tau=math.nan),
        SamplingSettings(dry_sequence_breakers=("x",) * 100_000),
        # (logit_bias ids are checked against the vocabulary by the engines.)
        SamplingSettings(logit_bias=((5, 1.0), (5, 2.0))),
        SamplingSettings(logit_bias=((5, math.inf),)),
        SamplingSettings(xtc_probability=2.0),
        SamplingSettings(dry_range=5),
        SamplingSettings(mirostat=1),  # type: ignore[arg-type]
    ]
    for b in bad:
        with pytest.raises(SamplingError) as info:
            sample(logits, [NEW[0], b, NEW[2]], [make_generator(i) for i in range(3)])
        assert info.value.rows == (1,)
        assert info.value.ids is not None and info.value.ids[1] == -1
        assert (info.value.ids[[0, 2]] >= 0).all()
        assert len(info.value.reasons[1]) < 300, info.value.reasons[1]
