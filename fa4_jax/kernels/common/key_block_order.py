"""Which key block of which (kv head, batch) a backward CTA takes: the backward's LPT order.

The backward launches one CTA per (key block, kv head, batch), grid (key_blocks, heads_kv,
batch), and the hardware dispatches CTAs in blockIdx order (x fastest) as SMs free up. Read off
blockIdx directly, a head's key blocks go out together and the heads one after the other. Under
a causal mask key block n sees the query rows from its diagonal down, so its work falls with n:
the last head's heaviest key blocks start at the end and run alone. Simulated on 132 SMs (list
scheduling in dispatch order, 16k tokens), that tail costs 7% at 1k-4k tokens at d128 and d256
(3% at d64's 128-row query blocks), 1% at 16k.

The order here cuts the (batch, kv head) pairs into sections of `num_sms // key_blocks` of
them (at least 1), about one wave of CTAs, and within a section dispatches key block 0 of every
pair, then key block 1, and so on: heaviest first across the section (longest-processing-time
first), while the CTAs that run together still read the Q and dO of a few heads, which stay in
L2 (at d128: 132·128 key positions' worth of Q, dO and the fp32 dQ accumulator, ~17 MB, whatever
the length). The same simulation puts the tail at 0-2%.

Deterministic calls keep blockIdx's order: their dQ adds wait on CTAs dispatched earlier, which
the order of a head's key blocks guarantees (FlashAttentionBackwardSm90.kernel).

`decode` is straight-line integer arithmetic on non-negative values, so it runs on DSL Int32s in
the kernel and on Python ints in the CPU test of the order.
"""
import dataclasses

import cutlass


@dataclasses.dataclass(frozen=True)
class KeyBlockOrder:
    def decode(self, cta, key_blocks, heads_kv, batch, num_sms):
        """(key block, kv head, batch index) of dispatch position `cta` of
        key_blocks · heads_kv · batch."""
        pairs = heads_kv * batch
        section_pairs = cutlass.max(num_sms // key_blocks, 1)
        section = cta // (section_pairs * key_blocks)
        first_pair = section * section_pairs
        # The last section may hold fewer pairs.
        pairs_here = cutlass.min(section_pairs, pairs - first_pair)
        rest = cta - first_pair * key_blocks
        n_block = rest // pairs_here
        pair = first_pair + rest - n_block * pairs_here
        batch_idx = pair // heads_kv
        return n_block, pair - batch_idx * heads_kv, batch_idx
