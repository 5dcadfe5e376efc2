"""CPU tier: scripts/ptxas_report.py reads ptxas -v's messages right (canned ptxas output)."""
from tests.scripts import load_script


MESSAGES = """\
ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized due to non wgmma instructions reading accumulator registers of  a wgmma between start and end of the pipeline stage in the function 'kernel_cutlass_kernel_fa4_jaxkernelssm90bwdFlashAttentionBackwardSm90_object_at__X'
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'kernel_cutlass_kernel_fa4_jaxkernelsbwd_preBackwardPreprocess_object_at__Y' for 'sm_90a'
ptxas info    : Function properties for kernel_cutlass_kernel_fa4_jaxkernelsbwd_preBackwardPreprocess_object_at__Y
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 21 registers, used 0 barriers
ptxas info    : Function properties for kernel_cutlass_kernel_fa4_jaxkernelssm90bwdFlashAttentionBackwardSm90_object_at__X
    128 bytes stack frame, 512 bytes spill stores, 128 bytes spill loads
ptxas info    : Used 168 registers, used 6 barriers
"""


def test_serialization_and_spills_are_reported_per_kernel():
    lines, serialized = load_script("ptxas_report").summarize(MESSAGES)
    assert serialized
    assert lines[0].startswith("(C7514) Potential Performance Loss") and "function" not in lines[0]
    assert "BackwardPreprocess: 0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in lines
    assert "BackwardSm90: 128 bytes stack frame, 512 bytes spill stores, 128 bytes spill loads" in lines
    assert "BackwardSm90: Used 168 registers, used 6 barriers" in lines


def test_a_clean_compile_is_not_reported_as_serialized():
    clean = "\n".join(line for line in MESSAGES.splitlines() if "C7514" not in line)
    lines, serialized = load_script("ptxas_report").summarize(clean)
    assert not serialized and len(lines) == 4


SASS = """\
        /*4ae0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;            /* 0x000080000000791b */
        /*4af0*/                   FMNMX R3, R24, R25, !PT ;                  /* 0x000000191803720b */
        /*4b00*/                   FMNMX R3, R3, R28, !PT ;                   /* 0x0000001c0303720b */
        /*4b10*/                   MUFU.EX2 R5, R4 ;                          /* 0x0000000400057308 */
        /*4b20*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;            /* 0x000080000000791b */
        /*4b30*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;            /* 0x000080000000791b */
        /*4b40*/                   FADD R1, R2, R3 ;                          /* 0x0000000302017221 */
        /*4b50*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;            /* 0x000080000000791b */
"""


def test_wgmma_wait_gaps_count_the_work_between_the_two_waits():
    # The first pair encloses two FMNMX and one MUFU; the second wait for all-but-one meets
    # another wait of its kind before any wait for all, so it has no gap.
    assert load_script("ptxas_report").wgmma_wait_gaps(SASS) == [("4ae0", 3, 1, 2)]
