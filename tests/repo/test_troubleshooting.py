"""docs/troubleshooting.md covers every error zero raises on purpose, and the docs' relative links resolve.

Every ``raise ValueError/RuntimeError/NotImplementedError(message)`` in ``zero/`` whose message is a string or
f-string literal (or a module-level string constant, ``CONSTANT.format(...)``, a ``messages[...]`` table in the
same function, or a call to a function in ``zero/`` that returns such a literal) gives one distinctive phrase:
its longest constant fragment, cut at a word boundary to at most ``MAX_PHRASE`` characters. Each phrase must
appear in docs/troubleshooting.md, so a new error without an entry there fails here. Parsing only, no imports.
"""

import ast
import re
import string
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGE = DOCS / "troubleshooting.md"
KINDS = {"ValueError", "RuntimeError", "NotImplementedError"}
MAX_PHRASE = 60
MIN_PHRASE = 12

# Raises that need no entry, by phrase (or by "path:function" where the message is not a literal). Keep it short.
NOT_LISTED = {
    # internal invariants (assert-like): the public API cannot reach them with any input
    "was read while released": "flat_buffer.py: 'zero internal error', a released buffer read",
    "bad sizes: numel=…, num_shards=…, align=…": "layout.py: arithmetic on sizes the partition computed",
    "shard … out of range for … shards": "layout.py: a shard index the runtime computed",
    "numels and keys must have the same length": "layout.py: lists the partition built together",
    "bucket_cap must be >= 1 element, got …": "layout.py: the partition passes max(1, ...)",
    "parameter … has no elements": "layout.py: partition.py refuses an empty parameter first, by name",
    "sample marks in the profiler's record for … samples": "allocator.py: its own marks vs. its record",
    "the metadata key … is zero's own": "tensorfile.write: metadata keys are zero's own code's",
    "tensor file keys must be unique and not '__metadata__'": "tensorfile.write: keys are zero's own code's",
    "…: got … …, expected … …": "tensorfile.write: a tensor against the spec its caller made for it",
    # the message is not a literal at the raise; its text is checked where it is made
    "zero/runtime/buffers/sharded_param.py:convert_or_refuse": "always cast_after_wrapping(...), checked at bucket.py",
    "zero/runtime/gathering/gatherer.py:wait": "a failed collective's own error plus the unit-order warning",
    "zero/estimator/configuration.py:priced_config": "pydantic's field error, named by the field (ZeroConfig's)",
    "zero/estimator/configuration.py:raise_rule": "ZeroConfig's own rule, re-raised without pydantic's framing "
                                                  "(listed where ZeroConfig raises it)",
}


def _normalize(text: str) -> str:
    return re.sub(r"\s+", " ", text)


GAP = "…"  # where a message's formatted values go in its template


def _template(node: ast.AST, constants: dict[str, str]) -> str | None:
    """The message a literal makes, each formatted value as GAP (a module constant inlined); None if no literal."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for v in node.values:
            if isinstance(v, ast.Constant):
                parts.append(v.value)
            elif isinstance(v.value, ast.Name) and v.value.id in constants and v.conversion == -1:
                parts.append(constants[v.value.id])
            else:
                parts.append(GAP)
        return "".join(parts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):  # "..." + repr(x) + "..."
        left, right = _template(node.left, constants), _template(node.right, constants)
        if left is not None or right is not None:
            return (GAP if left is None else left) + (GAP if right is None else right)
    return None


def _index() -> tuple[dict[str, ast.Module], dict[str, str], dict[str, str]]:
    """Parsed modules by path; module-level string constants and literal-returning functions by name."""
    trees, constants, returns = {}, {}, {}
    for path in sorted((ROOT / "zero").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        trees[path.relative_to(ROOT).as_posix()] = tree
        for node in tree.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                text = _template(node.value, {})
                if text is not None:
                    constants[node.targets[0].id] = text
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and isinstance(node.body[-1], ast.Return) and node.body[-1].value:
                text = _template(node.body[-1].value, constants)
                if text is not None:
                    returns[node.name] = text
    return trees, constants, returns


def _messages(arg, function, constants, returns) -> list[str] | None:
    """The template of each message the argument may be, or None if it cannot be read statically."""
    text = _template(arg, constants)
    if text is not None:
        return [text]
    if isinstance(arg, ast.Name) and arg.id in constants:
        return [constants[arg.id]]
    if isinstance(arg, ast.Call):
        func = arg.func
        if isinstance(func, ast.Attribute) and func.attr == "format" and isinstance(func.value, ast.Name):
            if func.value.id in constants:  # "...{what}...".format(what=...)
                fields = string.Formatter().parse(constants[func.value.id])
                return ["".join(lit + (GAP if field is not None else "") for lit, field, *_ in fields)]
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        if name in returns:
            return [returns[name]]
    if isinstance(arg, ast.Subscript) and isinstance(arg.value, ast.Name):  # messages[state], a dict built here
        for node in ast.walk(function):
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
                    and any(isinstance(t, ast.Name) and t.id == arg.value.id for t in node.targets)):
                tables = [_messages(v, function, constants, returns) for v in node.value.values]
                if all(tables):
                    return [text for table in tables for text in table]
    return None


def phrase(template: str) -> str:
    """From the longest constant fragment of the message (from its start if that fragment is short), at most
    MAX_PHRASE characters cut at a word boundary; formatted values show as GAP."""
    template = _normalize(template)
    best = max((f.strip(" .,:;()") for f in template.split(GAP)), key=len)
    text = template[template.index(best):] if len(best) >= 20 else template.strip()
    if len(text) > MAX_PHRASE:
        cut = text[: MAX_PHRASE + 1].rsplit(" ", 1)[0]
        text = cut if len(cut) >= MAX_PHRASE // 2 else text[:MAX_PHRASE]  # a long token: cut inside it
    return text.rstrip(" .,:;(")


def raised_errors() -> list[tuple[str, str | None]]:
    """(where, phrase) for every raise of the three kinds in zero/; phrase None where no literal message."""
    trees, constants, returns = _index()
    found = []
    for path, tree in trees.items():
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for function in functions:
            for node in ast.walk(function):
                if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)):
                    continue
                func = node.exc.func
                if not (isinstance(func, ast.Name) and func.id in KINDS and node.exc.args):
                    continue
                owner = min((f for f in functions if f.lineno <= node.lineno <= f.end_lineno),
                            key=lambda f: f.end_lineno - f.lineno)  # the innermost function holding the raise
                if owner is not function:
                    continue
                where = f"{path}:{function.name}"
                messages = _messages(node.exc.args[0], function, constants, returns)
                if messages is None:
                    found.append((where, None))
                else:
                    found.extend((where, phrase(m)) for m in messages)
    return found


def test_every_error_has_an_entry():
    page = _normalize(PAGE.read_text())
    errors = raised_errors()
    assert len(errors) > 200  # the scan itself works
    unlisted = [(w, p) for w, p in errors if w not in NOT_LISTED and p not in NOT_LISTED]
    unreadable = [w for w, p in unlisted if p is None or len(p) < MIN_PHRASE]
    assert not unreadable, f"no distinctive literal message; give one, or list it in NOT_LISTED with why: {unreadable}"
    missing = [f"{w}: {p!r}" for w, p in unlisted if p not in page]
    assert not missing, "errors without an entry in docs/troubleshooting.md:\n" + "\n".join(missing)


def test_not_listed_is_not_stale():
    seen = {key for pair in raised_errors() for key in pair}
    assert not set(NOT_LISTED) - seen, "NOT_LISTED names raises that no longer exist"


def _anchors(text: str) -> set[str]:
    """GitHub-style heading anchors, plus explicit <a id="..."> / <a name="...">."""
    anchors = set(re.findall(r'<a (?:id|name)="([^"]+)"', text))
    counts: dict[str, int] = {}
    for title in re.findall(r"^#{1,6} +(.+?) *#*$", re.sub(r"```.*?```", "", text, flags=re.S), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", title.lower().replace("`", "")).replace(" ", "-")
        n = counts.get(slug, 0)
        counts[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def test_relative_links_resolve():
    bad = []
    for page in sorted(DOCS.glob("*.md")):
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        text = re.sub(r"`[^`\n]*`", "", text)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / unquote(file)).resolve() if file else page
            if not dest.exists():
                bad.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text()):
                bad.append(f"{page.name}: {target} (no such anchor)")
    assert not bad, "\n".join(bad)
