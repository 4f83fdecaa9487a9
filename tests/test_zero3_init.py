"""ZeRO-3 runs whose model was built under ``deepspeed.zero.Init``.

That is how a model larger than one rank's memory is built: each parameter is cut to the rank's partition as its
module is made, never whole (the harness checks it, and refuses the run otherwise). The benchmark's real checkpoints
are built this way. Its checkpoint is read bit-exact and restored at another DP size, where DeepSpeed's own load
holds every saved state bit for bit.
"""

from __future__ import annotations

import pytest

import ucp
from tests.support.checks import assert_every_state_equals_record, assert_reader_holds_every_state
from tests.support.fixtures import build, resume, universals_of
from ucp.harness import LoadSpec
from ucp.universal import open_universal

SOURCE = dict(dp=2, stage=3, dtype="bf16", zero_init=True)


@pytest.fixture(scope="module")
def universal(tmp_path_factory):
    return universals_of({"zero-init": SOURCE}, tmp_path_factory.mktemp("zero-init"))("zero-init")


@pytest.mark.slow
def test_a_run_built_under_zero_init_is_read_bit_exact(universal):
    with open_universal(universal) as reader:
        assert_reader_holds_every_state(reader, build(**SOURCE).record)


@pytest.mark.slow
def test_a_run_built_under_zero_init_restores_at_a_new_dp_bit_exact(universal, tmp_path):
    built = build(**SOURCE)
    ucp.write_native(universal, tmp_path / "n", dp=3, stage=3)
    after = resume(built, LoadSpec(str(tmp_path / "n")), dp=3, steps=0, name="after", work=tmp_path)
    assert_every_state_equals_record(after, built.record)
