"""CPU tier: scripts/ncu_source_summary.py ranks a canned Nsight Compute source page right."""
import subprocess
import sys

from tests.scripts import SCRIPTS

SCRIPT = SCRIPTS / "ncu_source_summary.py"

# ncu's own lines first, then a header and one row per instruction (values with thousands commas).
PAGE = """\
==PROF== Connected to process 1
"# Address","Source","Warp Stall Sampling (All Samples)","L1 Wavefronts Shared Excessive","stall_long_sb","Instructions Executed"
"0x10","HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], RZ","300","0","0","1,000"
"0x20","STS.64 [R16], R152","1,200","8,388,608","0","2,000"
"0x30","FFMA R184, R184, UR14, -R16","500","0","450","3,000"
"""


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], input=PAGE, capture_output=True,
                          text=True, check=True).stdout.splitlines()


def test_hot_instructions_come_first_with_their_share_and_reasons():
    out = run("--top", "2")
    assert out[0] == "3 instructions, 2000 stall samples"
    assert "  L1 Wavefronts Shared Excessive: 8388608" in out
    assert "  stall_long_sb: 450" in out
    top = [line for line in out if line.startswith("  0x")]
    assert len(top) == 2  # --top
    assert top[0].startswith("  0x20  60.0%  STS.64") and "Excessive=8,388,608" in top[0]
    assert top[1].startswith("  0x30  25.0%  FFMA") and "stall_long_sb=450" in top[1]
    # Columns that are neither stalls nor wavefronts stay out of the table.
    assert not any("Instructions Executed" in line for line in out)


def test_a_page_without_stall_samples_is_an_error():
    proc = subprocess.run([sys.executable, str(SCRIPT)], input="==PROF== x\n\"a\",\"b\"\n",
                          capture_output=True, text=True)
    assert proc.returncode == 1 and "no stall-sampling column" in proc.stdout
