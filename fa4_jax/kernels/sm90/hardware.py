"""The Hopper (sm_90a) limits the kernels are sized against."""

# The most dynamic shared memory one sm_90 CTA may use.
SMEM_BYTES = 227 * 1024
# Multiprocessors of an H100 SXM / H200: the persistent forward's grid. An ahead-of-time kernel
# cannot ask the device; on a GPU with fewer SMs the persistent grid is still correct, with a
# short second wave.
NUM_SMS = 132
# The 64K 32-bit registers of an SM, which setmaxnreg budgets share.
REGISTERS_PER_SM = 64 * 1024
# The named barriers a CTA has (barrier 0 is __syncthreads).
NAMED_BARRIERS = 16
