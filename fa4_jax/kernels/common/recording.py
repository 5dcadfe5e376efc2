"""Runs a kernel's own role methods in plain Python and records what they synchronise on.

The methods marked `sync.protocol` run as written, with three things swapped under them: `Sync`
is a recorder (each wait, arrival, commit and TMA issue becomes an event of the role running),
pipeline states are Python twins of CUTLASS's `PipelineState` (the same index, phase and
count arithmetic), and the DSL's loop and static-branch helpers (`cutlass.range`,
`range_constexpr`, `const_expr`) are Python's. Methods marked `sync.action` are not run: the
call is logged with its integer arguments (the buffers it touches) and returns an `Opaque`
stand-in. The tile a role works on is given: how many key blocks it visits, and for the
softmax loops which of them take the mask.

Whatever a protocol method does beyond that fails loudly instead of being guessed: calling the
DSL (`cute.*`), branching on an `Opaque` value (a decision the recorder cannot see the kernel
make), or calling an unmarked method.

Events (tuples, what kernels/common/protocol_model.py consumes):
    ("wait", pipe, side, stage, parity, phases)   the wait passes once the barrier's phase
        parity differs from `parity` (mbarrier try_wait.parity); the role means it to pass
        after exactly `phases` completed phases (its use count says which)
    ("arrive", pipe, side, stage, round, how)     an arrival meant for phase `round`; how:
        "sync" (a thread's arrive), "tma" (a TMA load's bytes landing), "commit" (a
        tcgen05.commit's, when the MMAs issued before it complete)
    ("do", action, *ints)                         an action and its integer arguments
side is "full" (the producer's barrier) or "empty" (the consumers').
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import types

from fa4_jax.kernels.common.sync import ACTION, PROTOCOL


class RecordingError(AssertionError):
    """A protocol method did something the recorder cannot follow."""


class Opaque:
    """What an action returns, and every kernel resource a recorded role is handed: it takes
    any attribute, index, call or arithmetic, and refuses to decide a branch."""

    __slots__ = ("what",)

    def __init__(self, what: str):
        self.what = what

    def __repr__(self):
        return f"Opaque({self.what})"

    def __getattr__(self, name):
        return Opaque(f"{self.what}.{name}")

    def __getitem__(self, index):
        return Opaque(f"{self.what}[]")

    def __call__(self, *args, **kwargs):
        return Opaque(f"{self.what}()")

    def __bool__(self):
        raise RecordingError(f"a protocol method branches on {self.what}, which the recorder does not "
                             "model: compute the decision in an action, or from the tile's block counts")

    def __iter__(self):
        raise RecordingError(f"a protocol method iterates over {self.what}")

    def __index__(self):
        raise RecordingError(f"a protocol method uses {self.what} as a Python integer")


def _opaque_operator(name):
    def operator(self, *args):
        return Opaque(f"({self.what} {name} ...)")
    return operator


for _op in ("add", "radd", "sub", "rsub", "mul", "rmul", "floordiv", "rfloordiv", "truediv", "rtruediv",
            "mod", "rmod", "neg", "lt", "le", "gt", "ge", "eq", "ne", "and", "rand", "or", "ror"):
    setattr(Opaque, f"__{_op}__", _opaque_operator(_op))


class UserType(enum.Enum):
    Producer = "producer"
    Consumer = "consumer"


@dataclasses.dataclass
class RecordedState:
    """CUTLASS's PipelineState in Python: uses of a ring of `stages`, counted. A producer starts
    at phase 1 (its first wait on a fresh empty barrier passes), a consumer at phase 0."""

    stages: int
    count: int
    index: int
    phase: int
    user: UserType

    def advance(self):
        self.count += 1
        self.index += 1
        if self.index == self.stages:
            self.index = 0
            self.phase ^= 1

    def clone(self) -> "RecordedState":
        return dataclasses.replace(self)

    @property
    def round(self) -> int:
        """Which use of its stage this is (0 for the first)."""
        return self.count // self.stages


def _make_pipeline_state(user, stages: int) -> RecordedState:
    producer = getattr(user, "name", str(user)).endswith("Producer")
    return RecordedState(stages, 0, 0, 1 if producer else 0, UserType.Producer if producer else UserType.Consumer)


def _dsl_range(*args, **options):
    return range(*args)


_CUTLASS = types.SimpleNamespace(range=_dsl_range, range_constexpr=range, const_expr=lambda x: x,
                                 Constexpr=object, Int32=int, Float32=float, Boolean=bool)


class _Forbidden:
    """A DSL module seen from a protocol method: any use is an error that says what to move."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr):
        raise RecordingError(f"a protocol method calls {self._name}.{attr}: move that into an action")


class RecordingSync:
    """`sync.Sync` for one role: every call appends that role's event."""

    def __init__(self, events: list, commits: bool):
        self.events = events
        # The MMA warp's arrivals are tcgen05.commits (they land when its earlier MMAs are done).
        self.how = "commit" if commits else "sync"

    def _wait(self, name, side, state, after_own_use):
        self.events.append(("wait", name, side, state.index, state.phase, state.round + after_own_use))

    def acquire(self, name, state, tx_bytes=None):
        # A producer's use r waits for the consumers' round r - 1 (none for the first).
        self._wait(name, "empty", state, 1 if state.user is UserType.Consumer else 0)

    def wait(self, name, state):
        self._wait(name, "full", state, 1 if state.user is UserType.Consumer else 0)

    def wait_empty(self, name, state):
        self._wait(name, "empty", state, 1 if state.user is UserType.Consumer else 0)

    def release(self, name, state):
        self.events.append(("arrive", name, "empty", state.index, state.round, self.how))

    def commit(self, name, state):
        self.events.append(("arrive", name, "full", state.index, state.round, self.how))

    def tma_load(self, name, state, atom, src, dst):
        self.events.append(("arrive", name, "full", state.index, state.round, "tma"))

    def release_after_bulk_store(self, name, state, stores_after, thread):
        self.events.append(("arrive", name, "empty", state.index, state.round, "sync"))

    def tail(self, name, state):
        for _ in range(state.stages):
            self.acquire(name, state)
            state.advance()


@dataclasses.dataclass(frozen=True)
class TileSpec:
    """A recorded tile: the key blocks it visits, and how many of them after the first (which
    always takes the mask) the softmax's right-masked and left-masked loops take; the rest run
    unmasked. Block indices are 0 .. blocks - 1, visited from the highest."""

    blocks: int
    right_masked: int = 1
    left_masked: int = 1


class _StageBlocks:
    """The softmax's block bounds (kernels/common/block_info.py's), for a TileSpec."""

    def __init__(self, spec: TileSpec, local: bool):
        rest = max(spec.blocks - 1, 0)
        self._right = min(spec.right_masked, rest)
        self._left = min(spec.left_masked, rest - self._right) if local else 0
        self._blocks = spec.blocks

    def n_block_min_right_masked(self, *args):
        return self._blocks - 1 - self._right

    def n_block_min_unmasked(self, *args):
        return self._left


class RecordedTile:
    """A tile as the protocol sees it: its block count, and its first block index 0; anything
    else (rows, heads, lengths) is Opaque."""

    def __init__(self, spec: TileSpec, local: bool):
        self.n_blocks = spec.blocks
        self.n_block_min = 0
        self.stage_blocks = _StageBlocks(spec, local)

    def __getattr__(self, name):
        return Opaque(f"tile.{name}")


@dataclasses.dataclass(frozen=True)
class RecordedTiles:
    """What a role is handed for its tiles (the kernel's `_Tiles`)."""

    specs: tuple
    local: bool

    @property
    def count(self) -> int:
        return len(self.specs)

    def problem(self, index: int) -> RecordedTile:
        return RecordedTile(self.specs[index], self.local)


class _View:
    """The kernel as its protocol methods see it while recording: protocol methods rebound to
    the recording globals, actions logged, settings read from the kernel."""

    def __init__(self, kernel, recorder: "_Recorder"):
        object.__setattr__(self, "_kernel", kernel)
        object.__setattr__(self, "_recorder", recorder)

    def __getattr__(self, name):
        kernel, recorder = self._kernel, self._recorder
        attribute = getattr(type(kernel), name, None)
        kind = getattr(attribute, "fa4_sync_kind", None)
        if kind == PROTOCOL:
            return types.MethodType(recorder.rebound(attribute), self)
        if kind == ACTION:
            return functools.partial(recorder.action, name)
        if name in vars(kernel):
            return vars(kernel)[name]
        if callable(attribute):
            raise RecordingError(f"a protocol method calls {type(kernel).__name__}.{name}, which is marked "
                                 "neither protocol nor action")
        if attribute is not None:
            return attribute
        raise RecordingError(f"{type(kernel).__name__} has no setting {name} (the kernel sets it at compile "
                             "time? then only actions may read it)")

    def __setattr__(self, name, value):
        raise RecordingError(f"a protocol method sets self.{name}")


_DSL_MODULES = ("cute", "cpasync", "tcgen05", "nvvm", "utils", "sm100_utils", "cuda")


class _Recorder:
    def __init__(self):
        self.events: list | None = None
        self._rebound: dict = {}

    def action(self, name, *args, **kwargs):
        values = [a for a in (*args, *kwargs.values()) if isinstance(a, int) and not isinstance(a, bool)]
        self.events.append(("do", name, *values))
        return Opaque(f"{name}()")

    def rebound(self, method):
        """`method`'s undecorated code with the recording globals (the DSL preprocessor may have
        replaced the code object it runs; the original is kept beside it)."""
        if method not in self._rebound:
            raw = getattr(method, "__wrapped__", method)
            code = getattr(raw, "_original_code", raw.__code__)
            self._rebound[method] = types.FunctionType(code, self._globals(raw.__globals__), raw.__name__,
                                                       raw.__defaults__, raw.__closure__)
        return self._rebound[method]

    def _globals(self, module_globals: dict) -> dict:
        shim = dict(module_globals)
        shim["cutlass"] = _CUTLASS
        shim["pipeline"] = types.SimpleNamespace(
            make_pipeline_state=_make_pipeline_state,
            PipelineUserType=module_globals["pipeline"].PipelineUserType)
        for name in ("Int32", "Float32", "Boolean"):
            if name in shim:
                shim[name] = getattr(_CUTLASS, name)
        for name in _DSL_MODULES:
            if name in shim:
                shim[name] = _Forbidden(name)
        for name, value in module_globals.items():
            if getattr(value, "fa4_sync_kind", None) == ACTION and not isinstance(value, type):
                shim[name] = functools.partial(self.action, name)
        return shim


def record(kernel, role_calls: dict, tiles: RecordedTiles, commit_roles=()) -> dict:
    """Each role's events for one CTA that computes `tiles`: role -> list of events.

    role_calls: role -> (method name, leading static arguments): the calls the kernel entry
    makes, each followed by the role's resources (Opaque here), its Sync and its tiles.
    commit_roles: the roles whose arrivals are tcgen05.commits."""
    recorder = _Recorder()
    view = _View(kernel, recorder)
    out = {}
    for role, (method, static) in role_calls.items():
        recorder.events = out[role] = []
        sync = RecordingSync(out[role], commits=role in commit_roles)
        getattr(view, method)(*static, Opaque(f"{method} resources"), sync, tiles)
    return out
