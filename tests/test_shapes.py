"""Every shape-suffixed name of the package uses only the tokens of titan_spec/shapes.py."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from titan_spec.shapes import LEGEND

PACKAGE = Path(__file__).resolve().parent.parent / "titan_spec"
SUFFIXED = re.compile(r"[a-z]\w*?_((?:[A-Z][a-z]*)+)")
TOKEN = re.compile(r"[A-Z][a-z]*")
HEADS = {"N", "Kv", "Gq", "Nf", "K"}
"""After a heads token, H (draft hidden) is a slip for Hd; K before a head dim is a slip for Kv."""
TORCHTITAN_NAMES = {("titan_spec/models/attention.py", n) for n in ("q_BLNH", "k_BLNH", "v_BLNH")}
"""torchtitan's names (H: head dim): its sharding configs key the inner attention's inputs by them."""


def _names(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            yield node.lineno, node.id
        elif isinstance(node, ast.arg):
            yield node.lineno, node.arg
        elif isinstance(node, ast.Attribute):
            yield node.lineno, node.attr


def unknown_tokens(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    """'file:line name (token)' for each suffixed name of path with a token not in LEGEND."""
    bad = []
    for line, name in _names(ast.parse(path.read_text(), filename=str(path))):
        m = SUFFIXED.fullmatch(name)
        if m is None or (str(path.relative_to(root)), name) in TORCHTITAN_NAMES:
            continue
        tokens = TOKEN.findall(m[1])
        unknown = [t for t in tokens if t not in LEGEND]
        heads = [i for i, t in enumerate(tokens) if t in HEADS]
        if heads and "H" in tokens[heads[0] :]:
            unknown.append("H after heads: Hd?")
        if "K" in tokens and {"H", "Hd"} & set(tokens[tokens.index("K") :]):
            unknown.append("K before a head dim: Kv?")
        if unknown:
            bad.append(f"{path.relative_to(root)}:{line} {name} ({', '.join(unknown)})")
    return sorted(set(bad))


def test_legend_is_one_meaning_per_token():
    assert len(LEGEND) > 30
    assert all(TOKEN.fullmatch(t) for t in LEGEND)
    assert LEGEND["Hd"].startswith("head dim") and LEGEND["Kv"].startswith("kv heads")
    assert LEGEND["K"].startswith("draft tokens")


def test_the_checker_catches_an_unknown_token(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("def f(q_TNHd, s_KGLM, k_TKHd, h_TNH):\n    out_BLZz = q_TNHd.attn_TX\n    Big_X = x_B1 = 1\n")
    assert unknown_tokens(f, tmp_path) == [
        "x.py:1 h_TNH (H after heads: Hd?)",
        "x.py:1 k_TKHd (K before a head dim: Kv?)",
        "x.py:1 s_KGLM (M)",
        "x.py:2 attn_TX (X)",
        "x.py:2 out_BLZz (Zz)",
    ]


def test_package_names_use_the_legend():
    bad = [b for p in sorted(PACKAGE.rglob("*.py")) for b in unknown_tokens(p)]
    assert not bad, "shape tokens not in titan_spec/shapes.py LEGEND:\n" + "\n".join(bad)


def test_shapes_is_a_leaf():
    tree = ast.parse((PACKAGE / "shapes.py").read_text())
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [m for m in imported if m.startswith("titan_spec")]
    users = [p for p in PACKAGE.rglob("*.py") if "titan_spec.shapes" in p.read_text() and p.name != "shapes.py"]
    assert not users, f"shapes.py is for tests and docs, imported at runtime by {users}"
