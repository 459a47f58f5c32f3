"""Chat records -> token ids + an assistant-token loss mask, for any chat template.

The ids are exactly those of ``apply_chat_template(messages, tokenize=True)`` (the rendered text
tokenised with ``add_special_tokens=False``). The mask marks what the target generates in each
assistant turn: the reply and its end-of-turn token, nothing of the system/user turns, role headers
or the formatting a template writes after the end-of-turn token.

- A template with ``{% generation %}`` markers: the marked spans (``return_assistant_tokens_mask``).
- Any other template (ChatML, Llama-3, Qwen2.5, ...): the spans are found by rendering the
  conversation prefix by prefix and diffing. Turn i's span starts where the rendering of
  ``messages[:i]`` with the generation prompt ends and ends where that of ``messages[:i+1]`` ends;
  both must be prefixes of the whole conversation's rendering, else the template renders history
  differently from the last turn (e.g. it strips reasoning from earlier turns) and the record is
  refused (``DataError``) rather than given a wrong mask. The tokens overlapping a span are masked
  (the rule of the generation markers), then the span is cut after its end-of-turn token
  (``_end_of_turn``).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "bot": "assistant",
}
CHAT_ROLES = ("system", "user", "assistant")
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
_SENTINEL = "QUERY7f3aSENTINEL"  # text no template writes itself


class DataError(ValueError):
    """A data file, record or tokenizer cannot be used for training; the message names which."""


def chat_template_of(tokenizer: Any) -> str | None:
    """The tokenizer's default chat template text (None when it has none)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return template or None


def check_chat_template(tokenizer: Any, where: str = "tokenizer") -> None:
    """Chat records need a chat template (with or without ``{% generation %}`` markers)."""
    if chat_template_of(tokenizer) is None:
        raise DataError(
            f"{where}: has no chat_template; chat records are rendered with the target's own template "
            f"(set tokenizer.chat_template, or use {{'text': ...}} records)"
        )


def messages_of(record: dict, where: str) -> list[dict[str, str]] | None:
    """The chat of a ``messages`` or ShareGPT ``conversations`` record (None for a text record)."""
    if "messages" in record:
        out = []
        for m in record["messages"]:
            if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES or not isinstance(m.get("content"), str):
                raise DataError(
                    f"{where}: each message needs 'role' in {CHAT_ROLES} and a string 'content', got {m!r:.120}"
                )
            out.append({"role": m["role"], "content": m["content"]})
        return out
    if "conversations" in record:
        out = []
        for m in record["conversations"]:
            role = SHAREGPT_ROLES.get(str(m.get("from", "")).lower()) if isinstance(m, dict) else None
            if role is None or not isinstance(m.get("value"), str):
                raise DataError(
                    f"{where}: each ShareGPT turn needs 'from' in {sorted(SHAREGPT_ROLES)} and a string 'value', got "
                    f"{m!r:.120}"
                )
            out.append({"role": role, "content": m["value"]})
        return out
    return None


def special_ids(tokenizer: Any) -> set[int]:
    """Ids of the tokenizer's special (control) tokens: its named ones and every added token marked special."""
    ids = {int(i) for i in getattr(tokenizer, "all_special_ids", []) or []}
    for i, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(tok, "special", False):
            ids.add(int(i))
    return ids


def _eos_ids(tokenizer: Any) -> set[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(eos)} if isinstance(eos, (int, np.integer)) else {int(e) for e in eos}


def render(
    tokenizer: Any,
    messages: list[dict[str, str]],
    *,
    add_generation_prompt: bool = False,
    where: str = "record",
    turn: int | None = None,
) -> str:
    """The template's text for ``messages``; a template error becomes a DataError naming the record."""
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except (TemplateError, ValueError, TypeError, KeyError) as e:
        at = "" if turn is None else f" (rendering turns 0..{turn})"
        raise DataError(f"{where}: the chat template cannot render this conversation{at}: {e}") from e


def _offsets(tokenizer: Any, text: str, where: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids, character start/end [L, 2]) of ``text`` tokenised as ``apply_chat_template(tokenize=True)`` does."""
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(
            f"{where}: the chat template has no {{% generation %}} markers, so assistant tokens are located by "
            f"character offsets, which a slow (Python) tokenizer does not give; load the fast tokenizer "
            f"(tokenizer.json) or add {{% generation %}}...{{% endgeneration %}} to the template"
        )
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError as e:
        raise DataError(f"{where}: the tokenizer gives no character offsets ({e}); load a fast tokenizer") from e
    ids = np.asarray(enc["input_ids"], np.int32)
    offsets = np.asarray(enc["offset_mapping"], np.int64).reshape(len(ids), 2)
    return ids, offsets


def assistant_spans(
    messages: list[dict[str, str]], tokenizer: Any, where: str = "record"
) -> tuple[str, list[tuple[int, int, int]]]:
    """(the whole conversation's text, [(turn index, start, end)] character span of each assistant turn).

    The span runs from the end of the prompt the model answers (``messages[:i]`` + generation prompt)
    to the end of the rendering with turn i; both must be prefixes of the whole text (DataError if not).
    """
    full = render(tokenizer, messages, where=where)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if i == 0:
            raise DataError(
                f"{where}: turn 0 is an assistant turn; the conversation needs a user (or system) turn before it"
            )
        before = render(tokenizer, messages[:i], add_generation_prompt=True, where=where, turn=i - 1)
        upto = render(tokenizer, messages[: i + 1], where=where, turn=i)
        for text, what in ((before, f"turns 0..{i - 1} with the generation prompt"), (upto, f"turns 0..{i}")):
            if not full.startswith(text):
                raise DataError(
                    f"{where}: turn {i} (assistant): the rendering of {what} is not a prefix of the whole "
                    "conversation's rendering: the template renders earlier turns differently once later turns follow "
                    "(e.g. it drops "
                    f"reasoning from history), so the assistant tokens cannot be located. Add {{% generation %}}..."
                    f"{{% endgeneration %}} markers to the template, or split the record into single-turn records"
                )
        if len(upto) < len(before):
            raise DataError(
                f"{where}: turn {i} (assistant): the rendering with this turn is shorter than the prompt before it"
            )
        spans.append((i, len(before), len(upto)))
    return full, spans


def _end_of_turn(
    ids: np.ndarray, offsets: np.ndarray, text: str, first: int, stop: int, specials: set[int], eos: set[int]
) -> int:
    """Index one past the last token of the span tokens ``first..stop-1`` that the model generates.

    Rule: the turn ends at the first EOS in the span, or at the first special token of the span's
    trailing run of special tokens and whitespace (ChatML's ``<|im_end|>`` before "\\n", Llama-3's
    ``<|eot_id|>``), whichever comes first. That token is kept (the target generates it, then stops);
    what follows it is template formatting, never generated, so not trained. A span with no special
    token in its trailing run (a template without end-of-turn tokens) is kept whole.
    """
    cut = stop
    k = stop - 1
    while k >= first:
        t = int(ids[k])
        if t in specials:
            cut = k + 1
        elif text[offsets[k, 0] : offsets[k, 1]].strip():
            break
        k -= 1
    for k in range(first, cut):
        if int(ids[k]) in eos:
            return k + 1
    return cut


def chat_ids_and_mask(
    messages: list[dict[str, str]], tokenizer: Any, where: str = "record", *, method: str = "auto"
) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [L], loss mask uint8 [L]) of a conversation; see the module docstring.

    ``method``: "auto" (markers when the template has them, else prefix diffing), "markers" or "prefix".
    """
    if method not in ("auto", "markers", "prefix"):
        raise ValueError(f"method must be 'auto', 'markers' or 'prefix', got {method!r}")
    check_chat_template(tokenizer, where)
    if method == "markers" or (method == "auto" and _GENERATION.search(chat_template_of(tokenizer))):
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, return_assistant_tokens_mask=True, return_dict=True
        )
        return np.asarray(out["input_ids"], np.int32), np.asarray(out["assistant_masks"], np.uint8)
    full, spans = assistant_spans(messages, tokenizer, where)
    ids, offsets = _offsets(tokenizer, full, where)
    mask = np.zeros(len(ids), np.uint8)
    specials, eos = special_ids(tokenizer), _eos_ids(tokenizer)
    for _, lo, hi in spans:
        # The tokens overlapping the span (as for generation markers): a token that straddles the
        # header/reply boundary (" def" after "assistant:") holds the reply's first characters.
        first, stop = int(np.searchsorted(offsets[:, 1], lo, "right")), int(np.searchsorted(offsets[:, 0], hi, "left"))
        mask[first : _end_of_turn(ids, offsets, full, first, stop, specials, eos)] = 1
    return ids, mask


def pre_query(tokenizer: Any, system: str | None = None) -> str:
    """The template's text before a user turn's content (its BOS, default or given system prompt, user
    header): what a chat model continues with a user query (Magpie)."""
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": _SENTINEL}
    ]
    text = render(tokenizer, messages, where="chat template")
    if text.count(_SENTINEL) != 1:
        raise DataError(
            "chat template: a user turn's content does not appear once, verbatim, in its rendering; "
            "the text before a user query cannot be found"
        )
    return text[: text.index(_SENTINEL)]


def end_of_turn_ids(tokenizer: Any) -> set[int]:
    """The ids that end a turn in this template: the tokenizer's EOS, the token that closes a user turn
    (the first special token after its content) and the one that closes an assistant turn (the
    ``_end_of_turn`` rule), found by rendering a probe conversation. Generation stops at any of them."""
    out = _eos_ids(tokenizer)
    specials = special_ids(tokenizer)
    probe = [{"role": "user", "content": _SENTINEL}, {"role": "assistant", "content": "Hello."}]
    try:
        text = render(tokenizer, probe[:1], where="chat template")
        ids, offsets = _offsets(tokenizer, text, "chat template")
        after = text.index(_SENTINEL) + len(_SENTINEL)
        user_end = next((int(t) for t, (s, _) in zip(ids, offsets) if s >= after and int(t) in specials), None)
        if user_end is not None:
            out.add(user_end)
        ids, mask = chat_ids_and_mask(probe, tokenizer, "chat template", method="prefix")
        if mask.any() and int(ids[np.nonzero(mask)[0][-1]]) in specials:
            out.add(int(ids[np.nonzero(mask)[0][-1]]))
    except (DataError, ValueError):
        pass  # a template that cannot render the probe: the EOS alone
    return out
