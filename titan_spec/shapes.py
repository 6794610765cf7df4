"""The shape letters of titan_spec: one legend for every file.

A tensor's name ends in ``_`` and its shape, one token per dim, each token a capital or a
capital then lowercase letters, so ``q_TNHd`` splits as T, N, Hd with ``[A-Z][a-z]*``.
Digits stand for themselves (``out_B1NHd``: a dim of size 1). A token means the same in
every file; where it says "the batch at hand", the function's docstring says which rows.

    B   rows of the batch at hand: packed training rows, a microbatch's, or the requests decoded
    L   tokens per row of that batch: a packed row's length; in a cached forward, each row's
        new tokens (verify: K + 1)
    T   packed tokens: the flat rows of a token stream (a packed batch's B*L; under context
        parallelism, this rank's)
    Tg  rows of the whole stream: the global (unsharded) one under context parallelism, else T
    R   this rank's rows of a zigzag-sharded stream, pads included (T without context parallelism)
    Rh  R, then the halo rows of every rank (models/draft/halo.py)
    Tr  routed token rows of an MoE layer (tokens x top-k, expert-sorted)
    V   target vocab
    Vd  draft vocab
    D   model dim: the target's hidden size (what its taps carry)
    H   draft hidden size
    C   tap layers
    Y   decoder layers (of a KV cache)
    N   query heads
    Kv  kv heads (GQA: N % Kv == 0)
    Gq  query heads per kv head (N // Kv)
    Nf  heads of a fused projection (q + k + v, or q + k)
    Hd  head dim
    Fq  rotary frequencies (Hd / 2)
    F   feed-forward hidden width (a dense MLP's intermediate size; in an MoE, an expert's)
    E   experts
    O   output features of a fused projection
    I   input features of a fused projection
    Sl  cache slots (slot == position; also the positions of a rotary table)
    K   draft tokens per round
    S   steps of the draft's loss (EAGLE-3: TTT steps; DFlash: a block's J - 1 loss positions; DSpark: its J)
    Mr  rank of a DSpark draft's Markov head
    Sb  TTT branch steps so far (0 .. S - 1)
    J   rows of a DFlash block (draft.dflash block_size)
    A   DFlash blocks (anchors)
    Q   query rows of the DFlash blocks of a call (A x J, flattened)
    Lq  query rows of one attention block (models/attention_blocks.py)
    Lk  key rows of one attention block
    Pt  partial attention results merged by log-sum-exp
    P   prompts (this rank's, of one round)
    Pa  prompts of every round generated so far this step (dynamic sampling)
    G   group size: completions per prompt
    Lp  tokens of the longest prompt (a right-padded prompt batch)
    Sq  completions (sequences) of a batch (index 0 may stand for the rows of none)

Nothing imports this module at runtime; tests/test_shapes.py checks every suffixed name of
the package against ``LEGEND``.
"""

from __future__ import annotations

import re

__all__ = ["LEGEND"]


def _parse(doc: str) -> dict[str, str]:
    """The table's rows: a line '    TOKEN  meaning', continued by lines indented further."""
    rows: dict[str, str] = {}
    last = None
    for line in doc.splitlines():
        m = re.fullmatch(r"    ([A-Z][a-z]*) +(\S.*)", line)
        if m:
            if m[1] in rows:
                raise ValueError(f"shape token {m[1]} has two meanings")
            last, rows[m[1]] = m[1], m[2]
        elif last and line.startswith("        ") and line.strip():
            rows[last] += " " + line.strip()
        else:
            last = None
    return rows


LEGEND: dict[str, str] = _parse(__doc__ or "")
"""Token -> meaning, read from the table above (the docstring is the one source)."""
