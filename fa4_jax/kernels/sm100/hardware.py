"""The Blackwell (sm_100a: B200, GB200) limits the kernels are sized against."""

# The most dynamic shared memory one sm_100 CTA may use (227 KB, as on sm_90).
SMEM_BYTES = 232448
# Multiprocessors of a B200: the LPT grid's section sizing assumes them. On a GPU with fewer
# SMs the schedule is still correct.
NUM_SMS = 148
# Tensor memory: 128 lanes x 512 columns of 32 bits per SM; an allocation is a power of two
# of at least 32 columns.
TMEM_COLUMNS = 512
TMEM_LANES = 128
# The 64K 32-bit registers of an SM, which setmaxnreg budgets share.
REGISTERS_PER_SM = 64 * 1024
# The named barriers a CTA has (barrier 0 is __syncthreads).
NAMED_BARRIERS = 16
