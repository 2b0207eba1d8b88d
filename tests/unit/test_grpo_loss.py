"""GRPO advantages, k3 KL and the clipped loss against numbers worked out by hand (plain Python floats), with
the gradient each token gets, and the config's refusals."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from mint_core.rl.grpo import GRPOConfig, group_advantages, grpo_loss, k3_kl

F64 = torch.float64
LOG = math.log


def _t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def _close(got: torch.Tensor, want: list[Any]) -> None:
    torch.testing.assert_close(got, torch.tensor(want, dtype=F64), rtol=0.0, atol=1e-12)


# ---- (a) group advantages ------------------------------------------------------------------------------------


def test_advantages_std_uses_population_std():
    # [1, 0, 0, 1]: mean 0.5; population std sqrt(4 * 0.25 / 4) = 0.5 (the sample std would be sqrt(1/3))
    a = 0.5 / (0.5 + 1e-6)
    adv, keep = group_advantages(_t([[1, 0, 0, 1]]), "std")
    _close(adv, [[a, -a, -a, a]])
    assert keep.tolist() == [True]


def test_advantages_std_skewed_group():
    # [1, 0, 0, 0]: mean 0.25; population variance (0.75^2 + 3 * 0.25^2) / 4 = 0.1875
    s = math.sqrt(0.1875) + 1e-6
    adv, _ = group_advantages(_t([[1, 0, 0, 0]]), "std")
    _close(adv, [[0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s]])


def test_advantages_mean_mode():
    adv, keep = group_advantages(_t([[1, 0, 0, 1], [1, 0, 0, 0]]), "mean")
    _close(adv, [[0.5, -0.5, -0.5, 0.5], [0.75, -0.25, -0.25, -0.25]])
    assert keep.tolist() == [True, True]


@pytest.mark.parametrize("mode", ["std", "mean"])
def test_zero_variance_group_is_flagged_and_gets_exactly_zero(mode):
    # 0.1 * 3 / 3 is not exactly 0.1 in floating point, so r - mean alone would leave ~1e-17 / 1e-6 behind
    rewards = _t([[1, 0, 0, 1], [0.1, 0.1, 0.1, 0.1], [0.0, 0.0, 0.0, 0.0]])
    adv, keep = group_advantages(rewards, mode)
    assert keep.tolist() == [True, False, False]
    assert torch.equal(adv[1:], torch.zeros(2, 4, dtype=F64))
    assert not adv.isnan().any()


def test_advantages_refuse_bad_input():
    with pytest.raises(ValueError, match="rewards must be"):
        group_advantages(torch.zeros(8), "std")
    with pytest.raises(ValueError, match="unknown advantage mode 'median'"):
        group_advantages(torch.zeros(2, 4), "median")  # type: ignore[arg-type]


# ---- (b) the clipped loss, its stats and its gradient ----------------------------------------------------------

# eps_low 0.2, eps_high 0.28: the ratio is clipped to [0.8, 1.28].
# row 0, A = +1: ratios 1.5 (clipped high: objective 1.28, no grad), 1.0, 0.5 (below 0.8 but A > 0, so the
#   unclipped 0.5 is the min: grad = ratio * A = 0.5)
# row 1, A = -1: ratios 0.5 (clipped low: objective -0.8, no grad), 1.5 (A < 0: -1.5 < -1.28 is the min,
#   unclipped, grad = -1.5), then a padded token whose exp(lp - old) = exp(100) would overflow
OLD = [[-1.0, -2.0, -0.5], [-0.7, -3.0, -100.0]]
LP = [
    [-1.0 + LOG(1.5), -2.0, -0.5 + LOG(0.5)],
    [-0.7 + LOG(0.5), -3.0 + LOG(1.5), 0.0],
]
MASK = [[1, 1, 1], [1, 1, 0]]
ADV = [1.0, -1.0]
# per-token loss = -objective: -1.28, -1, -0.5 | 0.8, 1.5 over 5 tokens
TOKEN_MEAN_LOSS = (-1.28 - 1.0 - 0.5 + 0.8 + 1.5) / 5
# d loss / d lp = -(d objective / d lp) / 5
TOKEN_MEAN_GRAD = [[0.0, -1.0 / 5, -0.5 / 5], [0.0, 1.5 / 5, 0.0]]


def _batch(**config: Any) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    lp = torch.tensor(LP, dtype=F64, requires_grad=True)
    loss, stats = grpo_loss(
        lp, _t(OLD), torch.tensor(ADV, dtype=F64), torch.tensor(MASK), GRPOConfig(**config)
    )
    loss.backward()
    assert lp.grad is not None
    return loss, lp.grad, stats


def test_loss_value_and_stats_with_both_clips_active():
    loss, _, stats = _batch()
    assert loss.item() == pytest.approx(TOKEN_MEAN_LOSS, abs=1e-12)
    assert stats["loss"] == pytest.approx(TOKEN_MEAN_LOSS, abs=1e-12)
    assert stats["clip_frac"] == pytest.approx(2 / 5)
    assert stats["clip_frac_high"] == pytest.approx(1 / 5)
    assert stats["clip_frac_low"] == pytest.approx(1 / 5)
    assert stats["ratio_mean"] == pytest.approx((1.5 + 1.0 + 0.5 + 0.5 + 1.5) / 5)
    assert stats["n_tokens"] == 5.0
    assert stats["kl"] == 0.0


def test_gradient_is_zero_exactly_where_the_clip_is_active():
    _, grad, _ = _batch()
    _close(grad, TOKEN_MEAN_GRAD)
    # the clipped tokens and the padded one get exactly nothing, the overflow at padding leaks no NaN
    assert grad[0, 0].item() == 0.0 and grad[1, 0].item() == 0.0 and grad[1, 2].item() == 0.0


def test_symmetric_clip_changes_the_high_side_only():
    # eps_high 0.6 lets ratio 1.5 through on row 0: objective 1.5, grad 1.5; the low side is as before
    loss, grad, stats = _batch(eps_high=0.6)
    assert loss.item() == pytest.approx((-1.5 - 1.0 - 0.5 + 0.8 + 1.5) / 5, abs=1e-12)
    _close(grad[0], [-1.5 / 5, -1.0 / 5, -0.5 / 5])
    assert stats["clip_frac_high"] == 0.0 and stats["clip_frac"] == pytest.approx(1 / 5)


def test_only_logprobs_get_gradient():
    lp = torch.tensor(LP, dtype=F64, requires_grad=True)
    old = torch.tensor(OLD, dtype=F64, requires_grad=True)
    ref = torch.tensor(OLD, dtype=F64, requires_grad=True)
    adv = torch.tensor(ADV, dtype=F64, requires_grad=True)
    loss, _ = grpo_loss(lp, old, adv, torch.tensor(MASK), GRPOConfig(kl_coef=0.1), ref_logprobs_BT=ref)
    loss.backward()
    assert lp.grad is not None
    assert old.grad is None and ref.grad is None and adv.grad is None


# ---- (c) k3 KL -------------------------------------------------------------------------------------------------


def test_k3_is_zero_when_equal_and_positive_otherwise():
    lp = _t([[-0.3, -1.0, -5.0]])
    assert torch.equal(k3_kl(lp, lp.clone()), torch.zeros(1, 3, dtype=F64))
    others = _t([[-0.1, -2.5, -4.0]])
    assert (k3_kl(lp, others) > 0).all()


def test_k3_closed_form_and_gradient():
    # delta = ref - lp; k3 = e^delta - delta - 1; d k3 / d lp = 1 - e^delta
    lp = torch.tensor([-1.0, -2.0], dtype=F64, requires_grad=True)
    ref = _t([[-2.0, -1.0]])[0]
    kl = k3_kl(lp, ref)
    _close(kl, [math.exp(-1) + 1 - 1, math.exp(1) - 1 - 1])
    kl.sum().backward()
    assert lp.grad is not None
    _close(lp.grad, [1 - math.exp(-1), 1 - math.exp(1)])


def test_kl_coef_adds_exactly_beta_times_mean_k3_under_token_mean():
    # ref = lp - 0.5 on unmasked tokens: delta = -0.5 everywhere, k3 = e^-0.5 + 0.5 - 1 per token
    k3 = math.exp(-0.5) - 0.5
    lp = torch.tensor(LP, dtype=F64, requires_grad=True)
    ref = torch.tensor(LP, dtype=F64) - 0.5
    ref[1, 2] = float("-inf")  # padding may hold anything
    args = (_t(OLD), torch.tensor(ADV, dtype=F64), torch.tensor(MASK))
    plain, plain_stats = grpo_loss(lp, *args, GRPOConfig(kl_coef=0.0), ref_logprobs_BT=ref)
    with_kl, stats = grpo_loss(lp, *args, GRPOConfig(kl_coef=0.1), ref_logprobs_BT=ref)
    assert plain.item() == pytest.approx(TOKEN_MEAN_LOSS, abs=1e-12)
    assert with_kl.item() - plain.item() == pytest.approx(0.1 * k3, abs=1e-12)
    assert stats["kl"] == pytest.approx(k3, abs=1e-12) and plain_stats["kl"] == pytest.approx(k3, abs=1e-12)
    with_kl.backward()
    assert lp.grad is not None
    # the KL adds 0.1 * (1 - e^-0.5) / 5 to every unmasked token's gradient, nothing to the padded one
    extra = 0.1 * (1 - math.exp(-0.5)) / 5
    want = [
        [g + extra * m for g, m in zip(gr, mr, strict=True)]
        for gr, mr in zip(TOKEN_MEAN_GRAD, MASK, strict=True)
    ]
    _close(lp.grad, want)


def test_kl_coef_without_reference_is_refused():
    with pytest.raises(ValueError, match=r"kl_coef is 0\.1 but no ref_logprobs_BT"):
        grpo_loss(_t(LP), _t(OLD), torch.tensor(ADV, dtype=F64), torch.tensor(MASK), GRPOConfig(kl_coef=0.1))


# ---- (d) aggregation over rows of different lengths -----------------------------------------------------------

# lp == old, so ratio 1 and each token's loss is -A (grad -A times its weight).
# row 0: A = +1, 1 token; row 1: A = -1, 3 tokens; row 2: a dropped group (no token), A = 0.
AGG_MASK = [[1, 0, 0], [1, 1, 1], [0, 0, 0]]
AGG_ADV = [1.0, -1.0, 0.0]


@pytest.mark.parametrize(
    ("loss_agg", "want_loss", "want_grad_row0", "want_grad_row1"),
    [
        # all 4 tokens equal: (-1 + 3) / 4
        ("token_mean", (-1.0 + 3.0) / 4, -1.0 / 4, 1.0 / 4),
        # row sums -1 and 3, mean over the 2 rows that have tokens
        ("seq_mean_token_sum", (-1.0 + 3.0) / 2, -1.0 / 2, 1.0 / 2),
        # row means -1 and 1, mean over 2 rows: each row weighs the same whatever its length
        ("seq_mean_token_mean", (-1.0 + 1.0) / 2, -1.0 / 2, 1.0 / 3 / 2),
    ],
)
def test_loss_aggregation(loss_agg, want_loss, want_grad_row0, want_grad_row1):
    old = _t([[-1.0, -2.0, -3.0], [-0.5, -0.25, -4.0], [-1.0, -1.0, -1.0]])
    lp = old.clone().requires_grad_(True)
    loss, stats = grpo_loss(
        lp, old, torch.tensor(AGG_ADV, dtype=F64), torch.tensor(AGG_MASK), GRPOConfig(loss_agg=loss_agg)
    )
    loss.backward()
    assert lp.grad is not None
    assert loss.item() == pytest.approx(want_loss, abs=1e-12)
    assert stats["n_tokens"] == 4.0
    _close(lp.grad, [[want_grad_row0, 0.0, 0.0], [want_grad_row1] * 3, [0.0, 0.0, 0.0]])


# ---- (e) nothing kept ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"])
def test_all_rows_masked_gives_zero_loss_that_backpropagates(loss_agg):
    lp = torch.tensor([[0.0, float("-inf")], [float("nan"), -1.0]], dtype=F64, requires_grad=True)
    old = _t([[-100.0, -1.0], [-1.0, float("nan")]])
    ref = _t([[float("-inf"), 0.0], [-1.0, -1.0]])
    adv = torch.tensor([float("nan"), 1.0], dtype=F64)
    config = GRPOConfig(loss_agg=loss_agg, kl_coef=0.1)
    loss, stats = grpo_loss(lp, old, adv, torch.zeros(2, 2, dtype=torch.bool), config, ref_logprobs_BT=ref)
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert lp.grad is not None
    assert torch.equal(lp.grad, torch.zeros(2, 2, dtype=F64))
    assert all(math.isfinite(v) for v in stats.values())
    assert stats["n_tokens"] == 0.0 and stats["clip_frac"] == 0.0


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match=r"advantages_B has shape \(3,\), expected \(2,\)"):
        grpo_loss(_t(LP), _t(OLD), torch.zeros(3, dtype=F64), torch.tensor(MASK), GRPOConfig())
    with pytest.raises(ValueError, match="mask_BT has shape"):
        grpo_loss(_t(LP), _t(OLD), torch.tensor(ADV, dtype=F64), torch.ones(2, 4), GRPOConfig())


# ---- (f) config ------------------------------------------------------------------------------------------------


def test_config_defaults():
    c = GRPOConfig()
    assert (c.group_size, c.advantage, c.eps_low, c.eps_high, c.kl_coef) == (8, "std", 0.2, 0.28, 0.0)
    assert (c.loss_agg, c.drop_zero_variance, c.max_grad_norm, c.adam_betas) == (
        "token_mean",
        True,
        1.0,
        (0.9, 0.999),
    )
    assert GRPOConfig.model_validate_json(c.model_dump_json()) == c


@pytest.mark.parametrize(
    ("case", "change", "expected"),
    [
        ("eps_low zero", {"eps_low": 0.0}, r"eps_low\n.*greater than 0"),
        ("eps_low negative", {"eps_low": -0.1}, r"eps_low\n.*greater than 0"),
        ("eps_high above one", {"eps_high": 1.5}, r"eps_high\n.*less than or equal to 1"),
        ("group of one", {"group_size": 1}, r"group_size\n.*greater than or equal to 2"),
        ("unknown field", {"clip_eps": 0.2}, r"clip_eps\n.*Extra inputs are not permitted"),
        ("unknown advantage", {"advantage": "median"}, r"advantage\n.*'std' or 'mean'"),
        ("unknown aggregation", {"loss_agg": "sum"}, r"loss_agg\n.*'token_mean', 'seq_mean_token_sum'"),
        ("negative kl", {"kl_coef": -0.1}, r"kl_coef\n.*greater than or equal to 0"),
        ("zero temperature", {"temperature": 0.0}, r"temperature\n.*greater than 0"),
        ("beta of one", {"adam_betas": (0.9, 1.0)}, r"adam_betas\.1\n.*less than 1"),
        ("zero grad norm", {"max_grad_norm": 0.0}, r"max_grad_norm\n.*greater than 0"),
    ],
)
def test_config_refuses(case, change, expected):
    with pytest.raises(ValidationError, match=expected):
        GRPOConfig(**change)
