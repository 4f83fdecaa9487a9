"""ZeRO++ hierarchical partitioning (``zero_hpz_partition_size``) on real DeepSpeed ZeRO-3 runs.

hpZ keeps a secondary copy of the bf16 weights within each group of ``hpz`` ranks; DeepSpeed 0.19.8 saves
none of it, so the rank files are ordinary ZeRO-3 files over all ranks. Read bit-exact, restored into engines
with and without hpZ at other DP sizes (live and native), resumed bit-identically to DeepSpeed's own resume. The
quantized ZeRO++ parts (``zero_quantized_weights``, ``zero_quantized_gradients``) need CUDA kernels: not run here.
"""

from __future__ import annotations

import pytest

import ucp
from tests.support.checks import assert_every_state_equals_record, assert_reader_holds_every_state, assert_same_training
from tests.support.fixtures import build, resume
from ucp.harness import LoadSpec
from ucp.universal import open_universal

SOURCE = dict(dp=4, stage=3, dtype="bf16", hpz=2)


@pytest.fixture(scope="module")
def universal(tmp_path_factory):
    out = tmp_path_factory.mktemp("hpz") / "u"
    ucp.to_universal(build(**SOURCE).path, out)
    return out


@pytest.mark.slow
def test_an_hpz_run_reaches_the_universal_directory_bit_exact(universal):
    record = build(**SOURCE).record
    assert record["hpz_groups"] == 2, "the run did not partition hierarchically: the test would prove nothing"
    with open_universal(universal) as reader:
        assert_reader_holds_every_state(reader, record)


@pytest.mark.slow
@pytest.mark.parametrize("dp, hpz", [(6, 3), (2, 0)], ids=["dp6-hpz3", "dp2-plain"])
@pytest.mark.parametrize("kind", ["ucp", "native"])
def test_restore_at_a_new_dp_loads_every_state_bit_exact(universal, kind, dp, hpz, tmp_path):
    built = build(**SOURCE)
    path = universal
    if kind == "native":
        path = tmp_path / "n"
        ucp.write_native(universal, path, dp=dp, stage=3)
    after = resume(built, LoadSpec(str(path), kind=kind), dp=dp, steps=0, name="after", work=tmp_path, hpz=hpz)
    assert after["hpz_groups"] == (dp // hpz if hpz else 1)
    assert_every_state_equals_record(after, built.record)


@pytest.mark.slow
def test_same_dp_restore_resumes_bit_identically_to_deepspeeds_own_resume(universal, tmp_path):
    built = build(**SOURCE)
    ucp.write_native(universal, tmp_path / "n", dp=4, stage=3)
    reference = resume(built, LoadSpec(str(built.path)), name="native", work=tmp_path)
    assert_same_training(reference, resume(built, LoadSpec(str(tmp_path / "n")), name="ucp", work=tmp_path))
    assert_same_training(reference, resume(built, LoadSpec(str(universal), kind="ucp"), name="live", work=tmp_path))
