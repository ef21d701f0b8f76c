"""Regular expressions from ``adapter_config.json``, matched in bounded time.

PEFT matches ``target_modules`` and ``exclude_modules`` (when strings), the keys of
``rank_pattern``/``alpha_pattern`` and ``layers_pattern`` against module paths with
Python's ``re``. Its backtracking makes a pattern such as ``(a+)+b`` take exponential
time while holding the GIL, so one upload froze the whole service. Here every such
pattern runs on RE2 (google-re2), whose matching is linear in the text, and:

* a pattern must compile with ``re`` (what PEFT uses) *and* with RE2; syntax RE2 lacks
  (backreferences, lookaround, atomic groups, possessive quantifiers, ``\\Z``, verbose
  mode, ...) is refused with :class:`InvalidAdapter` rather than run on ``re``;
* the few constructs both accept but read differently are refused too: ``{,n}``
  (a quantifier for ``re``, literal text for RE2), ``[[:alpha:]]``-style classes,
  numeric escapes (``\\1`` is a backreference for ``re``, octal for RE2) and non-ASCII
  pattern text (case folding differs);
* module paths are checked first (ASCII ``[A-Za-z0-9_]`` parts joined by dots, no
  newline), so ``$``, ``\\d``, ``\\w``, ``\\s`` and ``.`` mean the same in both engines.

So for every pattern accepted here the answers are PEFT's. Exact names (``q_proj``,
``model\\.layers\\.0\\.q_proj``) and dotted names (``layers.0.q_proj``) are matched by
lookup, not by a regex engine, so configs with thousands of per-module keys stay fast.
Counts and sizes are bounded; see the constants below and docs/service.md.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import re2

from ..errors import InvalidAdapter, LimitExceeded

MODULE_PATH_RE = re.compile(r"[A-Za-z0-9_]{1,128}(\.[A-Za-z0-9_]{1,128}){0,31}")
MAX_TENSOR_NAME_CHARS = 8192  # a module path is at most 32 * 128 + 31 chars, plus PEFT's decorations
MAX_PATTERN_CHARS = 8192  # one pattern (an escaped module path fits)
MAX_PATTERN_KEYS = 100_000  # keys of rank_pattern / alpha_pattern, each
MAX_REGEX_KEYS = 1024  # of those, how many may be regular expressions (not names)
MAX_LAYERS_PATTERNS = 64
MAX_PATTERN_MATCHES = 1_000_000  # regex matches + name comparisons for one adapter
# RE2 is linear in the text and in the pattern's program: a match costs about len(path) x program
# size steps (~1.4e8 a second on one core, measured). Counting matches alone let one upload of
# 2,048 huge keys and one 4,000-character module path hold a worker thread for half an hour.
MAX_PROGRAM_SIZE = 2000  # one compiled pattern (a `(.*\.)?(layers\.\d+\.(q|v)_proj)$` is ~50)
MAX_PATTERN_WORK = 500_000_000  # sum of len(path) x program size over one adapter's matches (~4 s here)
_RE2_MAX_MEM = 2**20  # per compiled pattern: programs and DFA caches stay small

_OPTIONS = re2.Options()
_OPTIONS.log_errors = False  # errors come back as exceptions; RE2 would also print them to stderr
_OPTIONS.max_mem = _RE2_MAX_MEM
_META = frozenset(".^$*+?{}[]\\|()")
_LITERAL_RE = re.compile(r"(?:[^.^$*+?{}\[\]\\|()]|\\[^0-9A-Za-z])*")
_DOTTED_RE = re.compile(r"[A-Za-z0-9_]*(?:\.[A-Za-z0-9_]*)+")
_UNESCAPE_RE = re.compile(r"\\(.)")


def check_module_path(path: str, what: str = "module") -> str:
    """``path`` if it is a dotted module path of ASCII ``[A-Za-z0-9_]`` parts, else InvalidAdapter."""
    if len(path) > MAX_TENSOR_NAME_CHARS:
        raise InvalidAdapter(
            f"{what} name of {len(path)} characters is over the limit of {MAX_TENSOR_NAME_CHARS}; "
            "module paths are at most 32 parts of 128 characters"
        )
    if not MODULE_PATH_RE.fullmatch(path):
        raise InvalidAdapter(
            f"invalid {what} path {path[:200]!r}: expected a dotted path of [A-Za-z0-9_] parts "
            "(at most 32 parts of 128 characters), as in model.layers.0.self_attn.q_proj"
        )
    return path


def dot_suffixes(path: str) -> Iterable[str]:
    """``path`` and every tail after one of its dots: what PEFT's ``endswith('.' + name)`` can hit."""
    yield path
    i = path.find(".")
    while i >= 0:
        yield path[i + 1 :]
        i = path.find(".", i + 1)


class Budget:
    """Pattern work for one adapter: matches (and name comparisons) counted, and each regex
    match's RE2 steps (text length x program size); exceeding either is a LimitExceeded (422)."""

    __slots__ = ("left", "limit", "work_left", "work_limit")

    def __init__(self, limit: int = MAX_PATTERN_MATCHES, work: int = MAX_PATTERN_WORK) -> None:
        self.left = self.limit = limit
        self.work_left = self.work_limit = work

    def spend(self, n: int = 1) -> None:
        self.left -= n
        if self.left < 0:
            raise LimitExceeded(
                f"matching the config's patterns against the file's modules needs more than "
                f"{self.limit} regular-expression matches; name modules exactly (names are "
                "looked up, not counted) or use fewer regular expressions"
            )

    def match(self, rx: Any, text: str, *, full: bool = False) -> Any:
        """``rx.match(text)`` (``fullmatch`` with ``full``), its steps charged before it runs."""
        self.spend()
        self.work_left -= len(text) * rx.programsize
        if self.work_left < 0:
            raise LimitExceeded(
                f"matching the config's patterns against the file's modules needs more than "
                f"{self.work_limit:,} regex steps (module path length x pattern size, summed); "
                "use shorter, simpler patterns or name the modules exactly"
            )
        return rx.fullmatch(text) if full else rx.match(text)


def compile_pattern(pattern: Any, wrapped: str | None, what: str) -> Any:
    """Check ``pattern`` (from ``what``) and compile ``wrapped`` (PEFT's use of it) with RE2."""
    if not isinstance(pattern, str):
        raise InvalidAdapter(f"{what} must be a string, got {type(pattern).__name__}")
    check_pattern_size(pattern, what)
    if not pattern.isascii():
        raise InvalidAdapter(f"{what} {pattern[:200]!r}: non-ASCII characters in a regular expression are not "
                             "supported (module paths are ASCII)")
    _refuse_divergent(pattern, what)
    full = pattern if wrapped is None else wrapped
    try:
        re.compile(full)
    except (re.error, RecursionError, OverflowError) as e:
        raise InvalidAdapter(f"{what} {pattern[:200]!r} is not a valid regular expression: {e}") from None
    try:
        rx = re2.compile(full, _OPTIONS)
    except re2.error as e:
        why = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else str(e)
        raise InvalidAdapter(
            f"{what} {pattern[:200]!r} cannot be matched in linear time ({why}); backreferences, "
            "lookaround, atomic groups, possessive quantifiers, \\Z and repeats over 1000 are not "
            "supported: rewrite it without them or list the module names"
        ) from None
    if rx.programsize > MAX_PROGRAM_SIZE:
        raise LimitExceeded(f"{what} {pattern[:200]!r} compiles to {rx.programsize} RE2 instructions, over the "
                            f"limit of {MAX_PROGRAM_SIZE}: use a simpler pattern (fewer or smaller repeats) or "
                            "list the module names")
    return rx


def check_pattern_size(pattern: str, what: str) -> None:
    if len(pattern) > MAX_PATTERN_CHARS:
        raise LimitExceeded(f"{what} is {len(pattern)} characters, over the limit of {MAX_PATTERN_CHARS}")


def _refuse_divergent(p: str, what: str) -> None:
    """Refuse what ``re`` and RE2 both accept but read differently (one linear scan)."""
    i, n, in_class = 0, len(p), False
    while i < n:
        c = p[i]
        if c == "\\":
            if p[i + 1 : i + 2].isdigit():
                raise InvalidAdapter(f"{what} {p[:200]!r}: numeric escapes (\\1, \\012) are not supported; "
                                     "backreferences cannot be matched in linear time")
            i += 2
            continue
        if in_class:
            if c == "[" and p[i + 1 : i + 2] in (":", ".", "="):
                raise InvalidAdapter(f"{what} {p[:200]!r}: '[{p[i + 1]}' inside a character class is "
                                     "not supported (POSIX classes mean different things in re and RE2)")
            in_class = c != "]"
        elif c == "[":
            in_class = True
            i += 1
            i += p[i : i + 1] == "^"
            i += p[i : i + 1] == "]"  # a leading ']' is a literal member
            continue
        elif c == "{" and p[i + 1 : i + 2] == ",":
            raise InvalidAdapter(f"{what} {p[:200]!r}: write {{0,n}} instead of {{,n}}")
        i += 1


def _literal(p: str) -> str | None:
    """The text a metacharacter-free pattern matches (``model\\.q_proj`` -> ``model.q_proj``)."""
    return _UNESCAPE_RE.sub(r"\1", p) if _LITERAL_RE.fullmatch(p) else None


class NameSet:
    """A list of names, PEFT style: ``key in names or any(key.endswith('.' + n) ...)``, by lookup."""

    __slots__ = ("names",)

    def __init__(self, names: Iterable[str]) -> None:
        self.names = frozenset(names)

    def hit(self, key: str) -> bool:
        return any(s in self.names for s in dot_suffixes(key))


class PatternTable:
    """``rank_pattern``/``alpha_pattern`` keys: ``peft.utils.other.get_pattern_key``.

    The first key (in order) for which ``re.match(rf"(.*\\.)?({key})$", path)`` matches.
    Literal keys are found in a dict, dotted names by length and fixed segments, only
    real regular expressions go to RE2; answers are memoised per path.
    """

    def __init__(self, keys: Iterable[Any], field: str, budget: Budget) -> None:
        self.keys = tuple(keys)
        if len(self.keys) > MAX_PATTERN_KEYS:
            raise LimitExceeded(f"{field} has {len(self.keys)} keys, over the limit of {MAX_PATTERN_KEYS}")
        self._exact: dict[str, int] = {}
        # dotted names (each '.' any one character) by length, then by where their dots are:
        # the text between the dots -> first index. One lookup per group, not per key.
        self._dotted: dict[int, dict[tuple[int, ...], dict[str, int]]] = defaultdict(dict)
        self._regex: list[tuple[int, Any]] = []
        self._memo: dict[str, str | None] = {}
        self._budget = budget
        regex: list[tuple[int, str]] = []  # counted before any is compiled: compiling is the costly part
        for i, p in enumerate(self.keys):
            what = f"{field} key"
            if not isinstance(p, str):
                raise InvalidAdapter(f"{what} {p!r} must be a string")
            check_pattern_size(p, what)
            if (lit := _literal(p)) is not None:
                self._exact.setdefault(lit, i)
            elif _DOTTED_RE.fullmatch(p):
                dots = tuple(j for j, c in enumerate(p) if c == ".")
                self._dotted[len(p)].setdefault(dots, {}).setdefault(p.replace(".", ""), i)
            else:
                regex.append((i, p))
        if len(regex) > MAX_REGEX_KEYS:
            raise LimitExceeded(
                f"{field} has {len(regex)} regular-expression keys, over the limit of {MAX_REGEX_KEYS}; "
                "use exact module names (matched by lookup) for per-module values"
            )
        self._regex = [(i, compile_pattern(p, rf"(.*\.)?({p})$", f"{field} key")) for i, p in regex]

    def first(self, path: str) -> str | None:
        """The first key matching ``path`` (a checked module path), or None."""
        if path in self._memo:
            return self._memo[path]
        none = len(self.keys)
        best = none
        for s in dot_suffixes(path):
            best = min(best, self._exact.get(s, none), self._first_dotted(s, best))
        for i, rx in self._regex:
            if i >= best:
                break
            if self._budget.match(rx, path):
                best = i
                break
        got = self.keys[best] if best < none else None
        self._memo[path] = got
        return got

    def _first_dotted(self, s: str, best: int) -> int:
        for dots, fixed in self._dotted.get(len(s), {}).items():
            self._budget.spend()
            best = min(best, fixed.get(_without(s, dots), best))
        return best


def _without(s: str, positions: tuple[int, ...]) -> str:
    """``s`` without the characters at ``positions`` (where a dotted name has its wildcards)."""
    out, start = [], 0
    for j in positions:
        out.append(s[start:j])
        start = j + 1
    out.append(s[start:])
    return "".join(out)
