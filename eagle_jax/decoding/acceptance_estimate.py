"""What the drafter's acceptance is expected to be, per draft position: ``AcceptanceEstimate``, learnt from
every round's accepted count (decaying, so it follows a change of workload), blended with a prior, and
carried from the prompts before to a new one as far as they were seen to be alike. ``decoding/autospec.py``
reads it against the measured round costs to choose the depth."""

from __future__ import annotations

import math
from collections import deque
from typing import Sequence

import numpy as np

DEEPEST = 7  # the deepest chain an estimate covers (auto's deepest depth)
KEEP = 0.97  # weight of the past per round in the acceptance estimate (a memory of ~30 rounds)
# A new prompt starts from its pair's estimate with at most this many rounds of its evidence: acceptance
# depends on the prompt more than on anything else, so a few probe rounds of its own must be able to
# outweigh what the prompts before it did (else one hard prompt keeps the next ones decoding plainly).
CARRY_ROUNDS = 6.0
# ... and the deeper positions at most this many: a prompt's first rounds are often probes, which see the
# first draft only, and a deeper position without evidence of its own falls back to the position before
# it (``p``), i.e. to this prompt's first-draft rate; carried at full weight, the earlier prompts'
# deeper rates outweighed it, and a call after a hard prompt left speculation where a chain was 1.3x
# plain decoding (bfloat16, where a round that feeds the drafter costs 1.5x a plain one).
CARRY_DEEP_ROUNDS = 2.0
# Those caps hold while prompts are seen to differ. How much they differ is measured: the spread of the
# first-draft rates of the last PROMPT_MEMORY prompts (each over at least PROMPT_MIN_ROUNDS rounds of its
# own) beyond what their rounds' sampling explains. Where prompts are alike (sampling at T=1: every
# prompt's rate within its own noise), a new prompt carries as many rounds as that spread warrants
# (``carry_rounds``, empirical Bayes): else its first few rounds, noisy, pick the depth their luck
# favours (a lucky first 4 rounds priced a chain of 3 at 1.2x its worth and it ran 8 rounds, call after call).
PROMPT_MEMORY = 32
PROMPT_MIN_ROUNDS = 8
PROMPTS_TO_CARRY = 4  # prompts seen before the spread is read
# The same for draft positions a round did not reach, in a prompt's own estimate while prompts are seen to differ:
# they fall back to the prior sooner. A pair's estimate, and a prompt's where prompts are alike, keep them as the rest
# (``untried_keep``): their rates hold from prompt to prompt, and faded, each fell back to the one before it, below
# its own (T=1: a chain of 1 reached ~1.5 tokens a round and one of 3 ~1.9, so the deeper drafts are accepted more
# often than the first), and a chain of 1 ran call after call where a chain of 3 was ~10% faster.
KEEP_UNTRIED = 0.85
PRIOR = 0.6  # acceptance of a draft assumed before any is observed ...
# ... until a prompt finished: a new prompt's first draft then falls back to the mean of the finished prompts'
# rates (the empirical-Bayes prior's mean), not to PRIOR. With a weak drafter (SmolLM2's: first drafts accepted
# 10-15%), PRIOR's 3 rounds at 0.6 outweighed the 6 rounds a prompt carries, and 4 probe rounds read ~0.2-0.3:
# a chain of 3 looked 4% faster than plain decoding, and ran in most calls at 0.8-0.9x its speed.
PRIOR_ROUNDS = 3.0  # the prior's weight, in rounds


def prompts_alike(carry: float) -> bool:
    """Whether prompts worth ``carry`` rounds of the pair's evidence each (``carry_rounds``) count as alike: their
    carry is above the cap of prompts seen to differ."""
    return carry > CARRY_ROUNDS


class AcceptanceEstimate:
    """Per draft position i, the chance ``p[i]`` that draft i is accepted given drafts 0..i-1 were.

    Decayed sums over rounds of trials (rounds whose chain reached draft i) and hits (rounds that
    accepted it); each round weighs 1 however many rows it ran, and the past weighs ``KEEP`` per
    round. ``p[0]`` falls back to ``prior`` and ``p[i]`` to ``p[i-1]`` with ``PRIOR_ROUNDS`` of weight,
    so a position never tried is assumed as good as the one before it."""

    def __init__(self, max_depth: int = DEEPEST):
        self.trials = np.zeros(max_depth)
        self.hits = np.zeros(max_depth)
        self.unobserved = float("inf")  # rounds decoded since acceptance was last observed (``age``): never yet
        self.own = np.zeros(2)  # this prompt's own first-draft (hits, trials), undecayed, carried evidence apart
        self.prompts: deque[tuple[float, float]] = deque(maxlen=PROMPT_MEMORY)  # finished prompts' ``own``
        # the past's weight per round at positions a round did not reach: a pair's estimate keeps what its deeper
        # drafts did (a new prompt carries little of it where prompts differ); a prompt's own, ``for_new_prompt``'s
        self.untried_keep = KEEP
        self.prior = PRIOR  # the first draft's rate before evidence: ``PRIOR``, or the finished prompts' (``for_new_prompt``)

    def copy(self) -> "AcceptanceEstimate":
        new = AcceptanceEstimate(len(self.trials))
        new.trials, new.hits, new.unobserved, new.own = self.trials.copy(), self.hits.copy(), self.unobserved, self.own.copy()
        new.prompts = deque(self.prompts, maxlen=PROMPT_MEMORY)
        new.untried_keep, new.prior = self.untried_keep, self.prior
        return new

    @property
    def fresh(self) -> bool:
        """Whether nothing was observed yet: neither a round nor a finished prompt."""
        return not self.prompts and not self.trials.any()

    def to_dict(self) -> dict:
        """What the traffic showed (the decayed evidence per draft position, the finished prompts' first-draft
        evidence), kept on disk with the pair's costs (``SpanCosts.keep``)."""
        return {"trials": self.trials.tolist(), "hits": self.hits.tolist(), "prompts": [list(p) for p in self.prompts],
                "unobserved": None if math.isinf(self.unobserved) else self.unobserved}

    def restore(self, data: dict) -> None:
        """Starts from ``to_dict``'s ``data`` (an earlier process's traffic), as if this process had seen it: the
        evidence decays as the new traffic comes, a new prompt carries as much of it as the prompts were seen
        alike, and the rounds decoded since acceptance was last observed (``unobserved``) count on, so probing
        goes on where it was. Checked whole before anything changes (ValueError)."""
        trials, hits = np.asarray(data["trials"], float), np.asarray(data["hits"], float)
        prompts = np.asarray(data["prompts"], float).reshape(-1, 2)
        unobserved = math.inf if data["unobserved"] is None else float(data["unobserved"])
        if not unobserved >= 0:
            raise ValueError(f"rounds since acceptance was observed {data['unobserved']!r}, not a count")
        if trials.shape != self.trials.shape or hits.shape != trials.shape:
            raise ValueError(f"acceptance over {trials.shape}/{hits.shape} draft positions, expected {self.trials.shape}")
        if not (np.isfinite(trials).all() and np.isfinite(hits).all() and np.isfinite(prompts).all()):
            raise ValueError("acceptance evidence not finite")
        if (hits < 0).any() or (hits > trials + 1e-6).any() or (prompts[:, 0] < 0).any() or (prompts[:, 0] > prompts[:, 1] + 1e-6).any() \
                or (prompts[:, 1] <= 0).any():
            raise ValueError("acceptance hits outside 0..trials")
        self.trials, self.hits, self.unobserved = trials, hits, unobserved
        self.prompts = deque(((float(h), float(t)) for h, t in prompts), maxlen=PROMPT_MEMORY)

    def for_new_prompt(self, carry: float | None = None, alone: bool = False) -> "AcceptanceEstimate":
        """A copy to start a new prompt's estimate from: the same rates, with at most ``CARRY_ROUNDS`` rounds
        of evidence for the first draft and ``CARRY_DEEP_ROUNDS`` for each deeper one; or, where the prompts
        before were seen to be alike (``carry_rounds`` above those caps), ``carry_rounds`` for every position,
        the first draft's at the finished prompts' mean rate (their rounds undecayed: the decayed
        estimate holds ~30 rounds, whose noise alone swung a chain of 3 in and out of favour at T=1). Once a
        prompt finished, the first draft falls back to that rate (``prior``).
        ``carry``: ``carry_rounds()`` when the caller has it already (a call reads it once for all its rows).
        ``alone``: the prompt's rounds are priced alone (a call of one row), not as one of a batch's rows: where
        prompts differ it carries only what their spread warrants (``_carry_caps``)."""
        new = AcceptanceEstimate(len(self.trials))
        new.trials, new.hits, new.unobserved = self.trials.copy(), self.hits.copy(), self.unobserved
        carry = self.carry_rounds() if carry is None else carry
        new.untried_keep = KEEP if prompts_alike(carry) else KEEP_UNTRIED
        cap = self._carry_caps(carry, alone)
        scale = np.minimum(1.0, cap / np.maximum(new.trials, 1e-12))
        new.trials *= scale
        new.hits *= scale
        if self.prompts:
            new.prior = self._prompts_rate()[0]
            if prompts_alike(carry):
                new._first_from_prompts(self, carry)
        return new

    def _carry_caps(self, carry: float, alone: bool) -> np.ndarray:
        """Rounds of the pair's evidence a new prompt carries per draft position (``for_new_prompt``). Priced alone
        where prompts differ: for its first draft what their spread warrants less the prior's rounds (at the finished
        prompts' mean rate), up to ``CARRY_ROUNDS`` (all of them until the spread is known), ``CARRY_DEEP_ROUNDS``
        for each deeper one. Greedy, after easy prompts, 6 carried rounds of the first draft, the prior's 3 and up to
        6 of each deeper one kept a hard prompt's estimate near the easy ones' for ~25 rounds, through five chunks of
        chains of 5-7 (its call 1.39x plain decoding). A batch's rows keep the larger carry: a call ends with its
        slowest row, and the slowest of several estimates is read lower the noisier each is (carrying this little at
        batch 4, greedy calls decoded plainly where a chain of 3 was 1.2x faster)."""
        cap = np.full(len(self.trials), CARRY_DEEP_ROUNDS)
        if alone and not prompts_alike(carry):
            spread_known = len(self.prompts) >= PROMPTS_TO_CARRY
            cap[0] = min(max(carry - PRIOR_ROUNDS, 0.0), CARRY_ROUNDS) if spread_known else CARRY_ROUNDS
            return cap
        cap[0] = CARRY_ROUNDS
        return np.maximum(cap, carry)

    def _prompts_rate(self) -> tuple[float, float]:
        """(the finished prompts' mean first-draft rate, each prompt one say: a hard one's many rounds not more;
        their rounds in all)."""
        hits, trials = np.array(self.prompts).T
        return float(np.mean(hits / trials)), float(trials.sum())

    def _first_from_prompts(self, pair: "AcceptanceEstimate", carry: float) -> None:
        """Sets this estimate's first-draft evidence to ``pair``'s finished prompts' mean rate, worth their rounds
        (undecayed) up to ``carry``."""
        rate, rounds = pair._prompts_rate()
        self.trials[0] = min(carry, rounds)
        self.hits[0] = self.trials[0] * rate

    def judged_over_prompts(self, row: "AcceptanceEstimate", carry: float) -> "AcceptanceEstimate":
        """A finished row's estimate as hindsight reads it where prompts were seen alike (``carry``): its first draft
        at the finished prompts' mean rate (``finish_prompt`` first), the deeper ones its own. A row's own estimate
        holds its last ~30 rounds: at T=1, where plain decoding and a chain of 1 tie, their noise alone swung the
        verdict call by call (first-draft rates 0.37-0.59 over a sequence of alike prompts, bfloat16 batch 1).
        ``row`` itself where prompts differ."""
        if not (prompts_alike(carry) and self.prompts):
            return row
        new = row.copy()
        new._first_from_prompts(self, carry)
        return new

    def seen_through(self, depth: int) -> "AcceptanceEstimate":
        """A copy that forgets what it holds on the drafts past the first ``depth``: each of them reads as the last
        one kept (``p``'s fallback), i.e. what a chain of ``depth`` drafts may hope of deeper ones it cannot observe."""
        new = self.copy()
        new.trials[depth:] = 0.0
        new.hits[depth:] = 0.0
        return new

    def finish_prompt(self, row: "AcceptanceEstimate") -> None:
        """A prompt whose estimate ``row`` started from ``for_new_prompt`` ended: its own first-draft
        evidence joins the spread ``carry_rounds`` reads."""
        if row.own[1] >= PROMPT_MIN_ROUNDS:
            self.prompts.append((float(row.own[0]), float(row.own[1])))

    def carry_rounds(self) -> float:
        """Rounds of the pair's evidence a new prompt is worth, from how the last prompts' first-draft rates
        differ: with a between-prompt variance tau^2 of the rates (their observed variance less the
        binomial variance their rounds explain), a prior of n0 = p (1 - p) / tau^2 - 1 rounds (the
        beta-binomial's). tau^2 is read one standard error high (a sample variance of k rates is known
        to ~sqrt(2 / (k - 1)) of itself): four alike prompts do not make a fifth one's rounds worthless.
        0 until ``PROMPTS_TO_CARRY`` prompts were seen."""
        if len(self.prompts) < PROMPTS_TO_CARRY:
            return 0.0
        hits, trials = np.array(self.prompts).T
        rate = hits / trials
        p = float(hits.sum() / trials.sum())
        if p * (1 - p) <= 0:
            return 0.0  # every draft accepted, or none: nothing tells the prompts apart yet
        spread = float(rate.var(ddof=1))
        tau2 = spread * (1 + math.sqrt(2 / (len(rate) - 1))) - float(np.mean(rate * (1 - rate) / (trials - 1)))
        return float(np.clip(p * (1 - p) / max(tau2, 1e-6) - 1, 0.0, 1e3))

    def _add(self, trials: np.ndarray, hits: np.ndarray, reached: int) -> None:
        """Adds rounds given as per-round trial / hit rates [R, max_depth] (oldest first) of rounds
        that made ``reached`` drafts. Positions past them age faster where prompts differ (``untried_keep``): what a deeper
        chain did on earlier prompts says little about these, and falling back to the prior (each
        position as good as the one before, the fresh ones included) is what brings deep chains back."""
        r = len(trials)
        self.unobserved = 0
        keep = np.where(np.arange(len(self.trials)) < reached, KEEP, self.untried_keep)
        w = keep[None, :] ** np.arange(r - 1, -1, -1)[:, None]
        self.trials = self.trials * keep**r + (w * trials).sum(0)
        self.hits = self.hits * keep**r + (w * hits).sum(0)

    def observe(self, accepted: Sequence[Sequence[int]] | np.ndarray, depth: int) -> None:
        """Rounds of chains of ``depth`` drafts: ``accepted[r]`` = drafts accepted by each row that ran
        round r (rows that did not run left out), or an array [rounds, rows] with -1 where a row did
        not run. One pass over all rounds (this runs inside a timed call, once per chunk and row)."""
        if depth < 1:
            return
        if isinstance(accepted, np.ndarray):
            a = accepted.astype(np.int64).reshape(len(accepted), -1)
        else:
            a = np.full((len(accepted), max((len(r) for r in accepted), default=0)), -1, np.int64)
            for r, row in enumerate(accepted):
                a[r, : len(row)] = row
        ran = a >= 0
        n = ran.sum(1)
        a, ran, n = a[n > 0], ran[n > 0, :, None], n[n > 0, None]
        if not len(n):
            return
        a = np.minimum(a, depth)[:, :, None]
        i = np.arange(len(self.trials))
        trials = ((i <= a) & (i < depth) & ran).sum(1) / n
        hits = ((i < a) & ran).sum(1) / n
        self.own += (hits[:, 0].sum(), len(n))
        self._add(trials, hits, depth)

    def observe_probe(self, chance: float, rounds: float) -> None:
        """``rounds`` rounds without drafts whose first draft would have been accepted with this mean chance."""
        n = int(round(rounds))
        if n < 1:
            return
        trials = np.zeros((n, len(self.trials)))
        trials[:, 0] = 1.0
        hits = np.zeros_like(trials)
        hits[:, 0] = chance
        self.own += (chance * rounds, rounds)
        self._add(trials, hits, 1)

    def age(self, rounds: int) -> None:
        """``rounds`` rounds passed without observing acceptance: the evidence fades toward the prior, so
        that plain decoding chosen on old evidence is tried against speculation again."""
        self.trials *= KEEP**rounds
        self.hits *= KEEP**rounds
        self.unobserved += rounds

    @property
    def p(self) -> np.ndarray:
        out, prev = np.empty(len(self.trials)), self.prior
        for i in range(len(out)):
            prev = out[i] = (self.hits[i] + PRIOR_ROUNDS * prev) / (self.trials[i] + PRIOR_ROUNDS)
        return out

    def expected_tokens(self, depth: int) -> float:
        """Tokens a round of ``depth`` drafts is expected to emit: 1 + sum over i < depth of prod(p[:i+1])."""
        return 1.0 + float(np.cumprod(self.p[:depth]).sum()) if depth > 0 else 1.0

    def accepted_moments(self, depth: int) -> tuple[float, float]:
        """Mean and variance of the drafts a round of ``depth`` drafts accepts: P(a >= k) = prod(p[:k])."""
        at_least = np.cumprod(self.p[:depth])
        mean = float(at_least.sum())
        return mean, float((at_least * (2 * np.arange(1, depth + 1) - 1)).sum()) - mean**2
