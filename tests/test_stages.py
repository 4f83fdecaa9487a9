"""Pipeline stage partitions (ucp.model.stages) against DeepSpeed's own partition functions."""

from __future__ import annotations

import random

import pytest

from ucp.model.stages import balanced_parts, uniform_parts

ds_utils = pytest.importorskip("deepspeed.runtime.utils")


def test_uniform_parts_are_deepspeeds():
    for layers in range(1, 30):
        for stages in range(1, 9):
            assert uniform_parts(layers, stages) == ds_utils.partition_uniform(layers, stages), (layers, stages)


def test_balanced_parts_are_deepspeeds_ties_and_empty_layers_included():
    rng = random.Random(0)
    for _ in range(2000):
        weights = [rng.choice([0, 0, 1, 2, 3, 5, 8, 100, 1000]) for _ in range(rng.randint(1, 14))]
        stages = rng.randint(1, 6)
        expected = [int(x) for x in ds_utils.partition_balanced(weights, stages)]
        assert balanced_parts(weights, stages) == expected, (weights, stages)
