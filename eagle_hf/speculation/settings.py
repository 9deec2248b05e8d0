"""`DraftSettings`: every drafting setting, one name each, typed and validated.

Sources, lowest to highest precedence: the defaults below, the drafter's ``config.json`` (`draft_settings`), the
call's ``generation_config``, the call's keywords. The `generate()` keywords are the field names, except where
transformers already has a name for the same thing:

=====================================  =======================  ====================================================
``generate()`` keyword                 field                    note
=====================================  =======================  ====================================================
``draft_mode``                         ``mode``
``num_assistant_tokens``               ``depth``                transformers' fixed draft length: a chain of K
                                                                (``"constant"`` schedule, chain mode) unless a
                                                                schedule or a mode is given
``num_assistant_tokens_schedule``      ``schedule``
``assistant_confidence_threshold``     ``confidence_threshold``
``tree_depth``                         ``depth``
``tree_top_k``                         ``top_k``
``tree_total_tokens``                  ``total_tokens``
=====================================  =======================  ====================================================
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field, fields
from typing import Any

from ..errors import EagleCompatibilityError

logger = logging.getLogger(__name__)

MODES = ("chain", "tree")
SCHEDULES = ("adaptive", "constant", "heuristic", "heuristic_transient")
MAX_DEPTH = 32
DRAFT_SOURCES = ("auto", "eagle", "copy", "eagle+copy")
#: valid ranges of the copy source's settings
COPY_RANGES = {"copy_length": (1, 64), "copy_ngram": (1, 16), "copy_branches": (1, 8)}
#: copy settings that also take -1, and what -1 means
COPY_AUTO = {"copy_branches": "two, beside the drafter or alone"}

#: generate() keyword -> field, where the keyword is not the field's own name
CALL_KEYWORDS = {
    "draft_mode": "mode",
    "num_assistant_tokens": "depth",
    "num_assistant_tokens_schedule": "schedule",
    "assistant_confidence_threshold": "confidence_threshold",
    "tree_depth": "depth",
    "tree_top_k": "top_k",
    "tree_total_tokens": "total_tokens",
    "draft_sources": "draft_sources",
    "copy_length": "copy_length",
    "copy_ngram": "copy_ngram",
    "copy_branches": "copy_branches",
}
#: keywords only eagle_hf reads (generate() must not see them)
OWN_KEYWORDS = ("draft_mode", "tree_depth", "tree_top_k", "tree_total_tokens", "draft_sources", "copy_length",
                "copy_ngram", "copy_branches")

#: `draft_settings` keys written by eagle_hf 0.1 drafters -> today's field
LEGACY_KEYS = {"num_draft_tokens": "depth", "max_draft_tokens": "depth"}


def most_nodes(depth: int, top_k: int, total_tokens: int) -> int:
    """The most nodes a tree of `depth` levels holds, the root included: top_k candidates at depth 1, top_k**2 at
    each further depth (the children of the top_k nodes kept there), at most `total_tokens`."""
    return min(total_tokens, 1 + top_k + (depth - 1) * top_k * top_k) if depth > 0 else 1


class DraftSettingsError(EagleCompatibilityError):
    """A drafting setting is unknown, out of range or contradicts another one; the message names the fix."""


@dataclass
class DraftSettings:
    """How one `generate()` call drafts. A chain is a tree with ``top_k = 1``.

    Attributes:
        mode: ``"chain"`` (transformers' assisted loop drafts one path) or ``"tree"`` (our loop verifies a dynamic
            EAGLE-2 draft tree in one target forward).
        schedule: ``"adaptive"`` picks each round's depth from measured costs and running acceptance and decodes
            plainly when drafting does not pay; ``"constant"`` always drafts ``depth``; ``"heuristic"`` /
            ``"heuristic_transient"`` (chain only) are transformers' schedules: +2 after a fully accepted draft,
            -1 otherwise.
        depth: the most drafts on one path: a chain's length, a tree's depth. The adaptive schedule chooses
            each round's depth up to this.
        top_k: tree mode: children expanded per frontier node. Chain mode is ``top_k = 1``.
        total_tokens: tree mode: verified tokens per round, the root included; -1 sizes the tree from this
            device's measured verify costs.
        confidence_threshold: chain (a tree with ``top_k = 1`` alike): end the chain after a draft whose
            probability is below this (transformers' ``assistant_confidence_threshold``); tree: prune branches whose
            cumulative draft probability is below it (a fully pruned tree is a plain step). 0 turns it off.
        probe_every: adaptive: the most plain steps before a dropped drafter tries again (doubles after each failed
            try; a drafter just below break-even tries sooner, once the plain steps absorb a try's expected loss).
        min_gain: adaptive: start drafting when the expected speedup over plain decoding exceeds this ...
        keep_gain: adaptive: ... and keep drafting until it falls below this (hysteresis, after a warm-up).
        draft_sources: who drafts: ``"eagle"`` (the drafter), ``"copy"`` (continuations of earlier occurrences of
            the text's suffix in the prompt and the output, no drafter forwards), ``"eagle+copy"`` (both, merged
            into one tree), or ``"auto"``: both in tree mode, the drafter alone in chain mode (transformers'
            loop verifies one chain; ``"eagle+copy"`` in chain mode runs eagle_hf's loop with ``top_k = 1``).
        copy_length: the longest copy branch (tokens); each round's length follows the copy source's running
            acceptance.
        copy_ngram: the longest suffix matched against the context (tokens); the longest match wins.
        copy_branches: copy branches per round (distinct continuations, the most recent occurrences first); -1:
            two, with or without the drafter (a round where only copies draft is a copy-alone round).
    """

    mode: str = "tree"  # measured: docs/benchmarks.md, "Default mode"
    schedule: str = "adaptive"
    depth: int = 5
    top_k: int = 4
    total_tokens: int = 16
    confidence_threshold: float = 0.0
    probe_every: int = 16
    min_gain: float = 1.0
    keep_gain: float = 0.95
    draft_sources: str = "auto"
    copy_length: int = 16
    copy_ngram: int = 4
    copy_branches: int = -1  # measured: docs/benchmarks.md, "Copy branches per round"
    sources: dict[str, str] = field(default_factory=dict, repr=False, compare=False)  # field -> where it came from

    @property
    def branching(self) -> int:
        """Children per expanded node: ``top_k`` in tree mode, 1 for a chain."""
        return self.top_k if self.mode == "tree" else 1

    @functools.cached_property
    def tree_sizes(self) -> list[int]:
        """By depth (0 to `MAX_DEPTH`), the most nodes a round's tree holds under these settings, the root
        included: what the verify reads of a row drafting that deep (`most_nodes`). Kept once read: read it of
        final settings (a call's are final once routed, which replaces rather than edits them)."""
        return [most_nodes(depth, self.branching, self.total_tokens) for depth in range(MAX_DEPTH + 1)]

    @property
    def copy_branch_count(self) -> int:
        """Copy branches per round: `copy_branches`, or for -1 two (beside the drafter or alone: the drafter
        joins a round's copies only where it adds more than it costs, so its copies are copy drafting's own)."""
        return self.copy_branches if self.copy_branches > 0 else 2

    @property
    def uses_copy(self) -> bool:
        return "copy" in self.draft_sources or (self.draft_sources == "auto" and self.mode == "tree")

    @property
    def uses_eagle(self) -> bool:
        return self.draft_sources != "copy"

    @property
    def adaptive(self) -> bool:
        return self.schedule == "adaptive"

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "sources"}

    # ------------------------------------------------------------------ building and checking
    @classmethod
    def resolve(cls, saved: dict | None, generation_config=None, call: dict | None = None) -> DraftSettings:
        """Defaults < `saved` (a drafter's ``draft_settings``) < ``generation_config`` < `call` keywords."""
        settings, sources = cls(), {}
        names = {f.name for f in fields(cls)} - {"sources"}
        for key, value in (saved or {}).items():
            name = LEGACY_KEYS.get(key, key)
            if name not in names:
                raise DraftSettingsError(
                    f"Unknown key {key!r} in the drafter's config.json `draft_settings`; valid keys: {sorted(names)}. "
                    "Remove it from config.json."
                )
            if key in LEGACY_KEYS:
                logger.info("draft_settings key %r is read as %r", key, name)
            setattr(settings, name, value)
            sources[name] = "the drafter's config.json `draft_settings`"
        for where, values in (("generation_config", _from_generation_config(generation_config)), ("this call", call or {})):
            for keyword, value in values.items():
                if value is None:
                    continue
                setattr(settings, CALL_KEYWORDS.get(keyword, keyword), value)
                sources[CALL_KEYWORDS.get(keyword, keyword)] = f"{keyword}= in {where}"
        if _explicit(generation_config, call, "num_assistant_tokens"):  # transformers' meaning: a chain of K drafts
            if not _explicit(generation_config, call, "num_assistant_tokens_schedule") and settings.schedule == "adaptive":
                settings.schedule = "constant"
                sources["schedule"] = "num_assistant_tokens= (a fixed draft length selects the constant schedule)"
            if not _explicit(generation_config, call, "draft_mode"):
                settings.mode = "chain"
                sources["mode"] = "num_assistant_tokens= (transformers' draft length is a chain's)"
            logger.info("num_assistant_tokens=%s: %s mode, %s schedule", settings.depth, settings.mode, settings.schedule)
        settings.sources = sources
        settings.validate()
        return settings

    def validate(self) -> None:
        def where(name: str) -> str:
            return f"(from {self.sources.get(name, 'the defaults')})"

        if self.mode not in MODES:
            raise DraftSettingsError(f"draft_mode must be 'chain' or 'tree', got {self.mode!r} {where('mode')}.")
        if self.schedule not in SCHEDULES:
            raise DraftSettingsError(
                f"num_assistant_tokens_schedule must be one of {SCHEDULES}, got {self.schedule!r} {where('schedule')}."
            )
        if self.draft_sources not in DRAFT_SOURCES:
            raise DraftSettingsError(
                f"draft_sources must be one of {DRAFT_SOURCES}, got {self.draft_sources!r} {where('draft_sources')}."
            )
        for name in ("depth", "top_k", "total_tokens", "probe_every", *COPY_RANGES):
            value = getattr(self, name)
            if isinstance(value, bool) or int(value) != value:
                raise DraftSettingsError(f"{name} must be an integer, got {value!r} {where(name)}.")
            setattr(self, name, int(value))
        for name in ("confidence_threshold", "min_gain", "keep_gain"):
            setattr(self, name, float(getattr(self, name)))
        if not 1 <= self.depth <= MAX_DEPTH:
            keyword = "num_assistant_tokens" if self.mode == "chain" else "tree_depth"
            raise DraftSettingsError(f"{keyword} must be in 1..{MAX_DEPTH}, got {self.depth} {where('depth')}.")
        for name, (low, high) in COPY_RANGES.items():
            value = getattr(self, name)
            if not low <= value <= high and not (value == -1 and name in COPY_AUTO):
                auto = f" (or -1: {COPY_AUTO[name]})" if name in COPY_AUTO else ""
                raise DraftSettingsError(f"{name} must be in {low}..{high}, got {value} {where(name)}{auto}.")
        if self.top_k < 1:
            raise DraftSettingsError(f"tree_top_k must be at least 1, got {self.top_k} {where('top_k')}.")
        if self.probe_every < 1:
            raise DraftSettingsError(f"probe_every must be at least 1, got {self.probe_every} {where('probe_every')}.")
        if self.total_tokens < 2 and self.total_tokens != -1:
            raise DraftSettingsError(
                f"tree_total_tokens must be at least 2 (the root and one draft), or -1 to size the tree from "
                f"measured costs; got {self.total_tokens} {where('total_tokens')}."
            )
        if not 0.0 <= self.confidence_threshold <= 1.0:
            raise DraftSettingsError(
                f"assistant_confidence_threshold must be in [0, 1], got {self.confidence_threshold} "
                f"{where('confidence_threshold')}."
            )
        if self.keep_gain > self.min_gain:
            raise DraftSettingsError(
                f"keep_gain ({self.keep_gain}) must not exceed min_gain ({self.min_gain}): the adaptive schedule "
                f"starts drafting above min_gain and stops below keep_gain {where('keep_gain')}."
            )


def _from_generation_config(generation_config) -> dict[str, Any]:
    if generation_config is None:
        return {}
    return {k: getattr(generation_config, k, None) for k in CALL_KEYWORDS}


def _explicit(generation_config, call, keyword: str) -> bool:
    """Whether this call (or its generation_config) sets `keyword`."""
    return (call or {}).get(keyword) is not None or (
        generation_config is not None and getattr(generation_config, keyword, None) is not None
    )
