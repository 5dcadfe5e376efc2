"""The peer figures of docs/anchors.md, transcribed, as TFLOP/s per (mode, d, seqlen, causal).

docs/anchors.md measured every peer on our H200 (bf16, batch·seqlen = 16384, heads = 2048 / d). The
harness uses these figures for two things: the dashed "FA4 upstream" reference line in the plots,
and the bar for peers it cannot run in a JAX process (torch), since docs/design.md sets the bar for
fa4_jax at the best peer of each row. "–" (not measured) becomes None.
"""
from __future__ import annotations

# docs/anchors.md's ceiling: a bf16 8192³ matmul through JAX in the same run as its figures (790 on
# other days). bench_attention times the same matmul, so that a run's figures can be read against
# ANCHORS' on the same scale when the GPU's sustained clock differs between days.
MATMUL_TFLOPS = 732.0

# Column names in the order of docs/anchors.md's tables.
COLUMNS = ("fa4_upstream", "jax_cudnn", "torch_cudnn", "pallas_mgpu", "torch_fa2", "jax_xla")

# Columns that were not measured inside a JAX process: the harness cannot time these itself.
NON_JAX_COLUMNS = ("fa4_upstream", "torch_cudnn", "torch_fa2")

# d | seqlen | causal | one figure per COLUMNS entry.
_FWD_TABLE = """
64 1024 no 398 394 419 360 289 71
64 1024 yes 264 288 333 258 213 22
64 4096 no 501 438 451 435 306 81
64 4096 yes 440 406 417 387 281 24
64 16384 no 543 457 458 475 308 –
64 16384 yes 522 436 447 447 298 –
128 1024 no 544 516 562 508 328 120
128 1024 yes 336 356 429 374 246 39
128 4096 no 648 638 609 642 343 151
128 4096 yes 565 527 539 545 305 46
128 16384 no 677 607 618 634 349 –
128 16384 yes 623 548 577 612 321 –
256 1024 no 607 531 594 569 305 187
256 1024 yes 446 374 444 405 248 66
256 4096 no 700 653 653 682 315 257
256 4096 yes 637 557 558 561 283 85
256 16384 no 731 663 664 651 323 –
256 16384 yes 703 594 602 602 294 –
"""

_FWD_BWD_TABLE = """
64 1024 no 407 345 376 250 231 76
64 1024 yes 299 232 271 – 168 27
64 4096 no 504 419 436 299 280 88
64 4096 yes 455 365 387 – 246 32
64 16384 no 536 450 454 314 294 –
64 16384 yes 527 428 434 – 281 –
128 1024 no 482 417 446 353 251 136
128 1024 yes 294 291 335 – 187 52
128 4096 no 581 517 535 417 305 167
128 4096 yes 523 438 470 – 268 62
128 16384 no 637 552 562 438 319 –
128 16384 yes 613 531 537 – 312 –
256 1024 no 357 318 347 215 223 215
256 1024 yes 285 252 284 – 170 86
256 4096 no 428 406 425 239 263 281
256 4096 yes 386 369 385 – 234 118
256 16384 no 447 408 415 244 274 –
256 16384 yes 432 416 423 – 266 –
"""


def _parse(table: str) -> dict[tuple[int, int, bool], dict[str, float | None]]:
    rows = {}
    for line in table.strip().splitlines():
        d, seqlen, causal, *figures = line.split()
        assert len(figures) == len(COLUMNS), line
        rows[(int(d), int(seqlen), causal == "yes")] = {
            column: None if figure == "–" else float(figure)
            for column, figure in zip(COLUMNS, figures)
        }
    return rows


# mode -> (d, seqlen, causal) -> column -> TFLOP/s or None.
ANCHORS = {"fwd": _parse(_FWD_TABLE), "fwd_bwd": _parse(_FWD_BWD_TABLE)}


def anchor(mode: str, head_dim: int, seqlen: int, causal: bool, column: str) -> float | None:
    """One docs/anchors.md figure, or None when the row is not in ANCHORS or was not measured."""
    return ANCHORS[mode].get((head_dim, seqlen, causal), {}).get(column)


def best_non_jax_anchor(mode: str, head_dim: int, seqlen: int, causal: bool) -> float | None:
    """The best ANCHORS figure among peers the harness cannot run itself (FA4 upstream, torch)."""
    figures = [anchor(mode, head_dim, seqlen, causal, c) for c in NON_JAX_COLUMNS]
    figures = [f for f in figures if f is not None]
    return max(figures) if figures else None
