"""The robust rules as pure functions on literal tensors, and the fault injector's spelling."""

from __future__ import annotations

import pytest
import torch

from bundle.engine.aggregate import Fault, combine, parse_fault
from bundle.errors import ConfigError

# Four bundles' contributions to three coordinates; bundle 3 is wild in the first two.
FOUR = torch.tensor(
    [
        [1.0, 10.0, -2.0],
        [2.0, 20.0, -1.0],
        [3.0, 30.0, 0.0],
        [1000.0, -5000.0, 1.0],
    ]
)


def test_mean_is_what_an_allreduce_computes():
    assert torch.equal(combine(FOUR, "mean"), FOUR.mean(dim=0))


def test_median_of_an_even_count_is_the_mean_of_the_two_middle_values():
    assert combine(FOUR, "median").tolist() == [2.5, 15.0, -0.5]


def test_median_of_an_odd_count_is_the_middle_value():
    assert combine(FOUR[:3], "median").tolist() == [2.0, 20.0, -1.0]


def test_trimmed_drops_the_k_highest_and_lowest_per_coordinate():
    assert combine(FOUR, "trimmed:1").tolist() == [2.5, 15.0, -0.5]
    five = torch.cat([FOUR, torch.tensor([[4.0, 40.0, 2.0]])])
    assert combine(five, "trimmed:1").tolist() == [3.0, 20.0, 0.0]  # (2+3+4), (10+20+30), (-1+0+1)


def test_one_wild_bundle_moves_the_mean_but_not_the_robust_rules():
    honest = FOUR[:3].mean(dim=0)
    assert (combine(FOUR, "mean") - honest).abs().max() > 1000
    for rule in ("median", "trimmed:1"):
        assert (combine(FOUR, rule) - honest).abs().max() <= 5.0, rule


def test_a_rule_that_cannot_combine_so_few_contributions_says_so():
    with pytest.raises(ValueError, match="trimmed:2 cannot combine 4"):
        combine(FOUR, "trimmed:2")


def test_the_fault_spelling():
    assert parse_fault("1:noise:10", 4) == Fault(1, "noise", 10)
    assert parse_fault("0:flip", 2) == Fault(0, "flip", 1)
    assert parse_fault("", 2) is None
    for bad in ("4:noise", "1:melt", "1:noise:0", "x:flip", "1"):
        with pytest.raises(ConfigError, match="BUNDLE_BYZANTINE"):
            parse_fault(bad, 4)


def test_the_fault_applies_to_its_bundle_from_its_step_and_noise_is_reproducible():
    fault = Fault(2, "noise", 10)
    assert not fault.applies(2, 8) and fault.applies(2, 9) and not fault.applies(1, 20)
    a, b = torch.zeros(5), torch.zeros(5)
    fault.corrupt(a, seed=3, step=9)
    fault.corrupt(b, seed=3, step=9)
    assert torch.equal(a, b) and a.abs().sum() > 0
    flipped = torch.tensor([1.0, -2.0])
    Fault(0, "flip").corrupt(flipped, seed=0, step=0)
    assert flipped.tolist() == [-1.0, 2.0]
    scaled = torch.tensor([1.0, -2.0])
    Fault(0, "scale").corrupt(scaled, seed=0, step=0)
    assert scaled.tolist() == [100.0, -200.0]
