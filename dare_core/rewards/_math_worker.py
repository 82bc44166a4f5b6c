"""Equivalence worker of the `math` reward; runs as its own process (`python -s -c <this file>`).

Protocol: one JSON request per stdin line, `{"pred", "gold", "pred_norm", "gold_norm", "timeout"}`; one
JSON reply per line on the original stdout, `{"equal": bool, "method": str}`. The first line written is
`{"ready": true, "math_verify": bool}`, after the imports. The parent kills this process when a reply
takes longer than its time limit, so a pathological SymPy input can never stall the caller.

Self-contained on purpose (no `dare_core` import): it is started with the source text, not as a module.
"""
import json
import os
import re
import sys

# Started with -c: drop the working directory from the path so no local file shadows a library.
sys.path[:] = [p for p in sys.path if p not in ("", ".")]

# Libraries that print must not corrupt the protocol stream: keep a private copy of stdout and
# point fd 1 (and sys.stdout) at stderr.
_OUT = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
os.dup2(2, 1)
sys.stdout = sys.stderr

try:
    if os.environ.get("DARE_MATH_VERIFY") == "0":  # tests of the SymPy fallback
        raise ImportError("math_verify disabled")
    import logging

    logging.disable(logging.CRITICAL)
    from math_verify import parse as _mv_parse
    from math_verify import verify as _mv_verify
    HAVE_MATH_VERIFY = True
except Exception:  # noqa: BLE001  (any import problem means: use the fallback)
    HAVE_MATH_VERIFY = False

# ---- SymPy fallback: short expressions with few unknown letters only -------------------------------

_MAX_LEN = 60
_MAX_SYMBOLS = 2
_FUNCTIONS = {"sqrt", "pi", "sin", "cos", "tan", "log", "ln", "exp"}
_SAFE = re.compile(r"[0-9A-Za-z+\-*/().\s]*")


def _group(text, start):
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1:i], i + 1
    return None


def _latex_to_plain(text):
    """A small LaTeX subset -> SymPy syntax; None when something outside the subset is left."""
    out, i = [], 0
    while i < len(text):
        if text.startswith("\\frac", i):
            i += 5
            num = _group(text, i) if i < len(text) and text[i] == "{" else None
            if num is None:
                return None
            den = _group(text, num[1]) if num[1] < len(text) and text[num[1]] == "{" else None
            if den is None:
                return None
            a, b = _latex_to_plain(num[0]), _latex_to_plain(den[0])
            if a is None or b is None:
                return None
            out.append(f"(({a})/({b}))")
            i = den[1]
        elif text.startswith("\\sqrt", i):
            i += 5
            arg = _group(text, i) if i < len(text) and text[i] == "{" else None
            if arg is None:
                return None
            inner = _latex_to_plain(arg[0])
            if inner is None:
                return None
            out.append(f" sqrt({inner})")  # spaced: "a\\sqrt{b}" is a product
            i = arg[1]
        elif text[i] == "\\":
            match = re.match(r"\\([A-Za-z]+)", text[i:])
            if not match:
                return None
            name = match.group(1)
            replacement = {"cdot": "*", "times": "*", "div": "/", "pi": "pi", "sin": "sin", "cos": "cos",
                           "tan": "tan", "log": "log", "ln": "log", "exp": "exp"}.get(name)
            if replacement is None:
                return None
            out.append(f" {replacement} ")
            i += len(match.group(0))
        elif text[i] == "^":
            out.append("**")
            i += 1
        elif text[i] == "{":
            out.append("(")
            i += 1
        elif text[i] == "}":
            out.append(")")
            i += 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _sympy_equal(a_norm, b_norm):
    if len(a_norm) > _MAX_LEN or len(b_norm) > _MAX_LEN:
        return None
    exprs = []
    for text in (a_norm, b_norm):
        plain = _latex_to_plain(text)
        # Only digits, letters, arithmetic and parentheses reach the parser: no attribute access,
        # no underscores, no strings, so parse_expr cannot run anything but arithmetic.
        if plain is None or not _SAFE.fullmatch(plain) or re.search(r"\.(?!\d)", plain):
            return None
        words = set(re.findall(r"[A-Za-z]+", plain))
        symbols = {w for w in words if w not in _FUNCTIONS}
        if any(len(w) > 1 for w in symbols) or len(symbols) > _MAX_SYMBOLS:
            return None
        exprs.append(plain)
    import sympy
    from sympy.parsing.sympy_parser import implicit_multiplication_application, parse_expr, standard_transformations

    names = {name: getattr(sympy, name) for name in ("sqrt", "pi", "sin", "cos", "tan", "log", "exp")}
    names["ln"] = sympy.log
    letters = set(re.findall(r"\b[A-Za-z]\b", exprs[0] + " " + exprs[1]))
    names.update({letter: sympy.Symbol(letter) for letter in letters})
    transformations = standard_transformations + (implicit_multiplication_application,)
    a = parse_expr(exprs[0], local_dict=names, transformations=transformations)
    b = parse_expr(exprs[1], local_dict=names, transformations=transformations)
    return bool(sympy.simplify(a - b) == 0)


def _check(request):
    timeout = max(1, int(request.get("timeout", 5)))
    if HAVE_MATH_VERIFY:
        try:
            gold = _mv_parse("\\boxed{" + request["gold"] + "}", parsing_timeout=timeout)
            pred = _mv_parse("\\boxed{" + request["pred"] + "}", parsing_timeout=timeout)
            if gold and pred:
                return {"equal": bool(_mv_verify(gold, pred, timeout_seconds=timeout)), "method": "math_verify"}
        except Exception:  # noqa: BLE001  (an unparsable answer falls through to SymPy)
            pass
    try:
        equal = _sympy_equal(request["pred_norm"], request["gold_norm"])
    except Exception:  # noqa: BLE001
        equal = None
    if equal is None:
        return {"equal": False, "method": "unparsed"}
    return {"equal": equal, "method": "sympy"}


def _serve():
    _OUT.write(json.dumps({"ready": True, "math_verify": HAVE_MATH_VERIFY}) + "\n")
    for line in sys.stdin:
        try:
            reply = _check(json.loads(line))
        except Exception as exc:  # noqa: BLE001  (a bad request must not kill the worker)
            reply = {"equal": False, "method": "error", "error": repr(exc)[:200]}
        _OUT.write(json.dumps(reply) + "\n")


_serve()
