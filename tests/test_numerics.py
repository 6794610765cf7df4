"""The comparison helpers of tests/numerics.py hold their own claims, and tests that compare
weights read from a run's files use them (issue 35: a fixed tolerance on weights after AdamW
steps passed on one CPU and failed on another)."""

import ast
import os

import pytest
import torch

from numerics import assert_same_draft_export

TESTS = os.path.dirname(os.path.abspath(__file__))
LR, STEPS = 3e-3, 3


def _adamw_run(grads_per_step):
    """AdamW from fixed weights, one gradient per step (a dict of tensors)."""
    torch.manual_seed(0)
    w = {"fc.weight": torch.randn(48, 96) * 0.1, "norm.weight": torch.ones(96)}
    params = {k: torch.nn.Parameter(v.clone()) for k, v in w.items()}
    opt = torch.optim.AdamW(params.values(), lr=LR, weight_decay=0.01)
    for grads in grads_per_step:
        for k, p in params.items():
            p.grad = grads[k].clone()
        opt.step()
    return {**{k: p.detach().clone() for k, p in params.items()}, "d2t": torch.arange(8)}


def _shard_grads(order, drop=None):
    """One step's gradient as the sum of 4 data-parallel shards' fp32 partial gradients, added
    in ``order`` (another layout reduces in another order). Row 0 of fc.weight gets shards that
    cancel to rounding: its true gradient is ~0, so Adam's normalised update flips sign with
    the rounding noise (the case assert_adam_weights_close exists for)."""
    g = torch.Generator().manual_seed(1)
    shards = [
        {"fc.weight": torch.randn(48, 96, generator=g), "norm.weight": torch.randn(96, generator=g)} for _ in range(4)
    ]
    shards[1]["fc.weight"][0] = -shards[0]["fc.weight"][0] * (1 + 1e-7)
    shards[3]["fc.weight"][0] = -shards[2]["fc.weight"][0]
    out = {}
    for k in shards[0]:
        acc = torch.zeros_like(shards[0][k])
        for i in order:
            if i != drop:
                acc = acc + shards[i][k] / 4
        out[k] = acc
    return out


def test_the_adam_export_bound_takes_rounding_and_catches_a_dropped_shard_and_a_skipped_step():
    want = _adamw_run([_shard_grads((0, 1, 2, 3))] * STEPS)
    other_order = _adamw_run([_shard_grads((3, 1, 2, 0))] * STEPS)
    assert not all(torch.equal(other_order[k], want[k]) for k in want)  # rounding did move something
    assert_same_draft_export(other_order, want, LR, STEPS, "other reduction order")
    with pytest.raises(AssertionError):  # a layout that loses a shard's gradient
        assert_same_draft_export(_adamw_run([_shard_grads((0, 1, 2, 3), drop=2)] * STEPS), want, LR, STEPS)
    with pytest.raises(AssertionError):  # a layout that skips one optimizer step
        assert_same_draft_export(_adamw_run([_shard_grads((0, 1, 2, 3))] * (STEPS - 1)), want, LR, STEPS)
    wrong_map = dict(other_order, d2t=torch.arange(8).flip(0))
    with pytest.raises(AssertionError):  # the vocabulary map is exact
        assert_same_draft_export(wrong_map, want, LR, STEPS)


# --- the guard: weights read from a run's files are compared with a derived bound ----------

_TOLERANT = ("assert_close", "allclose", "isclose")
MARK = "# tolerance:"


def _fixed_tolerance_calls(tree: ast.AST):
    """Calls of torch's assert_close / allclose / isclose with a nonzero literal atol or rtol,
    or with neither (torch's dtype defaults, also fixed)."""
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _TOLERANT):
            continue
        if not (isinstance(node.func.value, ast.Attribute | ast.Name)):
            continue
        base = ast.unparse(node.func.value)
        if base not in ("torch", "torch.testing", "math"):
            continue
        tols = {kw.arg: kw.value for kw in node.keywords if kw.arg in ("atol", "rtol", "abs_tol", "rel_tol")}
        exact = tols and all(isinstance(v, ast.Constant) and v.value == 0 for v in tols.values())
        if not exact:
            yield node.lineno


def _reads_run_weights(source: str) -> bool:
    return "load_file(" in source or "safe_open(" in source


def test_tests_that_read_weights_from_files_compare_them_with_a_stated_tolerance():
    """In a test file that reads weights from safetensors files (a run's export, checkpoint or
    HF directory), every comparison with a fixed float tolerance states why that tolerance
    holds: a ``# tolerance:`` comment on its line or up to 3 lines above (e.g. "one forward of the
    same weights, fp32 GEMMs in another blocking" or "plain SGD, one step: no Adam sign flip"),
    or it goes through tests/numerics.py (whose helpers derive their bounds). Weights after
    Adam(W) steps in two layouts need assert_adam_weights_close / assert_same_draft_export."""
    missing = []
    for root in (TESTS, os.path.join(TESTS, "helpers")):
        for name in sorted(os.listdir(root)):
            if not name.endswith(".py") or name in ("numerics.py", "test_numerics.py"):
                continue
            path = os.path.join(root, name)
            source = open(path).read()
            if not _reads_run_weights(source):
                continue
            lines = source.splitlines()
            for ln in _fixed_tolerance_calls(ast.parse(source)):
                near = "".join(lines[max(0, ln - 4) : ln])  # its line or the 3 above (one comment, a block)
                if MARK not in near:
                    missing.append(f"{os.path.relpath(path, TESTS)}:{ln}: {lines[ln - 1].strip()}")
    assert not missing, (
        "fixed tolerances without a reason (add '# tolerance: why' or use tests/numerics.py):\n" + "\n".join(missing)
    )


def test_the_guard_sees_an_unmarked_tolerance():
    src = "w = load_file(p)\ntorch.testing.assert_close(w['a'], ref, atol=1e-5, rtol=1e-4)\n"
    assert list(_fixed_tolerance_calls(ast.parse(src))) == [2]
    assert list(_fixed_tolerance_calls(ast.parse("torch.testing.assert_close(a, b, atol=0, rtol=0)"))) == []
    assert list(_fixed_tolerance_calls(ast.parse("torch.testing.assert_close(a, b)"))) == [1]
