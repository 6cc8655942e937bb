"""Redaction of personal data and secrets before any text leaves the process for a judge endpoint.

The judge call is the one place where tracejudge sends production text to a third party, so every
chat message and every embeddings input passes a `Redaction` session in `JudgeClient` before the
request body is built (`tracejudge.metrics.judges.client`). A session belongs to ONE judgement (one
judge on one record or conversation) and is shared by all its calls: the same value gets the same
typed placeholder across request, context and response (`<EMAIL_1>`, `<EMAIL_2>`, `<CARD_1>`), so the
judge can still tell that the response repeats the e-mail address the user gave. Numbering restarts
with every judgement, so placeholders cannot be joined across records.

Detected kinds (the closed set of the `kind` label of `tracejudge_redactions_total`):

    email   addresses                       phone   international (+CC ...) and US/national formats
    card    13-19 digits, Luhn-checked      iban    country code + check digits, mod-97 checked
    ssn     US social security numbers      ip      IPv4 and IPv6 addresses (validated)
    secret  API-key shapes (OpenAI, Anthropic, AWS, GitHub, Slack, Google), `Bearer` tokens, JWTs,
            PEM private keys
    custom  the user's `patterns` and `callable` (`judges.redaction` in the configuration)

Phone detection requires separators or a leading `+`/trunk `0`, so years, prices, quantities and
plain order ids survive; a 16-digit order id is only a card when it passes the Luhn check.

Why hand-written (standard library `re`, `ipaddress`, `hashlib`): Presidio's analyzer needs a spaCy
language model downloaded at run time; scrubadub depends on scikit-learn and textblob and has no IBAN,
IP address or API-key/JWT/PEM detectors, so most of this list would be hand-written beside it anyway.
The checks that make detection precise (Luhn, IBAN mod-97, IP validation) are a few lines each and
are covered by tests/test_redaction.py; bench/bench_redaction.py measures the CPU.

The original text is never logged or stored by this module beyond the judgement: a session keeps the
value -> placeholder map and the memo of its lines' findings in memory for the judgement's lifetime
only, and the `Redactor` it was opened from holds no state of any record (nothing is shared across
records or judgements).
"""

from __future__ import annotations

import contextvars
import ipaddress
import re
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from prometheus_client import CollectorRegistry, Counter

from tracejudge.metrics.plugins import load_plugin

__all__ = [
    "BUILTIN_KINDS",
    "KINDS",
    "Redaction",
    "RedactionError",
    "RedactionMetrics",
    "Redactor",
    "current_redaction",
    "iban_ok",
    "load_callable",
    "luhn_ok",
    "reset_redaction",
    "use_redaction",
]

BUILTIN_KINDS: tuple[str, ...] = ("email", "phone", "card", "iban", "ssn", "ip", "secret")
# The closed set of `kind` label values.
KINDS: tuple[str, ...] = (*BUILTIN_KINDS, "custom")

# A user callable: text -> spans to replace, (start, end) or (start, end, label).
SpanFinder = Callable[[str], Iterable[Sequence[Any]]]


# A digit's value doubled, less 9 when over 9 (Luhn).
_LUHN_DOUBLED = (0, 2, 4, 6, 8, 1, 3, 5, 7, 9)


def luhn_ok(digits: str) -> bool:
    """The Luhn check of a string of ASCII digits: every second digit from the right doubled."""
    rev = digits[::-1]
    return (sum(map(int, rev[::2])) + sum(map(_LUHN_DOUBLED.__getitem__, map(int, rev[1::2])))) % 10 == 0


def iban_ok(iban: str) -> bool:
    """ISO 13616: 15-34 characters, country letters, check digits, and the mod-97 remainder 1."""
    s = iban.replace(" ", "").upper()
    if not 15 <= len(s) <= 34 or not s[:2].isalpha() or not s[2:4].isdigit() or not s.isalnum():
        return False
    rearranged = s[4:] + s[:4]
    return int("".join(str(int(c, 36)) for c in rearranged)) % 97 == 1


# ------------------------------------------------------------------------------------------ detectors
# An address is found from its "@" (str.find is ~50x cheaper than a regex scan of the whole prompt):
# the local part is read backwards from it, the domain forwards.
_EMAIL_LOCAL = re.compile(r"[A-Za-z0-9._%+-]{1,64}$")
_EMAIL_DOMAIN = re.compile(r"(?:[A-Za-z0-9-]{1,63}\.)+[A-Za-z]{2,24}\b")
# Key shapes, each behind the literal it cannot lack: a shape's regex runs only on a text holding its
# literal, and starts with that literal (sre's fast literal-prefix search; the word-boundary check is a
# look-behind placed after it). One alternation of them all cost ~25x more on ordinary prompts.
_SECRETS: tuple[tuple[tuple[str, ...], re.Pattern[str]], ...] = tuple(
    (gates, re.compile(pattern))
    for gates, pattern in (
        (("eyJ",), r"eyJ(?<![\w-]eyJ)[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*"),  # JWT
        # OpenAI and Anthropic
        (("sk-",), r"sk-(?<![\w-]sk-)(?:ant-|proj-|svcacct-|admin-|None-)?[A-Za-z0-9_-]{20,}"),
        (("IA", "ACCA"), r"A(?<!\wA)(?:KIA|SIA|BIA|CCA)[A-Z0-9]{16}\b"),  # AWS access key id
        (("ghp_", "gho_", "ghu_", "ghs_", "ghr_"), r"gh(?<!\wgh)[pousr]_[A-Za-z0-9]{36,255}\b"),  # GitHub
        (("github_pat_",), r"github_pat_(?<!\wgithub_pat_)[A-Za-z0-9_]{22,255}\b"),
        (("xox",), r"xox(?<!\wxox)[abposre]-[A-Za-z0-9-]{10,}"),  # Slack tokens
        (("hooks.slack.com",), r"https://hooks\.slack\.com/services/[A-Za-z0-9/]+"),
        (("AIza",), r"AIza(?<!\wAIza)[0-9A-Za-z_-]{35}(?![0-9A-Za-z_-])"),  # Google API key
        (("earer ",), r"(?<=\b[Bb]earer )[A-Za-z0-9._~+/=-]{16,}"),  # bearer tokens ("Bearer" stays)
    )
)
# A PEM private key spans lines: matched on the whole text, not per line.
_PEM = re.compile(
    r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY-----[\s\S]*?-----END (?:[A-Z0-9]+ )*PRIVATE KEY-----"
)
# An AWS secret access key is 40 base64 characters: only taken next to its name (group 1 is the value).
_AWS_SECRET = re.compile(
    r"(?i:aws_secret_access_key|aws_secret_key|secret_access_key)[\"']?\s*[:=]\s*[\"']?"
    r"([A-Za-z0-9/+=]{40})(?![A-Za-z0-9/+=])"
)
# The look-behind sits after the first letter so that the scan starts with a character class (sre's
# fast path), three times cheaper than a leading \b on a prompt with no IBAN.
_IBAN = re.compile(r"[A-Z](?<![A-Za-z0-9][A-Z])[A-Z]\d{2}(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,3})?\b")
_CARD = re.compile(r"(?<![\d+-])\d(?:[ -]?\d){12,18}(?![\d])")
_SSN = re.compile(r"(?<![\d-])(?!000|666|9\d\d)\d{3}-(?!00)\d{2}-(?!0000)\d{4}(?![\d-])")
_IPV4 = re.compile(
    r"(?<![\d.])(?:(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)(?!\.?\d)"
)
_IPV6 = re.compile(r"(?<![\w:.])(?:[0-9A-Fa-f]{0,4}:){2,7}(?:[0-9A-Fa-f]{1,4}|(?<=:):)(?![\w:])")
_PHONE = re.compile(
    # international: +CC then 6-14 more digits in groups
    r"(?<![\w+])\+\d{1,3}(?:[ .-]?\(\d{1,4}\))?(?:[ .-]?\d{1,5}){2,6}(?![\w])"
    # US/NANP: (AAA) EEE-NNNN, AAA-EEE-NNNN, AAA.EEE.NNNN, optionally with a leading 1
    r"|(?<![\w.$€£-])(?:1[ .-]?)?(?:\([2-9]\d{2}\) ?|[2-9]\d{2}[ .-])[2-9]\d{2}[ .-]\d{4}(?![\w-]|\.\d)"
    # national with a trunk 0: 020 7946 0958, 030-1234567
    r"|(?<![\w.$€£-])0\d{1,4}[ -]\d{3,4}[ -]?\d{3,4}(?![\w-]|\.\d)"
)


# The characters between a number's digits in the numeric detectors' matches.
_SEPARATORS = str.maketrans("", "", " .()+-")


def _number_key(s: str) -> str:
    """A phone, card or SSN match's digits (its other characters are all `_SEPARATORS`)."""
    return s.translate(_SEPARATORS)


def _find_iban(text: str) -> Iterable[tuple[int, int, str]]:
    for m in _IBAN.finditer(text):
        start, s = m.start(), m.group()
        # The greedy groups may have eaten a following word ("... 00 AND"); drop groups until it checks.
        while len(s.replace(" ", "")) >= 15:
            if iban_ok(s):
                yield start, start + len(s), s.replace(" ", "")
                break
            if " " not in s:
                break
            s = s[: s.rfind(" ")]


def _find_email(text: str) -> Iterable[tuple[int, int, str]]:
    at = text.find("@")
    end = 0
    while at != -1:
        local = _EMAIL_LOCAL.search(text, max(end, at - 64), at)
        domain = _EMAIL_DOMAIN.match(text, at + 1) if local else None
        if local and domain:
            start = local.start()
            while text[start] in "._%+-":  # an address starts with a letter or digit
                start += 1
            if start < at:
                end = domain.end()
                yield start, end, text[start:end].lower()
        at = text.find("@", max(at + 1, end))


def _find_card(text: str, pos: int = 0, endpos: int = sys.maxsize) -> Iterable[tuple[int, int, str]]:
    for m in _CARD.finditer(text, pos, endpos):
        digits = _number_key(m.group())
        if 13 <= len(digits) <= 19 and luhn_ok(digits):
            yield m.start(), m.end(), digits


def _find_ipv6(text: str) -> Iterable[tuple[int, int, str]]:
    for m in _IPV6.finditer(text):
        s = m.group()
        if s.count(":") == len(s):
            continue
        try:
            addr = ipaddress.IPv6Address(s)
        except ValueError:
            continue
        yield m.start(), m.end(), addr.compressed


def _find_phone(text: str, pos: int = 0, endpos: int = sys.maxsize) -> Iterable[tuple[int, int, str]]:
    for m in _PHONE.finditer(text, pos, endpos):
        digits = _number_key(m.group())
        if 7 <= len(digits) <= 15:
            yield m.start(), m.end(), digits


def _regex(pattern: re.Pattern[str], norm: Callable[[str], str] = str) -> Callable[..., Iterable]:
    """Spans of `pattern`'s matches; of its group 1 when it has groups (the value next to a name)."""
    g = 1 if pattern.groups else 0

    def find(text: str, pos: int = 0, endpos: int = sys.maxsize) -> Iterable[tuple[int, int, str]]:
        for m in pattern.finditer(text, pos, endpos):
            if m.group(g) is not None:
                yield m.start(g), m.end(g), norm(m.group(g))

    return find


@dataclass(frozen=True, slots=True)
class _Detector:
    kind: str  # the metric label
    label: str  # the placeholder's type: <LABEL_n>
    # (text) -> (start, end, value) of its matches; a numeric detector's also takes (pos, endpos),
    # as `re.Pattern.finditer` does, and finds only matches that start at or after `pos`.
    find: Callable[..., Iterable[tuple[int, int, str]]]
    # Cheap test that the text may hold a match at all (skips the regex on most texts).
    hint: Callable[[str], bool] | None = None
    # Matches are runs of digits and separators: search only the `_NUMERIC` windows (CPU, see below)
    # that pass `hint` and hold at least `min_digits` digits (one match's fewest).
    numeric: bool = False
    min_digits: int = 0


# Every phone, card, SSN and IPv4 match is such a run (7+ characters, digits at both ends). One pass
# of this pattern finds the few windows the numeric detectors need to look at, instead of each of them
# scanning the whole prompt: most prompts hold years, prices and ids but no such run.
_NUMERIC = re.compile(r"[\d+(][\d .()+-]{5,}\d")
# The same on an ASCII line, where \d is [0-9]: a range is tested inline, \d by a call per character
# (half the time on a prompt).
_NUMERIC_ASCII = re.compile(r"[0-9+(][0-9 .()+-]{5,}[0-9]")
# Characters after a window the detectors' look-aheads may read (their look-behinds read the text before).
_MARGIN = 8


# (gate, pattern) pairs; those whose gate holds "_" are checked only when the text has one.
_SECRET_GATES = tuple((g, p) for gates, p in _SECRETS for g in gates if "_" not in g)
_SECRET_UNDERSCORE_GATES = tuple((g, p) for gates, p in _SECRETS for g in gates if "_" in g)


def _find_secrets(text: str) -> Iterable[tuple[int, int, str]]:
    hits: list[re.Pattern[str]] = [p for g, p in _SECRET_GATES if g in text]
    if "_" in text:
        hits += [p for g, p in _SECRET_UNDERSCORE_GATES if g in text]
    seen: set[re.Pattern[str]] = set()
    for pattern in hits:
        if pattern not in seen:
            seen.add(pattern)
            for m in pattern.finditer(text):
                yield m.start(), m.end(), m.group()


def _aws_hint(text: str) -> bool:
    return "ecret_" in text or "ECRET_" in text


def _phone_hint(window: str) -> bool:
    # Every `_PHONE` form holds a "+" or a separator: a bare run of digits is an id, never a phone.
    return not window.isdigit()


# A full address without "::" has seven colons between hex groups; a literal first character keeps
# the scan on sre's fast path.
_IPV6_HINT = re.compile(r":[0-9A-Fa-f]{1,4}:[0-9A-Fa-f]{1,4}:")


def _ipv6_hint(text: str) -> bool:
    return "::" in text or _IPV6_HINT.search(text) is not None


# How a found value is keyed in a session's placeholder map: one placeholder for one value, however
# it is written (case of an address, separators of a number).
_KEY: dict[str, Callable[[str], str]] = {
    "email": str.lower,
    "phone": _number_key,
    "card": _number_key,
    "iban": lambda v: v.replace(" ", "").upper(),
    "ip": str.lower,
    "ssn": _number_key,
    "secret": str,
}
# How far into a line a label ("Request: ") is looked for.
_LABEL_MAX = 48
# A line's (start, end, kind, label) findings, in order; what a judgement's memo holds per line.
_LineFindings = tuple[tuple[int, int, str, str], ...]

# Order is priority: an earlier detector's span wins an overlap.
_BUILTIN: dict[str, _Detector] = {
    "secret": _Detector("secret", "SECRET", _find_secrets),
    "aws_secret": _Detector("secret", "SECRET", _regex(_AWS_SECRET), _aws_hint),
    "email": _Detector("email", "EMAIL", _find_email),
    "iban": _Detector("iban", "IBAN", _find_iban),
    "card": _Detector("card", "CARD", _find_card, numeric=True, min_digits=13),
    "ssn": _Detector("ssn", "SSN", _regex(_SSN), lambda w: w.count("-") >= 2, numeric=True, min_digits=9),
    "ip": _Detector("ip", "IP", _regex(_IPV4), lambda w: w.count(".") >= 3, numeric=True, min_digits=4),
    "ipv6": _Detector("ip", "IP", _find_ipv6, _ipv6_hint),
    "phone": _Detector("phone", "PHONE", _find_phone, _phone_hint, numeric=True, min_digits=7),
}


def load_callable(spec: str, key: str = "redaction.callable") -> SpanFinder:
    """Import `module:function` (`tracejudge.metrics.plugins`); a `ConfigError` (a ValueError) naming
    `key` and why when it cannot be had."""
    finder: SpanFinder = load_plugin(spec, key=key, noun="function", accept=callable)
    return finder


class RedactionMetrics:
    """`tracejudge_redactions_total{kind}`; one per registry (`for_registry`), since the trace and the
    session judge runners of one process may share a registry."""

    _by_registry: ClassVar[weakref.WeakKeyDictionary[CollectorRegistry, RedactionMetrics]] = (
        weakref.WeakKeyDictionary()
    )
    _lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def for_registry(cls, registry: CollectorRegistry) -> RedactionMetrics:
        with cls._lock:
            found = cls._by_registry.get(registry)
            if found is None:
                found = cls._by_registry[registry] = cls(registry)
            return found

    def __init__(self, registry: CollectorRegistry):
        self.redactions = Counter(
            "tracejudge_redactions",
            "Values replaced by a placeholder before text was sent to a judge endpoint, by kind.",
            ["kind"],
            registry=registry,
        )
        # Each kind's child, resolved once: `labels()` takes a lock and builds a key on every call.
        self.by_kind = {kind: self.redactions.labels(kind=kind) for kind in KINDS}


class RedactionError(Exception):
    """The user's callable failed or returned garbage: the text must not be sent unredacted."""


class Redactor:
    """The configured detectors; `session()` opens one judgement's `Redaction`.

    Thread-safe to share: it holds no per-judgement state (a judgement's memo of line findings is its
    session's)."""

    def __init__(
        self,
        kinds: Iterable[str] = BUILTIN_KINDS,
        patterns: Mapping[str, str | re.Pattern[str]] | None = None,
        finder: SpanFinder | None = None,
        *,
        metrics: RedactionMetrics | None = None,
    ):
        wanted = set(kinds)
        unknown = wanted - set(BUILTIN_KINDS)
        if unknown:
            raise ValueError(f"unknown kinds {sorted(unknown)} (known: {', '.join(BUILTIN_KINDS)})")
        custom = [
            _Detector("custom", name.upper(), _regex(re.compile(p) if isinstance(p, str) else p))
            for name, p in (patterns or {}).items()
        ]
        # In priority order: secrets first (a key may hold digits that look like a phone number).
        self._detectors = [d for d in _BUILTIN.values() if d.kind in wanted]
        self._pem = "secret" in wanted
        self._custom = custom
        self._finder = finder
        self.metrics = metrics

    @classmethod
    def from_config(cls, cfg: Any, metrics: RedactionMetrics | None = None) -> Redactor | None:
        """From `judges.redaction` (a `RedactionConfig`); None when redaction is disabled."""
        if not cfg.enabled:
            return None
        finder = load_callable(cfg.callable) if cfg.callable else None
        return cls(cfg.kinds, cfg.patterns, finder, metrics=metrics)

    @classmethod
    def for_runner(cls, cfg: Any, registry: CollectorRegistry | None) -> Redactor | None:
        """The runner's redactor from `judges.redaction`, counting into `registry` (None: uncounted)."""
        return cls.from_config(cfg, RedactionMetrics.for_registry(registry) if registry is not None else None)

    def session(self, memo: dict[str, _LineFindings] | None = None) -> Redaction:
        """One judgement's session; `memo` shares the line findings among one record's judgements."""
        return Redaction(self) if memo is None else Redaction(self, _lines=memo)

    def _spans(self, text: str, memo: dict[str, _LineFindings]) -> list[tuple[int, int, str, str, str]]:
        """Non-overlapping (start, end, kind, label, key) spans, in text order.

        Priority on overlap: secrets, then the user's patterns and callable, then the other kinds.
        The built-in detectors other than PEM keys never match across a line break, so they run per
        line, and a line's findings are remembered in `memo`, the judgement's (`_remember`): a line
        recurs within one judgement's texts (a judge making several calls, a value sent alone and
        again after a label). Nothing is remembered across judgements, so across records."""
        line_found: list[tuple[int, int, str, str, str]] = []
        remembered = memo.get
        pos = 0
        for line in text.split("\n"):
            if line:
                hit = remembered(line)
                if hit is None:
                    hit = self._remember(memo, line)
                for start, end, kind, label in hit:
                    start, end = start + pos, end + pos
                    line_found.append((start, end, kind, label, _KEY[kind](text[start:end])))
            pos += len(line) + 1
        has_pem = self._pem and "-----BEGIN" in text
        if not has_pem and not self._custom and self._finder is None:
            # The common case: each line's findings are resolved and in order, and lines do not overlap.
            return line_found
        found: list[tuple[int, int, str, str, str]] = []
        if has_pem:
            found += [(m.start(), m.end(), "secret", "SECRET", m.group()) for m in _PEM.finditer(text)]
        _add(found, (f for f in line_found if f[2] == "secret"))
        for d in self._custom:
            _add(found, ((a, b, d.kind, d.label, k) for a, b, k in d.find(text)))
        if self._finder is not None:
            _add(found, ((a, b, "custom", lab, text[a:b]) for a, b, lab in _user_spans(self._finder, text)))
        _add(found, (f for f in line_found if f[2] != "secret"))
        found.sort()
        return found

    def _remember(self, memo: dict[str, _LineFindings], line: str, label: bool = True) -> _LineFindings:
        """A line's (start, end, kind, label) findings, in order, remembered in the judgement's `memo`.

        A line that starts with a short label, "Request: ...", is read as the label and the rest, the
        rest remembered on its own: a custom judge's template puts a value after a label while the
        built-in judges' prompts give it a line of its own, and the value is then scanned once. No
        built-in detector's match holds ": " or is told apart by a space before it, but an AWS
        secret's, whose name may be the label: such a line is scanned whole."""
        cut = line.find(": ", 0, _LABEL_MAX) if label else -1  # one label: "a: b: c: ..." recurses no further
        if cut != -1 and cut + 2 < len(line) and not _aws_hint(line[: cut + 2]):
            rest = line[cut + 2 :]
            in_rest = memo.get(rest)
            if in_rest is None:
                in_rest = self._remember(memo, rest, label=False)
            shift = cut + 2
            found = tuple(sorted((a, b, kind, label) for a, b, kind, label, _ in self._scan(line[:shift])))
            found += tuple((a + shift, b + shift, kind, label) for a, b, kind, label in in_rest)
        else:
            found = tuple(sorted((a, b, kind, label) for a, b, kind, label, _ in self._scan(line)))
        memo[line] = found
        return found

    def _scan(self, text: str) -> list[tuple[int, int, str, str, str]]:
        """The built-in per-line detectors on one line, resolved in priority order."""
        found: list[tuple[int, int, str, str, str]] = []
        windows: list[tuple[int, int, str, int]] | None = None
        for d in self._detectors:
            if d.numeric:
                if windows is None:
                    windows = []
                    for m in (_NUMERIC_ASCII if text.isascii() else _NUMERIC).finditer(text):
                        window = m.group()
                        windows.append((*m.span(), window, len(window.translate(_SEPARATORS))))
                for lo, hi, window, digits in windows:
                    if digits < d.min_digits or (d.hint is not None and not d.hint(window)):
                        continue
                    # A match starts at a digit, "+" or "(" (what a window starts with): none starts
                    # before the window and runs into it. Look-behinds see the text before `lo`.
                    for start, end, key in d.find(text, lo, hi + _MARGIN):
                        if end <= hi and not _overlaps(found, start, end):
                            found.append((start, end, d.kind, d.label, key))
                continue
            if d.hint is not None and not d.hint(text):
                continue
            for start, end, key in d.find(text):
                if end > start and not _overlaps(found, start, end):
                    found.append((start, end, d.kind, d.label, key))
        return found


_Span = tuple[int, int, str, str, str]


def _add(found: list[_Span], spans: Iterable[_Span]) -> None:
    for span in spans:
        if span[1] > span[0] and not _overlaps(found, span[0], span[1]):
            found.append(span)


def _overlaps(spans: list[tuple[int, int, str, str, str]], start: int, end: int) -> bool:
    return any(s < end and start < e for s, e, *_ in spans)


def _user_spans(finder: SpanFinder, text: str) -> list[tuple[int, int, str]]:
    try:
        out = []
        for span in finder(text):
            start, end = int(span[0]), int(span[1])
            label = str(span[2]) if len(span) > 2 else "CUSTOM"
            if not 0 <= start < end <= len(text):
                raise ValueError(f"span ({start}, {end}) outside the text")
            label = re.sub(r"[^A-Z0-9_]", "_", label.upper())[:32] or "CUSTOM"
            out.append((start, end, label))
        return out
    except Exception as exc:
        # Never the text in the message.
        raise RedactionError(f"redaction callable failed: {type(exc).__name__}") from None


@dataclass
class Redaction:
    """One judgement's redaction: the value -> placeholder map shared by all its texts, and the memo of
    the findings of the lines they held (line -> offsets and kinds), gone with the judgement, or shared
    with the other judgements of the same record (`Plan.redaction_memo`) and gone with the record."""

    redactor: Redactor
    _placeholders: dict[tuple[str, str], str] = field(default_factory=dict)
    _next: dict[str, int] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    # Never in a repr: it holds the judgement's lines.
    _lines: dict[str, _LineFindings] = field(default_factory=dict, repr=False, compare=False)

    @property
    def replaced(self) -> int:
        return sum(self.counts.values())

    def placeholder(self, label: str, key: str) -> str:
        ph = self._placeholders.get((label, key))
        if ph is None:
            n = self._next.get(label, 0) + 1
            self._next[label] = n
            ph = self._placeholders[(label, key)] = f"<{label}_{n}>"
        return ph

    def text(self, text: str) -> str:
        """`text` with every detected value replaced; the very same object when nothing matched."""
        spans = self.redactor._spans(text, self._lines)
        if not spans:
            return text
        parts: list[str] = []
        pos = 0
        counted: dict[str, int] = {}
        for start, end, kind, label, key in spans:
            parts.append(text[pos:start])
            parts.append(self.placeholder(label, key))
            pos = end
            counted[kind] = counted.get(kind, 0) + 1
        parts.append(text[pos:])
        metrics = self.redactor.metrics
        for kind, n in counted.items():
            self.counts[kind] = self.counts.get(kind, 0) + n
            if metrics is not None:
                metrics.by_kind[kind].inc(n)
        return "".join(parts)

    def texts(self, texts: Iterable[str]) -> list[str]:
        return [self.text(t) for t in texts]

    def messages(self, messages: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        """Chat messages with their string `content` redacted (other keys as they were). A `system`
        message is the judge's own instructions — the built-in text, or a custom judge's criteria from
        the configuration — and never carries trace text (every prompt puts that in the user message,
        tracejudge.metrics.judges.prompt_safety), so it is sent as written rather than scanned again for
        every record."""
        out = []
        for m in messages:
            content = m.get("content")
            if m.get("role") == "system":
                out.append(m)
            elif isinstance(content, str):
                red = self.text(content)
                out.append(m if red is content else {**m, "content": red})
            else:  # the judges send strings only
                out.append(m)
        return out


# The judgement in progress (set by JudgeRunner around each judgement; asyncio tasks inherit it).
_CURRENT: contextvars.ContextVar[Redaction | None] = contextvars.ContextVar(
    "tracejudge_redaction", default=None
)


def current_redaction() -> Redaction | None:
    return _CURRENT.get()


def use_redaction(session: Redaction | None) -> contextvars.Token[Redaction | None]:
    """Make `session` the current judgement's redaction; reset with `_CURRENT.reset(token)`."""
    return _CURRENT.set(session)


def reset_redaction(token: contextvars.Token[Redaction | None]) -> None:
    _CURRENT.reset(token)
