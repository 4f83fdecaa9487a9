"""ZeRO-3 at DeepSpeed's default ``stage3_param_persistence_threshold`` (100000 elements).

The other ZeRO-3 tests set the threshold to 0, so every parameter is partitioned; a real run keeps the parameters
under the threshold (biases, norms: here all of them) whole on every rank between steps. Its checkpoint is read
bit-exact, restored at another DP size (natively and live) bit-exact after the load, and resumed at the same DP
bit-identically to DeepSpeed's own resume.
"""

from __future__ import annotations

import pytest

import ucp
from tests.support.checks import assert_every_state_equals_record, assert_reader_holds_every_state, assert_same_training
from tests.support.fixtures import build, resume, universals_of
from ucp.harness import LoadSpec
from ucp.universal import open_universal

SOURCE = dict(dp=2, stage=3, dtype="bf16", persistence_threshold=100_000)


@pytest.fixture(scope="module")
def universal(tmp_path_factory):
    return universals_of({"persistent": SOURCE}, tmp_path_factory.mktemp("persistent"))("persistent")


@pytest.mark.slow
def test_a_run_with_persistent_parameters_is_read_bit_exact(universal):
    record = build(**SOURCE).record
    assert set(record["params"]) < set(record["persistent"]), "parameters were partitioned: the test proves nothing"
    with open_universal(universal) as reader:
        assert_reader_holds_every_state(reader, record)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["native", "ucp"])
def test_restore_at_a_new_dp_loads_every_state_bit_exact(universal, kind, tmp_path):
    built = build(**SOURCE)
    path = universal
    if kind == "native":
        path = tmp_path / "n"
        ucp.write_native(universal, path, dp=3, stage=3)
    after = resume(built, LoadSpec(str(path), kind=kind), dp=3, steps=0, name="after", work=tmp_path)
    assert_every_state_equals_record(after, built.record)


@pytest.mark.slow
def test_same_dp_restore_resumes_bit_identically_to_deepspeeds_own_resume(universal, tmp_path):
    built = build(**SOURCE)
    ucp.write_native(universal, tmp_path / "n", dp=2, stage=3)
    reference = resume(built, LoadSpec(str(built.path)), name="native", work=tmp_path)
    assert_same_training(reference, resume(built, LoadSpec(str(tmp_path / "n")), name="ucp", work=tmp_path))
