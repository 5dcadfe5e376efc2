"""CPU tier: scripts/smem_bank_model.py, the bank model behind the sdQ store-conflict figures."""
from tests.scripts import load_script


def test_identity_rows_take_twice_the_ideal_and_paired_rows_the_ideal():
    model = load_script("smem_bank_model")
    ideal = 4 * 2 * 8 * 2  # warps × row halves × column groups × half warps, one wavefront each
    # Nsight Compute on the d128 kernel: excessive wavefronts equal to the ideal ones.
    assert model.wavefronts(model.identity) == 2 * ideal
    assert model.wavefronts(model.paired) == ideal


def test_every_row_lands_on_its_own_line():
    model = load_script("smem_bank_model")
    for line_of in (model.identity, model.paired):
        assert sorted(line_of(r) for r in range(model.ROWS)) == list(range(model.ROWS))
