"""What the demo's synthetic agent knows and is asked: Tideline's help pages (`TOPICS`: per topic the
questions, the documents that answer them, facts no document states, the tool a lookup calls) and the
keyword retriever over them (`Index`), plus how a frustrated user repeats a question and gives up.

A corpus of its own so the agent (`tracejudge.consumer.demo.agent`) stays about serving requests; the
document URIs here are what a trace's RETRIEVER span states as `doc_uri`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

# How a user who was not helped asks again, and how they give up (the last turn of a frustrated
# conversation). Repeating the question and giving up are what a frustration judge looks for.
REPEATS: tuple[str, ...] = ("{question}", "I asked: {question}", "Again: {question}",
                            "That does not answer it. {question}")
GIVE_UPS: tuple[str, ...] = ("Forget it, this is not helping. I will contact support.",
                             "Never mind, I give up.",
                             "This is useless, forget it.")


@dataclass(frozen=True, slots=True)
class CorpusDoc:
    doc_id: str
    uri: str
    text: str


@dataclass(frozen=True, slots=True)
class Topic:
    """Questions about one subject, the documents that answer them and facts nobody wrote down."""

    app: str
    name: str
    questions: tuple[str, ...]
    docs: tuple[CorpusDoc, ...]
    # Plausible, on-topic, and stated by no document: what an ungrounded answer says.
    invented: tuple[str, ...]
    # (tool name, argument name, argument values) when answering needs a lookup.
    tool: tuple[str, str, tuple[str, ...]] | None = None


def _docs(base: str, *texts: str) -> tuple[CorpusDoc, ...]:
    slug = base.rsplit("/", 1)[-1]
    return tuple(CorpusDoc(f"{slug}-{i}", f"https://docs.tideline.example/{base}#p{i}", t)
                 for i, t in enumerate(texts, 1))


TOPICS: tuple[Topic, ...] = (
    Topic("support-bot", "plans",
          ("Which plans does Tideline offer?", "What is included in the Tideline Team plan?",
           "How many members can a Free workspace have?"),
          _docs("billing/plans",
                "Tideline offers three plans: Free, Team and Enterprise.",
                "The Free plan allows up to 5 members and 3 active boards per workspace.",
                "The Team plan costs 8 dollars per member per month and includes unlimited boards."),
          ("Tideline has a Starter plan at 2 dollars that includes phone support around the clock.",
           "Every plan comes with a lifetime licence after 24 months of payments.")),
    Topic("support-bot", "refunds",
          ("Can I get a refund for my Tideline subscription?", "How long do refunds take?",
           "What is the refund policy for annual billing?"),
          _docs("billing/refunds",
                "Annual subscriptions can be refunded in full within 30 days of purchase.",
                "Monthly subscriptions are not refunded, but you can cancel at any time.",
                "Refunds are issued to the original payment method within 5 to 10 business days."),
          ("Refunds are paid out as store credit which expires after 90 days.",
           "A cancellation fee of 15 percent is deducted from every refund."),
          ("lookup_invoice", "invoice_id", ("INV-1042", "INV-2210", "INV-3377"))),
    Topic("support-bot", "sso",
          ("Does Tideline support single sign-on?", "How do I set up SAML SSO?",
           "Which identity providers work with Tideline SSO?"),
          _docs("security/sso",
                "Single sign-on with SAML 2.0 is available on the Enterprise plan.",
                "Tideline SSO has been tested with Okta, Azure AD and Google Workspace.",
                "An owner enables SSO under Settings, Security, then uploads the identity provider "
                "metadata."),
          ("SSO is included in the Free plan when a workspace verifies two domains.",
           "Tideline only supports LDAP bind authentication for single sign-on."),
          ("get_sso_config", "workspace_id", ("ws-12", "ws-480", "ws-733"))),
    Topic("support-bot", "export",
          ("How can I export my Tideline data?", "Can I export boards to CSV?",
           "Is there a full workspace backup?"),
          _docs("data/export",
                "Boards can be exported to CSV or JSON from the board menu.",
                "Workspace owners can request a full export, delivered as a ZIP archive by email.",
                "Full exports include attachments and are available for 7 days after they are ready."),
          ("Exports are mailed on a USB drive to the billing address within a month.",
           "Only PDF exports are supported, one task per page."),
          # Only a workspace owner may export: the agent looks up the asker's account first.
          ("get_account", "account_id", ("acct-77", "acct-301", "acct-958"))),
    Topic("support-bot", "account",
          ("Why was my Tideline account suspended?", "What plan is my workspace on?",
           "How do I transfer workspace ownership?"),
          _docs("account/suspension",
                "An account is suspended after three failed payment attempts on its workspace plan.",
                "Workspace ownership is transferred by the current owner under Settings, Members.",
                "Suspended accounts stay readable for 60 days before they are deleted."),
          ("Suspended workspaces are deleted immediately and cannot be recovered.",
           "Ownership can only be transferred by mailing a signed paper form."),
          ("get_account", "account_id", ("acct-77", "acct-301", "acct-958"))),
    Topic("support-bot", "mobile",
          ("Is there a Tideline mobile app?", "Does the mobile app work offline?",
           "Which phones support the Tideline app?"),
          _docs("apps/mobile",
                "Tideline has mobile apps for iOS 16 or later and Android 11 or later.",
                "The mobile app caches recent boards so they can be read offline.",
                "Changes made offline in the mobile app sync when the device reconnects."),
          ("The mobile app is a paid add-on that costs 4 dollars per device.",
           "Offline mode requires a smartwatch paired with the phone.")),
    Topic("docs-qa", "auth",
          ("How do I authenticate to the Tideline API?", "Where do I create an API token?",
           "Do Tideline API tokens expire?"),
          _docs("api/authentication",
                "API requests are authenticated with a bearer token in the Authorization header.",
                "Personal API tokens are created under Settings, Developer, API tokens.",
                "Tokens expire after 90 days unless they are rotated earlier."),
          ("The API authenticates requests with a signed cookie that lasts one hour.",
           "Tokens never expire and cannot be revoked once created.")),
    Topic("docs-qa", "rate-limits",
          ("What are the Tideline API rate limits?", "What happens when I exceed the rate limit?",
           "How many API requests can I make per minute?"),
          _docs("api/rate-limits",
                "The rate limit is 600 API requests per minute for each token.",
                "Requests that exceed the rate limit get HTTP 429 with a Retry-After header.",
                "Bulk endpoints count as one request per 100 items."),
          ("The API allows 10 requests per day on every plan.",
           "Requests over the limit are queued for an hour and answered by email.")),
    Topic("docs-qa", "pagination",
          ("How does pagination work in the Tideline API?", "How do I get the next page of tasks?",
           "What is the maximum page size?"),
          _docs("api/pagination",
                "Pagination in the API is cursor based: list endpoints return a next_cursor field when "
                "more results exist.",
                "Pass the cursor as the cursor query parameter to fetch the next page.",
                "The page size defaults to 50 and can be raised to at most 200 with the limit parameter."),
          ("Pages are numbered and the API returns all results when page is zero.",
           "The maximum page size is 10000 records for Enterprise tokens.")),
    Topic("docs-qa", "webhooks",
          ("How do Tideline webhooks work?", "How do I verify a webhook signature?",
           "Are failed webhook deliveries retried?"),
          _docs("api/webhooks",
                "Webhooks work by sending a POST request with a JSON body when a task changes.",
                "Each delivery is signed with HMAC SHA-256 in the X-Tideline-Signature header.",
                "Failed deliveries are retried up to 8 times with exponential backoff."),
          ("Webhooks are delivered over FTP once a night in a single batch.",
           "Signatures use MD5 and are sent in the query string."),
          ("list_webhook_deliveries", "webhook_id", ("wh-5", "wh-81", "wh-204"))),
    Topic("docs-qa", "status",
          ("Is Tideline down right now?", "Is there an outage in the EU region?",
           "Where can I check API availability?"),
          _docs("api/status",
                "Current API availability, outages and downtime are published on status.tideline.example.",
                "The API is served from the us-east and EU central regions, which fail over independently.",
                "Scheduled maintenance is announced 72 hours in advance."),
          ("The API shuts down every Sunday for a full day of maintenance.",
           "Outages are only announced through the mobile app."),
          ("check_api_status", "region", ("us-east", "eu-central"))),
    Topic("docs-qa", "sdks",
          ("Is there an official Tideline SDK?", "How do I install the Python SDK?",
           "Which languages have Tideline client libraries?"),
          _docs("api/sdks",
                "Official SDK client libraries exist for three languages: Python, TypeScript and Go.",
                "Install the Python SDK with pip install tideline.",
                "The SDKs retry HTTP 429 responses automatically."),
          ("The only SDK is written in COBOL and ships on request.",
           "The Python SDK must be compiled from source with a licence key.")),
)

_WORD = re.compile(r"[a-z0-9]+")
_STOPWORDS = frozenset(("a", "an", "the", "is", "are", "do", "does", "i", "my", "me", "can", "how", "what",
                        "which", "where", "when", "why", "to", "of", "in", "on", "for", "with", "be", "and",
                        "or", "there", "it", "at", "by", "from", "get"))


def terms(text: str) -> set[str]:
    # A five-letter prefix is a crude stemmer ("refunds"/"refunded"), enough for a toy retriever.
    return {w[:5] for w in _WORD.findall(text.lower()) if w not in _STOPWORDS}


class Index:
    """Keyword retrieval weighted by inverse document frequency: small, deterministic, mostly right."""

    def __init__(self, docs: Sequence[CorpusDoc]) -> None:
        self._docs = [(d, terms(d.text)) for d in docs]
        df: dict[str, int] = {}
        for _, doc_terms in self._docs:
            for term in doc_terms:
                df[term] = df.get(term, 0) + 1
        self._idf = {term: math.log(len(docs) / n) for term, n in df.items()}

    def search(self, query: str, k: int) -> list[CorpusDoc]:
        q = terms(query)
        scored = sorted(self._docs, key=lambda dt: (-sum(self._idf[t] for t in q & dt[1]), dt[0].doc_id))
        return [d for d, _ in scored[:k]]
