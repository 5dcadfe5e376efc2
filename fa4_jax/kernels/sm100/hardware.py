"""The Blackwell (the sm_100f family: B200, GB200, B300) limits the kernels are sized against."""

# The most dynamic shared memory one sm_100 CTA may use (227 KB, as on sm_90).
SMEM_BYTES = 232448
# Multiprocessors of a B200: what a persistent grid would be sized by (the shipped schedules,
# one tile per CTA, do not depend on it), and what the static comparison tells upstream's kernel.
NUM_SMS = 148
# Tensor memory: 128 lanes (one per query row) x 512 columns of 32 bits per SM; an allocation
# is a power of two of at least 32 columns.
TMEM_COLUMNS = 512
# The 64K 32-bit registers of an SM, which setmaxnreg budgets share.
REGISTERS_PER_SM = 64 * 1024
# The named barriers a CTA has (barrier 0 is __syncthreads).
NAMED_BARRIERS = 16
