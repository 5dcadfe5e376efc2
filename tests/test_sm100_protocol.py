"""The Blackwell forward's barrier protocol, as the kernel issues it: the kernel's own role
methods (kernels/sm100/fwd.py) recorded in plain Python (kernels/common/recording.py) and every
interleaving of their events and of the asynchronous arrivals searched
(kernels/common/protocol_model.py): TMA completions in any order across barriers, a role's
tcgen05.commits in issue order. No second description of the protocol exists to disagree with
the kernel; the mutation tests below edit the kernel's source and show the search catches it.
"""
import functools
import importlib.util
import inspect
import re
import sys
import time

import pytest

cutlass = pytest.importorskip("cutlass")  # the kernels' module imports the DSL

from fa4_jax.kernels.common import protocol_model, recording  # noqa: E402
from fa4_jax.kernels.common.protocol_model import ProtocolError  # noqa: E402
from fa4_jax.kernels.sm100 import fwd, menu as sm100, plan  # noqa: E402
from fa4_jax.kernels.sm100.plan import Role  # noqa: E402


def make_kernel(cls=fwd.FlashAttentionForwardSm100, head_dim=64, mask="none", **tuning):
    """A kernel object for a protocol (the head dim only sizes buffers: d64 leaves room for every
    ring depth, and q_stages=1 gives the one-stage protocol at any head dim)."""
    dims = (256, 256) if tuning.get("cta_pair") and tuning.get("q_stages") == 1 else (head_dim, head_dim)
    if tuning.get("cta_pair") and dims[0] == 64:
        dims = (128, 128)
    return cls(cutlass.BFloat16, *dims, mask, False, **tuning)


def record(kernel, tiles, **spec):
    specs = recording.RecordedTiles(tuple(recording.TileSpec(n, **spec) for n in tiles), local=kernel.local)
    return recording.record(kernel, kernel.role_calls(), specs, commit_roles=(Role.MMA,))


def search(kernel, tiles, events=None):
    events = events or record(kernel, tiles)
    return protocol_model.search(events, protocol_model.Barriers.of(plan.pipelines(kernel.config)),
                                 ctas=kernel.ctas, leader_only=(Role.MMA,))


def test_every_role_the_kernel_runs_is_recorded():
    for variant in sm100.MENU:
        kernel = make_kernel(head_dim=variant.head_dim, mask=variant.mask, **sm100.TUNINGS[variant.tuning]) \
            if variant.head_dim == variant.head_dim_v else None
        if kernel is None:
            continue
        roles = {a.role for a in kernel.roles.table} - {Role.IDLE}
        assert set(kernel.role_calls()) == roles, variant.name
        events = record(kernel, (2,))
        assert all(any(e[0] == "wait" for e in events[role]) for role in roles), variant.name


# Two stages (d <= 192): runs of one persistent CTA, at every shipped ring depth. A tile whose
# rows see no key (past a ragged entry's rows or keys, a split-KV chunk past them) is one block,
# fully masked: one-block tiles among longer ones.
TWO_STAGE_RUNS = [(1,), (2,), (3,), (1, 1), (2, 1), (1, 3), (1, 2, 1), (3, 1, 1)]


@pytest.mark.parametrize("kv_stages", sorted({c.kv_stages for c in plan.TILE_CONFIGS.values() if c.q_stages == 2}))
@pytest.mark.parametrize("tiles", TWO_STAGE_RUNS, ids=str)
def test_two_stages(kv_stages, tiles):
    search(make_kernel(kv_stages=kv_stages), tiles)


# One stage (d256): S double-buffered and issued two blocks ahead, O's rescale after PV0; runs
# long enough that each S buffer is reused and the ring wraps.
ONE_STAGE_RUNS = [(1,), (2,), (3,), (4,), (1, 1), (3, 1), (1, 3), (2, 1, 1), (1, 1, 1, 2)]


@pytest.mark.parametrize("kv_stages", [2, 3, 4])
@pytest.mark.parametrize("tiles", ONE_STAGE_RUNS, ids=str)
def test_one_stage(kv_stages, tiles):
    search(make_kernel(head_dim=128, q_stages=1, kv_stages=kv_stages), tiles)


@pytest.mark.parametrize("mask", ["causal", "local"])
def test_the_masked_softmax_loops(mask):
    # The first block, the right-masked, unmasked and (window) left-masked loops each run.
    kernel = make_kernel(mask=mask, kv_stages=2)
    for tiles in ((4,), (1, 4)):
        search(kernel, tiles)


# A CTA pair: the same roles in two CTAs, the leader's MMA warp issuing for both; each arrival
# on the barrier of the CTA the pipeline says. Pairs serve dense calls: every tile has keys.
@pytest.mark.parametrize("kv_stages, tiles, q_stages", [
    (2, (1,), 2), (5, (1,), 2), (6, (1,), 2), (2, (2,), 2), (2, (1, 1), 2),
    (4, (1,), 1), (2, (3,), 1), (4, (2,), 1), (2, (1, 1), 1)])
def test_cta_pair(kv_stages, tiles, q_stages):
    search(make_kernel(cta_pair=True, kv_stages=kv_stages, q_stages=q_stages), tiles)


def test_every_shipped_ring_depth_is_searched():
    two = {c.kv_stages for c in plan.TILE_CONFIGS.values() if c.q_stages == 2}
    one = {c.kv_stages for c in plan.TILE_CONFIGS.values() if c.q_stages == 1}
    assert one <= {2, 3, 4}
    pairs = {(c.kv_stages, c.q_stages) for c in plan.PAIR_TILE_CONFIGS.values()}
    assert pairs <= {(2, 2), (5, 2), (6, 2), (4, 1), (2, 1)}
    assert two  # searched at each depth by test_two_stages


# --- Hazards inside a role: which buffers its actions touch, against its own waits ------------

def kv_reads_outside_their_stage(mma_events):
    """GEMMs that read a K/V ring stage the MMA warp has not waited for, or has handed back."""
    held, bad = set(), []
    for event in mma_events:
        if event[:3] == ("wait", "KV", "full"):
            held.add(event[3])
        elif event[:3] == ("arrive", "KV", "empty"):
            held.discard(event[3])
        elif event[:2] == ("do", "s_gemm") and event[4] not in held:
            bad.append(event)
        elif event[:2] == ("do", "pv_gemm") and event[4] not in held:
            bad.append(event)
    return bad


def s_overwrites_unread_p(mma_events, q_stages):
    """S GEMMs into an S buffer whose P (from the previous S there) no P·V has read yet: one
    thread's MMAs run in order, so a P·V issued before the S GEMM reads the P first."""
    written, bad = set(), []
    for event in mma_events:
        if event[:2] == ("do", "s_gemm"):
            buffer = event[2]
            if buffer in written:
                bad.append(event)
            written.add(buffer)
        elif event[:2] == ("do", "pv_gemm"):
            written.discard(event[3])
    return bad


@pytest.mark.parametrize("tuning", [{"kv_stages": 2}, {"kv_stages": 2, "q_stages": 1}], ids=["two stages", "one stage"])
def test_the_gemms_read_only_what_the_mma_warp_holds(tuning):
    kernel = make_kernel(head_dim=128, **tuning)
    events = record(kernel, (3, 1, 1, 2))[Role.MMA]
    assert not kv_reads_outside_their_stage(events)
    assert not s_overwrites_unread_p(events, kernel.q_stages)
    # The checks can fail: without the P·V GEMMs every later S GEMM overwrites unread P, and
    # with each K/V stage handed back as soon as it is full every GEMM reads a stage it gave
    # back.
    assert s_overwrites_unread_p([e for e in events if e[:2] != ("do", "pv_gemm")], kernel.q_stages)
    released_early = []
    for event in events:
        if event[:3] == ("arrive", "KV", "empty"):
            continue
        released_early.append(event)
        if event[:3] == ("wait", "KV", "full"):
            released_early.append(("arrive", "KV", "empty", event[3], event[5] - 1, "commit"))
    assert kv_reads_outside_their_stage(released_early)


# --- Mutations of the kernel's own code --------------------------------------------------------

def mutant(*edits):
    """fwd.py with each edit applied, as the kernel class of a module of its own: an (old, new)
    text replacement (old must match exactly once, so an edit that no longer applies fails
    loudly), or a function of the source (`guard`)."""
    source = inspect.getsource(fwd)
    for edit in edits:
        if callable(edit):
            source = edit(source)
            continue
        old, new = edit
        assert source.count(old) == 1, f"the mutation no longer applies: {old!r}"
        source = source.replace(old, new)
    name = f"fa4_jax.kernels.sm100._mutant_{abs(hash(edits))}"
    spec = importlib.util.spec_from_loader(name, loader=None, origin=fwd.__file__)
    module = importlib.util.module_from_spec(spec)
    module.__file__ = fwd.__file__
    sys.modules[name] = module
    exec(compile(source, fwd.__file__, "exec"), module.__dict__)
    return module.FlashAttentionForwardSm100


def search_mutant(edits, tiles, **tuning):
    return search(make_kernel(mutant(*edits), **tuning), tiles)


def guard(start: str, end: str, condition: str, orelse: str = ""):
    """An edit that puts the lines of fwd.py from the one beginning `start` up to the one
    beginning `end` (each once in the file) under `if condition:`, with `orelse` (an else branch,
    indented like the if) after them."""
    def edit(source):
        assert source.count(start) == 1 and source.count(end) == 1, (start, end)
        i, j = source.index(start), source.index(end)
        block = source[i:j]
        indent = block[:len(block) - len(block.lstrip(" "))]
        body = "".join("    " + line if line.strip() else line for line in block.splitlines(True))
        return source[:i] + f"{indent}if {condition}:\n" + body + orelse + source[j:]
    return edit


# The keyless-tile defect as first shipped, written back into the kernel: a tile without keys
# (n_blocks = 0) skipped by the softmax, its Q loaded by the load warp, skipped by the MMA warp
# with its Q state advanced and no wait, and waited for by the correction, which staged the
# tile's zeros in Q's buffer and gave it back. (The kernel now runs such a tile as one fully
# masked block, tile_problem, so every role does the same work for it.)
ORIGINAL_KEYLESS_DEFECT = (
    guard("            self.load_block(sync, kv_state, res.tma_atom_k, src.k[None, last_block, 0], src.sk)",
          "            for stage in cutlass.range_constexpr(self.q_stages):\n                sync.acquire(\"Q\"",
          "n_blocks > 0"),
    guard("            if cutlass.const_expr(self.q_stages == 1):\n                kv_state, q_state, s_state, p_state",
          "\n    @action\n    @cute.jit\n    def mma_operands",
          "tile.n_blocks > 0",
          "            else:\n"
          "                for i in cutlass.range_constexpr(self.q_stages):\n"
          "                    q_state.advance()\n"),
    guard("        block = self.softmax_registers(stage, res)",
          "        return s_state, stats_state\n\n    @action\n    @cute.jit\n    def softmax_registers",
          "n_blocks > 0"),
    guard("            for i in cutlass.range_constexpr(self.q_stages):\n                self.release_o(sync, i, s_state)",
          "            for i in cutlass.range_constexpr(self.q_stages):\n                # Stage i's store",
          "n_blocks > 0",
          "            else:\n"
          "                landed = q_state.clone()\n"
          "                for i in cutlass.range_constexpr(self.q_stages):\n"
          "                    sync.wait(\"Q\", landed)\n"
          "                    landed.advance()\n"
          "                    self.store_final_stage(regs, tile, i, None)\n"),
)


@pytest.mark.parametrize("tuning", [{"kv_stages": 2}, {"kv_stages": 4}, {"kv_stages": 2, "q_stages": 1}],
                         ids=["two stages, 2 deep", "two stages, 4 deep", "one stage"])
def test_the_keyless_tile_defect_written_back_into_the_kernel_is_caught(tuning):
    with pytest.raises(ProtocolError, match=r"\(<Role.MMA: 'mma'>, 0\), \('wait', 'Q@0', 'full'.*passes with the barrier in phase"):
        search_mutant(ORIGINAL_KEYLESS_DEFECT, (0, 1), head_dim=128, **tuning)


def test_the_original_defect_passes_only_if_async_arrivals_keep_issue_order():
    # Why every check of its day passed: delivered in issue order, the keyless tile's Q lands
    # before the next tile's K, which the MMA warp waits for first.
    kernel = make_kernel(mutant(*ORIGINAL_KEYLESS_DEFECT), head_dim=128, kv_stages=2)
    events = record(kernel, (0, 1))
    in_order = {role: [e[:-1] + ("commit",) if e[0] == "arrive" and e[-1] == "tma" else e for e in role_events]
                for role, role_events in events.items()}
    search(kernel, (0, 1), in_order)
    with pytest.raises(ProtocolError):
        search(kernel, (0, 1), events)


@pytest.mark.parametrize("q_stages", [2, 1])
def test_every_tile_needs_a_key_block(q_stages):
    # The roles walk at least one block per tile (tile_problem runs a tile whose rows see no key
    # as one fully masked block): a tile of none would leave the MMA warp waiting for a V block
    # the load warp never loads.
    with pytest.raises(ProtocolError, match="deadlock"):
        search(make_kernel(head_dim=128, kv_stages=2, q_stages=q_stages), (1, 0, 1))


@pytest.mark.parametrize("edit, tiles, match", [
    # The MMA warp's wait for Q dropped: its S GEMM reads Q before it lands.
    (('''            sync.wait("Q", q_state)
            self.s_gemm(ops, i, i, k_state.index)''', '''            self.s_gemm(ops, i, i, k_state.index)'''), (1,), "before its data|phase|deadlock"),
    # The correction's release of O (S's empty side) dropped: the MMA warp waits forever.
    (('''                self.release_o(sync, i, s_state)
            s_state.advance()''', '''                pass
            s_state.advance()'''), (2,), "deadlock"),
    # The K/V ring released before the S GEMM that reads it.
    (('''        s_state.advance()
        sync.release("KV", k_state)
        for block''', '''        s_state.advance()
        for block'''), (3,), "deadlock|phase"),
], ids=["mma skips its Q wait", "correction keeps O", "K never released"])
def test_mutations_of_the_two_stage_kernel_are_caught(edit, tiles, match):
    with pytest.raises(ProtocolError, match=match):
        search_mutant((edit,), tiles, kv_stages=2)


def test_the_one_stage_softmax_overrunning_its_row_scale_is_caught():
    # Softmax no longer waits for the correction to read its previous row scale. (With two
    # stages the search finds this harmless: S_i's release by the correction keeps softmax
    # within a block of it. With one, softmax reads the next S buffer before that.)
    edit = ('''            sync.acquire(f"STATS{stage}", stats_state)
            self.publish_row_scale(stage, block)''', '''            self.publish_row_scale(stage, block)''')
    with pytest.raises(ProtocolError, match="phase"):
        search_mutant((edit,), (3,), head_dim=128, kv_stages=2, q_stages=1)


def test_the_one_stage_pv_wait_dropped_is_caught():
    # The correction rescaling O without waiting for the previous P·V to be done.
    edit = ('''                        sync.wait(f"PV{i}", pv_state)''', '''                        pass''')
    with pytest.raises(ProtocolError, match="before its data has arrived"):
        search_mutant((edit,), (3,), head_dim=128, kv_stages=2, q_stages=1)


def test_a_ring_too_shallow_for_the_kernel_order_deadlocks():
    # One K/V stage cannot hold K_j and V_j together.
    with pytest.raises(ProtocolError, match="deadlock"):
        search(make_kernel(kv_stages=1), (2,))


def test_a_pair_commit_that_misses_the_partner_is_caught():
    # K/V's release committed to the leader's barrier alone: the partner's load warp waits
    # forever for its ring to empty.
    kernel = make_kernel(cta_pair=True, kv_stages=2)
    barriers = protocol_model.Barriers.of(plan.pipelines(kernel.config))
    leader_only = protocol_model.Barriers(barriers.producers, barriers.consumers, barriers.full_at,
                                          {**barriers.empty_at, "KV": "leader"}, barriers.releases_filled)
    with pytest.raises(ProtocolError, match="deadlock|no phase"):
        protocol_model.search(record(kernel, (3,)), leader_only, ctas=2, leader_only=(Role.MMA,))


def test_the_recorder_refuses_what_it_cannot_follow():
    # A protocol method that decides on a value only the GPU knows, or calls the DSL itself.
    kernel = make_kernel(mutant(('''        n_blocks = tile.n_blocks
        sync.wait("KV", kv_state)''', '''        n_blocks = tile.n_blocks
        if tile.seqlen_k > 0:
            pass
        sync.wait("KV", kv_state)''')), kv_stages=2)
    with pytest.raises(recording.RecordingError, match=r"branches on \(tile.seqlen_k"):
        record(kernel, (1,))
    kernel = make_kernel(mutant(('''        n_blocks = tile.n_blocks
        sync.wait("KV", kv_state)''', '''        n_blocks = tile.n_blocks
        cute.arch.sync_warp()
        sync.wait("KV", kv_state)''')), kv_stages=2)
    with pytest.raises(recording.RecordingError, match="calls cute.arch"):
        record(kernel, (1,))
