"""Shared-memory wavefronts of the backward's dQ_partial stores into sdQ, by a bank model.

    python scripts/smem_bank_model.py

Each MMA thread stores its WGMMA accumulator (64 rows × `cols` fp32 per warp group) as 8-byte
pairs; a 64-bit store is served per half warp, and a half warp takes as many wavefronts as the
most addresses it puts in one of the 32 four-byte banks. sdQ is a 128-byte-swizzled tile (the
16-byte chunk index XORed with the 128-byte line index mod 8), so which line a tile row lands on
decides the conflicts. Printed: the wavefronts per warp group's hand-over for the identity
placement (the kernel's until session 9) and for rows paired (line 2·(r mod 32) + r div 32,
the tile-order path's since; fragment order, the default since session 10, stores each
thread's registers in its own order instead), against the ideal (bytes / 128 per half warp).
Nsight Compute's "L1 Wavefronts Shared Excessive" on the d128 kernel matched the identity line:
twice the ideal.
"""
ROWS = 64  # a warp group's WGMMA tile
ATOM_COLS = 32  # fp32 columns of a 128-byte swizzle atom


def byte_address(row: int, col: int, line_of) -> int:
    line = line_of(row)
    chunk = ((col % ATOM_COLS) // 4) ^ (line % 8)
    return (col // ATOM_COLS) * ROWS * 128 + line * 128 + chunk * 16 + (col % 4) * 4


def wavefronts(line_of, cols: int = 64) -> int:
    """Wavefronts of one warp group's stores: 4 warps × 2 row halves × cols / 8 column groups."""
    total = 0
    for warp in range(4):
        for row_half in (0, 8):
            for group in range(cols // 8):
                for half_warp in (0, 1):
                    words_per_bank = {}
                    for lane in range(16 * half_warp, 16 * half_warp + 16):
                        row = 16 * warp + lane // 4 + row_half
                        col = 8 * group + 2 * (lane % 4)
                        for element in (0, 1):
                            word = byte_address(row, col + element, line_of) // 4
                            words_per_bank.setdefault(word % 32, set()).add(word)
                    total += max(len(words) for words in words_per_bank.values())
    return total


def identity(row: int) -> int:
    return row


def paired(row: int) -> int:
    return 2 * (row % (ROWS // 2)) + row // (ROWS // 2)


def main() -> None:
    ideal = 4 * 2 * (64 // 8) * 2
    print(f"identity placement: {wavefronts(identity)} wavefronts")
    print(f"rows paired:        {wavefronts(paired)} wavefronts")
    print(f"ideal:              {ideal} wavefronts")


if __name__ == "__main__":
    main()
