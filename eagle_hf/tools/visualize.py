"""Accepted / rejected draft tokens as coloured HTML: shared by the demo and the notebooks.

Each round of speculative decoding emits a chunk: the drafts the target accepted, then one token of the target's
own (the bonus token after a fully accepted draft, or the recovered token that replaces the first rejected
draft). The rejected drafts are shown struck through; rounds decoded without drafts (plain steps) are grey.

Draft tokens also carry their source: the EAGLE drafter (``"eagle"``), a copy of an earlier span of the prompt or
the output (``"copy"``), or both, when the drafter and a copy proposed the same token at the same place
(``"eagle+copy"``). Accepted drafter tokens are green, accepted copied tokens amber, and a token both proposed is
amber with a green underline (it counts for both sources, as in `SpecDecodeStats.accepted_by_source`).
"""

from __future__ import annotations

import html
from dataclasses import dataclass

LABELS = {
    "accepted": "draft token accepted by the target",
    "target": "token from the target itself (bonus / recovered token)",
    "rejected": "draft token rejected by the target",
    "plain": "plain step: no drafts this round (the adaptive schedule fell back, or none was confident enough)",
}
CSS = """
.tokens {font-family: ui-monospace, monospace; font-size: 15px; line-height: 1.9; white-space: pre-wrap; overflow-wrap: anywhere}
.tok {border-radius: 3px; padding: 1px 0}
.tok-accepted {background: #b7f0c1}
.tok-accepted.src-copy {background: #ffe08a}
.tok-accepted.src-both {background: #ffe08a; box-shadow: inset 0 -3px 0 #2f9e44}
.tok-target {background: #c9dcff}
.tok-rejected {background: #ffc4c4; text-decoration: line-through; color: #8a2020; font-size: 12px}
.tok-plain {background: #e4e4e4; border-bottom: 2px dotted #888}
.legend span {margin-right: 14px}
.legend .tok {white-space: nowrap}
"""


#: who proposed a draft token (the `sources` a draft listener receives) -> (CSS class, legend text)
SOURCES = {
    "eagle": ("src-eagle", "accepted draft from the EAGLE drafter"),
    "copy": ("src-copy", "accepted draft copied from the prompt or earlier output"),
    "eagle+copy": ("src-both", "accepted draft proposed by both: copied, and drafted too"),
}
#: the sources' names in titles and the demo's statistics
SOURCE_NAMES = {"eagle": "drafter", "copy": "copied", "eagle+copy": "copied and drafted"}


@dataclass
class TokenEvent:
    token_id: int
    label: str  # accepted | target | rejected | plain
    source: str | None = None  # drafts: "eagle" | "copy" | "eagle+copy"; None: not a draft, or not recorded


def label_round(chunk: list[int], drafts: list[int] | None, accepted: int,
                sources: list[str] | None = None) -> list[TokenEvent]:
    """Label one round's emitted `chunk`. drafts None: the prefill (the target's token); []: a plain step.
    sources: who proposed each of `drafts` (as a draft listener receives them); None: not recorded."""
    if drafts is None:
        return [TokenEvent(i, "target") for i in chunk]
    if not drafts:
        return [TokenEvent(i, "plain") for i in chunk]
    src = list(sources or ()) + [None] * (len(drafts) - len(sources or ()))
    return (
        [TokenEvent(i, "accepted", s) for i, s in zip(chunk[:accepted], src)]
        + [TokenEvent(i, "rejected", s) for i, s in zip(drafts[accepted:], src[accepted:])]
        + [TokenEvent(i, "target") for i in chunk[accepted:]]
    )


class DraftRecorder:
    """A `draft_listeners` entry that remembers every round: ``generate(..., draft_listeners=[recorder])``.

    `rounds` holds ``(drafts, accepted, the target's token)`` per round, `sources` who proposed each draft of the
    same round ("eagle", "copy" or "eagle+copy")."""

    def __init__(self):
        self.rounds: list[tuple[list[int], int, int]] = []  # (drafts, accepted, the target's token)
        self.sources: list[list[str]] = []  # per round: the source of each of its drafts

    def __call__(self, drafts, accepted: int, last_token: int, sources=None) -> None:
        self.rounds.append((list(drafts), int(accepted), int(last_token)))
        self.sources.append(list(sources) if sources is not None else [])

    def events(self, new_ids: list[int]) -> list[TokenEvent]:
        """Label the generated tokens `new_ids` (prompt excluded) from the recorded rounds."""
        events = label_round(new_ids[:1], None, 0)
        pos = 1
        for (drafts, accepted, last), sources in zip(self.rounds, self.sources):
            chunk = (drafts[:accepted] + [last]) if drafts else [last]
            if new_ids[pos : pos + len(chunk)] != chunk:  # cut short (EOS, stop strings): the rest as is
                break
            events += label_round(chunk, drafts, accepted, sources)
            pos += len(chunk)
        events += [TokenEvent(i, "target") for i in new_ids[pos:]]
        return events


#: whitespace of rejected drafts drawn as symbols: a token that is not part of the output must not shape the text
VISIBLE_WHITESPACE = str.maketrans({"\n": "⏎", " ": "␣", "\t": "⇥", "\r": "␍"})


class TextPieces:
    """The text each output token adds to ``tokenizer.decode(output, skip_special_tokens=True)``.

    Decoded as transformers' `TextStreamer` does: the tokens since the last line break are decoded together, so
    a word-initial space (SentencePiece) or a character split over several byte tokens comes out as in the whole
    output's decoding. A token whose bytes do not form a character yet adds "" (the next one adds it), special
    tokens add "", and `flush` returns what is still held back at the end."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.shown = tokenizer, [], 0

    def add(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 character: wait for its other bytes
            return ""
        piece = text[self.shown :]
        if text.endswith("\n"):
            self.ids, self.shown = [], 0
        else:
            self.shown = len(text)
        return piece

    def flush(self) -> str:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True) if self.ids else ""
        self.ids, self.shown, piece = [], 0, text[self.shown :]
        return piece


def token_span(event: TokenEvent, tokenizer, text: str | None = None) -> str:
    """One token as a coloured span ("" when it shows no text).

    `text`: what an output token adds to the output (`TextPieces`); default: its own decoding, with special
    tokens (``<|im_end|>``) hidden. Rejected drafts are not part of the output: their whitespace is drawn as
    visible symbols (⏎ ␣ ⇥) that take no layout effect."""
    if event.label == "rejected":
        text = tokenizer.decode([event.token_id], skip_special_tokens=False).translate(VISIBLE_WHITESPACE)
    elif text is None:
        if event.token_id in set(getattr(tokenizer, "all_special_ids", ()) or ()):
            return ""
        text = tokenizer.decode([event.token_id], skip_special_tokens=False)
    if not text:
        return ""
    if event.source in SOURCES:
        css, title = f" {SOURCES[event.source][0]}", f"{event.label}: {SOURCE_NAMES[event.source]}"
    else:
        css, title = "", event.label
    return f'<span class="tok tok-{event.label}{css}" title="{title}">{html.escape(text)}</span>'


class SpanRenderer:
    """Renders events into spans as they arrive (a streaming display): output tokens through `TextPieces`."""

    def __init__(self, tokenizer):
        self.tokenizer, self.pieces, self.spans = tokenizer, TextPieces(tokenizer), []
        self.last = TokenEvent(-1, "target")  # the latest output token's label and source

    def add(self, events: list[TokenEvent]) -> None:
        for e in events:
            if e.label == "rejected":
                self.spans.append(token_span(e, self.tokenizer))
            else:
                self.spans.append(token_span(e, self.tokenizer, self.pieces.add(e.token_id)))
                self.last = TokenEvent(-1, e.label, e.source)

    def finish(self) -> None:
        """Show the bytes still held back (an output that ends inside a character)."""
        rest = self.pieces.flush()
        if rest:
            self.spans.append(token_span(self.last, self.tokenizer, rest))


def tokens_html(events: list[TokenEvent], tokenizer, with_style: bool = False, spans: list[str] | None = None) -> str:
    """The labelled tokens as HTML; `spans`: already rendered spans of the events (`SpanRenderer`, streaming)."""
    if spans is None:
        renderer = SpanRenderer(tokenizer)
        renderer.add(events)
        renderer.finish()
        spans = renderer.spans
    style = f"<style>{CSS}</style>" if with_style else ""
    return f'{style}<div class="tokens">{"".join(spans)}</div>'


def legend_html(sources: bool = True) -> str:
    """The labels' colours explained; `sources`: the accepted drafts by source (drafter, copied, both)."""
    def item(css: str, name: str, text: str) -> str:
        return f'<span><span class="tok {css}">&nbsp;{name}&nbsp;</span> {text}</span>'

    if sources:
        names = {"eagle": "drafter", "copy": "copied", "eagle+copy": "both"}
        accepted = [item(f"tok-accepted {css}", f"accepted · {names[k]}", text) for k, (css, text) in SOURCES.items()]
    else:
        accepted = [item("tok-accepted", "accepted", LABELS["accepted"])]
    rest = [item(f"tok-{k}", k, v) for k, v in LABELS.items() if k != "accepted"]
    return f'<div class="legend">{"".join(accepted + rest)}</div>'


class LabelledTokens:
    """Generated tokens with their labels; renders inline in Jupyter (``_repr_html_``)."""

    def __init__(self, events: list[TokenEvent], tokenizer, stats=None):
        self.events, self.tokenizer, self.stats = events, tokenizer, stats

    def counts(self) -> dict[str, int]:
        """Tokens per label: accepted, target, rejected, plain."""
        out = dict.fromkeys(LABELS, 0)
        for e in self.events:
            out[e.label] += 1
        return out

    def accepted_by_source(self) -> dict[str, int]:
        """Accepted drafts by who proposed them: "eagle" (the drafter alone), "copy" (a copy alone), "eagle+copy"
        (both). `SpecDecodeStats.accepted_by_source` counts a token both proposed under each source instead."""
        out = dict.fromkeys(SOURCES, 0)
        for e in self.events:
            if e.label == "accepted" and e.source in out:
                out[e.source] += 1
        return out

    def _repr_html_(self) -> str:
        summary = f"<p>{html.escape(self.stats.summary())}</p>" if self.stats is not None else ""
        return f"<style>{CSS}</style>{legend_html()}{tokens_html(self.events, self.tokenizer)}{summary}"


def generate_labelled(target, tokenizer, drafter, inputs: dict, **generate_kwargs) -> LabelledTokens:
    """Run ``target.generate(**inputs, assistant_model=drafter, ...)`` and label every generated token."""
    from ..speculation.stats import last_stats

    recorder = DraftRecorder()
    out = target.generate(**inputs, assistant_model=drafter, draft_listeners=[recorder], **generate_kwargs)
    new_ids = out[0, inputs["input_ids"].shape[1] :].tolist()
    return LabelledTokens(recorder.events(new_ids), tokenizer, last_stats())
