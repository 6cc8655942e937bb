"""What counts as a secret in the configuration, how it is shown, and what HTTP libraries may log.

Secrecy is declared, never guessed from a key's name (`max_tokens_param` is not a token):

* a pydantic `SecretStr` field is a secret;
* a field annotated `Annotated[..., SECRET]` is a secret; for a mapping (HTTP `headers`, an endpoint's
  `query_params`) every value is one, the keys are not;
* a field annotated `Annotated[..., OPAQUE]` is a section another component validates (a sink's
  `sink.<kind>` mapping): this process does not know which of its values are secrets, so its strings
  are shown masked, URLs excepted (shown by `redact_url`).

URLs are never shown with their credentials or query values. A URL that carries credentials
(`https://user:password@host`) is refused wherever the configuration takes one (`url_problem`):
credentials belong in the key, token or header settings, which are read from the environment or a file.

Importing this module also guards the loggers of the HTTP libraries tracejudge uses (httpx, httpcore,
urllib3 under the OTLP exporter): `HttpLogFilter` rewrites any URL in their records, at every level,
before a handler sees it, and masks `Authorization`-style header values should one be logged; and
kafka-python's, whose DEBUG lines dump the bytes on the wire (records, SASL handshakes): `WireLogFilter`
replaces every bytes literal in them.
"""

from __future__ import annotations

import logging
import re
from typing import Any
from urllib.parse import parse_qsl, quote, urlsplit, urlunsplit

__all__ = [
    "HTTP_LOGGERS",
    "KAFKA_LOGGERS",
    "MASK",
    "OPAQUE",
    "SECRET",
    "HttpLogFilter",
    "Marker",
    "WireLogFilter",
    "guard_http_loggers",
    "redact_url",
    "redact_urls",
    "shown",
    "url_problem",
]

MASK = "**********"


class Marker:
    """A field marker in `Annotated[...]` metadata (pydantic keeps it in `FieldInfo.metadata`)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


# The field's value is a secret (a mapping: each of its values).
SECRET = Marker("SECRET")
# A mapping validated by another component: its strings are shown masked, URLs redacted.
OPAQUE = Marker("OPAQUE")

# scheme://rest-of-the-URL, as it appears in free text (a log line, an error message).
_URL_IN_TEXT = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]{1,15}://[^\s\"'<>`]+")
# `Authorization: Bearer x`, `api-key=x`, `'x-api-key': 'x'`: a credential header's value in free text.
_HEADER_IN_TEXT = re.compile(
    r"(?i)(\b(?:proxy-)?authorization|\bx-api-key|\bapi[-_]key|\bset-cookie|\bcookie)"
    r"([\"']?\s*(?:,\s*b?[\"']|[:=]\s*[\"']?))"
    r"((?:(?:bearer|basic|token)\s+)?[^\s\"',;)\]}]+)"
)


def redact_url(url: str) -> str:
    """`url` without its secrets: the user and password replaced by `MASK`, each query value by `MASK`
    (a query parameter may be a signature or a key: `?sig=`, `?code=`, `?key=`), the fragment dropped.
    Scheme, host, port and path stay, so the URL can still be recognised."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return _mask_suspect(url)
    if not parts.scheme or not parts.netloc:
        return _mask_suspect(url)
    host = parts.hostname or ""
    if ":" in host:  # IPv6
        host = f"[{host}]"
    netloc = host if port is None else f"{host}:{port}"
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        netloc = f"{MASK}@{netloc}"
    query = "&".join(f"{quote(k, safe='')}={MASK}" for k, _ in parse_qsl(parts.query, keep_blank_values=True))
    if parts.query and not query:
        query = MASK
    return urlunsplit((parts.scheme, netloc, parts.path, query, MASK if parts.fragment else ""))


def _mask_suspect(text: str) -> str:
    # Not a URL urlsplit can take apart: keep the scheme, mask everything that could be a credential.
    scheme, sep, _ = text.partition("://")
    if "@" in text or "?" in text:
        return f"{scheme}://{MASK}" if sep else MASK
    return text


def redact_urls(text: str) -> str:
    """Every URL in `text` through `redact_url`, and credential header values masked."""
    if "://" in text:
        text = _URL_IN_TEXT.sub(lambda m: redact_url(m.group()), text)
    lowered = text.lower()
    if any(h in lowered for h in ("authorization", "api-key", "api_key", "cookie")):
        text = _HEADER_IN_TEXT.sub(lambda m: f"{m.group(1)}{m.group(2)}{MASK}", text)
    return text


def url_problem(url: str, *, credentials_go_in: str, query: bool = True,
                query_goes_in: str | None = None) -> str | None:
    """Why `url` cannot be a configured URL, None when it can: one carrying credentials is refused
    (they would be printed, logged by HTTP libraries and stored in files people share); `query=False`
    refuses a query or fragment too (`query_goes_in` says where its parameters belong). The message
    quotes the URL only through `redact_url`."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return f"is not a URL, got {redact_url(url)!r}"
    if "@" in parts.netloc:
        return (f"must not carry credentials (user:password@ in {redact_url(url)!r}); put them in "
                f"{credentials_go_in}")
    if not query and (parts.query or parts.fragment):
        hint = f"; put query parameters in {query_goes_in}" if query_goes_in else ""
        return f"must not have a query or fragment, got {redact_url(url)!r}{hint}"
    return None


def shown(value: Any) -> Any:
    """A non-secret configuration value as printed: any URL in a string goes through `redact_url`."""
    return redact_urls(value) if isinstance(value, str) else value


class HttpLogFilter(logging.Filter):
    """Rewrites a log record of an HTTP library so no URL in it shows credentials or query values and
    no credential header shows its value. It never drops a record."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: leave it to logging's own error handling
            return True
        clean = redact_urls(message)
        if clean != message:
            record.msg, record.args = clean, None
        return True


# Each logger that emits records needs the filter itself: a logger's filters do not apply to records
# its children emit and propagate.
HTTP_LOGGERS: tuple[str, ...] = (
    "httpx", "httpcore", "httpcore.connection", "httpcore.http11", "httpcore.http2", "httpcore.proxy",
    "httpcore.socks", "urllib3", "urllib3.connectionpool", "urllib3.util.retry", "urllib3.poolmanager",
    "requests", "openai", "openai._base_client",
)
_FILTER = HttpLogFilter()

# A Python bytes literal in a message: `b'...'`, `bytearray(b'...')`.
_BYTES_LITERAL = re.compile(r"""bytearray\(b(['"])(?:\\.|(?!\1).)*\1\)|\bb(['"])(?:\\.|(?!\2).)*\2""")


class WireLogFilter(logging.Filter):
    """kafka-python at DEBUG logs what it sends and receives as bytes: produce requests with the
    records' keys, values and headers (a dead letter is the original record, personal data and all),
    fetch responses, and the SASL handshake (`\\x00user\\x00password`). Every bytes literal in such a
    record is replaced by `<bytes>`; the rest of the line (which request, which node) stays."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:
            return True
        if "b'" in message or 'b"' in message:
            record.msg, record.args = _BYTES_LITERAL.sub("<bytes>", message), None
        return True


# kafka-python's modules that log at DEBUG (each logger emits its own records: see `HTTP_LOGGERS`).
KAFKA_LOGGERS: tuple[str, ...] = (
    "kafka", "kafka.client_async", "kafka.cluster", "kafka.conn", "kafka.protocol.parser",
    "kafka.net.connection", "kafka.net.transport", "kafka.net.manager", "kafka.net.inet",
    "kafka.net.selector", "kafka.net.sasl.msk", "kafka.net.sasl.sspi", "kafka.net.sasl.oauth",
    "kafka.net.sasl.plain", "kafka.net.sasl.scram", "kafka.consumer.fetcher", "kafka.consumer.group",
    "kafka.coordinator.base", "kafka.coordinator.consumer", "kafka.producer.kafka",
    "kafka.producer.record_accumulator", "kafka.producer.producer_batch",
    "kafka.producer.transaction_manager", "kafka.producer.sender", "kafka.admin.client",
)
_WIRE_FILTER = WireLogFilter()


def guard_http_loggers() -> None:
    """Install `HttpLogFilter` on every logger of `HTTP_LOGGERS`, and `WireLogFilter` on kafka-python's
    (`KAFKA_LOGGERS` and any `kafka.*` logger already created); idempotent."""
    for name in HTTP_LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
    existing = [n for n in logging.root.manager.loggerDict if n == "kafka" or n.startswith("kafka.")]
    for name in {*KAFKA_LOGGERS, *existing}:
        logger = logging.getLogger(name)
        if _WIRE_FILTER not in logger.filters:
            logger.addFilter(_WIRE_FILTER)


guard_http_loggers()
