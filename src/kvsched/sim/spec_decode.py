"""Speculative decoding on a replica (docs/speculative-decoding.md): what a decode step of a
request with draft tokens schedules, allocates, emits and costs, as vLLM 0.32's v1 scheduler
does it (vllm/v1/core/sched/scheduler.py):

- a decoding request with s draft tokens is scheduled for 1 + s tokens
  (`num_tokens_with_spec - num_computed_tokens`), and they count in the token budget;
- `allocate_slots(request, 1 + s, num_lookahead_tokens=L)` gives it blocks for
  num_computed + 1 + s + L slots; L is vLLM's `num_lookahead_tokens` (vllm/config/vllm.py):
  k for EAGLE, MTP and draft models (the drafter writes KV past the verified tokens), 0 for
  n-gram. A running request's blocks only grow (`KVCacheManager.allocate_slots` allocates the
  blocks past the ones it holds), so the slots of rejected tokens stay its own and the next
  step writes over them; they are freed with the request (finished, preempted, swapped);
- `update_from_output`: of s drafts a are accepted, a + 1 tokens come out (the output length
  cuts them, as `check_stop` does), and `num_computed_tokens -= s - a`;
- the drafts of the next step come after each step (`update_draft_token_ids`); a request in
  its prefill has none. n-gram finds none for some requests (`--spec-proposal-rate`); those
  decode one token, as without speculation.
- dynamic speculative decoding (`num_speculative_tokens_per_batch_size`,
  vllm/v1/spec_decode/dynamic/utils.py): the drafts proposed after a step of b scheduled
  requests have the schedule's k for b (`--spec-adaptive`).

The draws are keyed, not streamed: the uniforms of request i's n-th decode step are a hash of
(seed, i, n) (splitmix64), so whether a request has drafts and how many are accepted does not
depend on what else ran in its batch, on the policy, or on the engine: `kvsched replay` feeds
vLLM's scheduler the same drafts and acceptances (engines/vllm_replay.py).

Also as vLLM: a running request's tokens are capped at max_model_len - num_computed - 1
(`proposal`), and a one-token admission is padded to 1 + k rows of placeholder drafts, all
rejected (`pad`, vLLM's `pad_spec_decode`).

Not modelled (docs/speculative-decoding.md): the lookahead slots of prefill chunks, padded ones
included (vLLM passes `num_lookahead_tokens` to every allocation; here only decode steps reserve
them), and the drafter's prefill lookahead of multi-module MTP.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvsched.errors import KvschedError, PlanError
from kvsched.sim.spec_acceptance import MAX_K, Acceptance, parse_acceptance

if TYPE_CHECKING:
    from kvsched.sim.replica import Replica

METHODS = ("draft", "eagle", "mtp", "ngram")


@dataclass(frozen=True)
class SpecConfig:
    """`--spec METHOD:k` and its options, checked (`spec_config`)."""
    method: str
    k: int
    acceptance: Acceptance                          # requests of no named tier
    by_tier: tuple[Acceptance | None, ...] = ()     # the workload's tiers, in order (None: the default)
    proposal_rate: float = 1.0                      # share of steps with drafts (n-gram hits)
    schedule: tuple[tuple[int, int, int], ...] | str = ()   # --spec-adaptive: (first, last batch size, k); "auto"
    seed: int = 0
    draft_model: str | None = None                  # --spec-draft-model (method draft)

    @property
    def lookahead(self) -> int:
        """vLLM's `num_lookahead_tokens` (vllm/config/vllm.py): k for EAGLE, MTP and draft
        models, 0 for n-gram."""
        return 0 if self.method == "ngram" else self.k

    @property
    def draft_slots(self) -> int:
        """vLLM's `max_num_new_slots_for_drafting` (vllm/config/speculative.py): the input slots a
        scheduled request also takes from the batch (1 for a sequential draft model, else 0)."""
        return 1 if self.method == "draft" else 0

    def k_for(self, batch: int) -> int:
        """The k of drafts proposed after a step of `batch` scheduled requests: that of the last
        range starting at or below it (a gap or the tail carries the previous range's k, as
        vLLM's `build_dynamic_sd_schedule_lookup` fills them), capped at k; k without a schedule."""
        k = self.k
        for first, _, kk in self.schedule:
            if first > batch:
                break
            k = min(kk, self.k)
        return k


def parse_spec(text: str) -> tuple[str, int]:
    """`--spec METHOD:k`: METHOD one of METHODS, k speculative tokens (1..MAX_K)."""
    if not isinstance(text, str) or text.count(":") != 1:
        raise KvschedError(f"--spec must be METHOD:k with METHOD one of {', '.join(METHODS)}, got {text!r}")
    method, k = (p.strip() for p in text.split(":"))
    if method not in METHODS:
        raise KvschedError(f"--spec {text!r}: unknown method {method!r} (one of {', '.join(METHODS)})")
    if not (k.isascii() and k.isdigit()) or not 1 <= int(k) <= MAX_K:
        raise KvschedError(f"--spec {text!r}: k must be a whole number from 1 to {MAX_K}, got {k!r}")
    return method, int(k)


def parse_schedule(text: str) -> tuple[tuple[int, int, int], ...] | str:
    """`--spec-adaptive FIRST-LAST:K,...`, or `auto` (the cost model's best k per batch size,
    cost/spec_cost.py `best_k_schedule`, made when the replicas are built): vLLM's
    `num_speculative_tokens_per_batch_size`, checked
    as vLLM's `validate_and_normalize_dynamic_sd_schedule` checks it (inclusive batch-size ranges,
    positive, sorted without overlap, the first starting at 1; K >= 0)."""
    if text.strip() == "auto":
        return "auto"
    out = []
    for part in text.split(","):
        try:
            sizes, k = part.split(":")
            first, last = sizes.split("-") if "-" in sizes else (sizes, sizes)
            entry = (int(first), int(last), int(k))
        except ValueError:
            raise KvschedError(f"--spec-adaptive {text!r}: each entry is FIRST-LAST:K (batch sizes, "
                               f"speculative tokens), got {part.strip()!r}") from None
        if entry[0] < 1 or entry[0] > entry[1] or entry[2] < 0:
            raise KvschedError(f"--spec-adaptive {text!r}: {part.strip()!r} needs 1 <= FIRST <= LAST and K >= 0")
        out.append(entry)
    out.sort()
    if out[0][0] != 1:
        raise KvschedError(f"--spec-adaptive {text!r}: the first batch-size range must start at 1")
    for a, b in zip(out, out[1:]):
        if b[0] <= a[1]:
            raise KvschedError(f"--spec-adaptive {text!r}: batch-size ranges overlap")
    return tuple(out)


def spec_config(spec: str, acceptance: str, tiers=(), proposal_rate: float = 1.0, adaptive: str = "",
                seed: int = 0, draft_model: str | None = None, untiered: bool = True) -> SpecConfig:
    """The checked configuration. `acceptance`: RATES for every request, or entries
    `RATES;TIER=RATES;...` (RATES: ALPHA or a_1,..,a_k) naming the workload's tiers; requests of
    a tier not named, and requests of no tier (`untiered`: the workload has some), take the
    unnamed entry, which is then required."""
    method, k = parse_spec(spec)
    if not isinstance(acceptance, str) or not acceptance.strip():
        raise KvschedError("--spec needs --spec-acceptance: a constant alpha, one rate per position "
                           "(a_1,..,a_k), or per tier (RATES;TIER=RATES)")
    names = [t.name for t in tiers]
    default, named = None, {}
    for part in acceptance.split(";"):
        name, _, rates = part.rpartition("=")
        name = name.strip()
        if name and name not in names:
            raise KvschedError(f"--spec-acceptance {acceptance!r}: no tier {name!r} in the workload "
                               f"({', '.join(names) or 'it has none'})")
        if (name in named) if name else default is not None:
            raise KvschedError(f"--spec-acceptance {acceptance!r}: {name or 'the default'} given twice")
        parsed = parse_acceptance(rates, k)
        if name:
            named[name] = parsed
        else:
            default = parsed
    by_tier = tuple(named.get(n) for n in names)
    if default is None:
        if None in by_tier or not names or untiered:
            missing = names[by_tier.index(None)] if names and None in by_tier else "requests of no tier"
            raise KvschedError(f"--spec-acceptance {acceptance!r}: no rate for {missing} (give an unnamed entry)")
        default = by_tier[0]                # used by no request: every one has a named tier
    if isinstance(proposal_rate, bool) or not isinstance(proposal_rate, (int, float)) \
            or not 0.0 <= proposal_rate <= 1.0:
        raise KvschedError(f"--spec-proposal-rate must be in [0, 1], got {proposal_rate!r}")
    if proposal_rate != 1.0 and method != "ngram":
        raise KvschedError(f"--spec-proposal-rate is the share of n-gram lookups that find drafts: it needs "
                           f"--spec ngram:k (a {method} drafter proposes every step)")
    if (draft_model is not None) != (method == "draft"):
        raise KvschedError("--spec draft:k needs --spec-draft-model NAME (a catalogue model), and only it takes one")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 63:
        raise KvschedError(f"--spec-seed must be a whole number in [0, 2**63), got {seed!r}")
    return SpecConfig(method, k, default, by_tier, float(proposal_rate),
                      parse_schedule(adaptive) if adaptive else (), seed, draft_model)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (Steele, Lea and Flood, "Fast splittable pseudorandom number
    generators", OOPSLA 2014), on uint64 arrays (wrapping)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


_M = (1 << 64) - 1
_GOLDEN, _STEP = 0x9E3779B97F4A7C15, 0xD1B54A32D192ED03


def _mix_int(z: int) -> int:
    """`_mix` on one Python int (mod 2**64), bit for bit."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M
    return z ^ (z >> 31)


def keyed_uniform(seed: int, i: int, step: int, col: int) -> float:
    """One entry of `keyed_uniforms` (the same float), without numpy's per-call cost."""
    key = _mix_int(_mix_int((seed + _GOLDEN) & _M) ^ i)
    key = _mix_int((key + step * _STEP) & _M)
    return (_mix_int((key + col * _GOLDEN + 1) & _M) >> 11) * (1.0 / (1 << 53))


def keyed_uniforms(seed: int, ids, steps, width: int) -> np.ndarray:
    """Uniforms in [0, 1), shape (len(ids), width): row r is request ids[r]'s steps[r]-th decode
    step, column 0 its draft lookup, column j its j-th draft token's acceptance. A pure function
    of (seed, id, step, column)."""
    ids = np.asarray(ids, dtype=np.uint64)
    steps = np.asarray(steps, dtype=np.uint64)
    with np.errstate(over="ignore"):
        key = _mix(_mix(np.uint64(seed) + np.uint64(0x9E3779B97F4A7C15))[()] ^ ids)
        key = _mix(key + steps * np.uint64(0xD1B54A32D192ED03))
        cols = np.arange(width, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        bits = _mix(key[:, None] + cols[None, :] + np.uint64(1))
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


class Speculation:
    """One replica's speculative decoding: per decoder its decode steps so far (the draws' key),
    the blocks it holds ahead of its KV, its last acceptance; the step being run; totals."""

    def __init__(self, cfg: SpecConfig, block_size: int, tier: list[int], cached: bool = False,
                 max_len: int | None = None) -> None:
        self.cfg, self.block_size, self._tier, self._cached, self.max_len = cfg, block_size, tier, cached, max_len
        self.steps: dict[int, int] = {}         # decode steps so far (kept across preemptions)
        self.held: dict[int, int] = {}          # blocks held while decoding, where more than its KV fills
        self.recent: dict[int, float] = {}      # accepted / drafted at its last verify step
        self.unhashed: dict[int, int] = {}      # drafts its last step accepted: vLLM hashes their blocks
                                                # at its next schedule, which a preemption or finish precedes
        self.k_now = cfg.k                      # the k of the drafts proposed for the next step
        self._step: dict[int, tuple[int, int]] = {}     # the running step: i -> (drafts, accepted)
        self.needs: dict[int, int] = {}         # the running step: i -> the new blocks it allocates
        rates = [cfg.acceptance] + [a or cfg.acceptance for a in cfg.by_tier]
        self._rates = np.array([list(a.rates) for a in rates])      # row 0: no tier; row t + 1: tier t
        self.drafted = self.accepted = self.verifies = 0
        self.padded = 0                         # placeholder rows of this batch's padded admissions

    # what a policy sees (sim/view.py)
    def proposal(self, i: int, kv: int) -> int:
        """Draft tokens request i (decoding, `kv` KV tokens) has for its next step: k_now if its
        lookup finds drafts, at most max_model_len - kv - 2 (vLLM caps a running request's
        tokens at max_model_len - num_computed - 1, "necessary when using spec decoding")."""
        k = self.k_now
        if self.max_len is not None and k > self.max_len - kv - 2:
            k = max(0, self.max_len - kv - 2)
        if not k:
            return 0
        rate = self.cfg.proposal_rate
        if rate >= 1.0:
            return k
        return k if keyed_uniform(self.cfg.seed, i, self.steps.get(i, 0), 0) < rate else 0

    def blocks_held(self, i: int, kv: int) -> int:
        return max(self.held.get(i, 0), -(-kv // self.block_size))

    def slots(self, tokens: int) -> int:
        """KV slots vLLM's allocate_slots gives `tokens` (computed, new and lookahead): at most
        max_model_len (kv_cache_manager.py, `num_tokens_need_slot`)."""
        return tokens if self.max_len is None or tokens <= self.max_len else self.max_len

    def step_blocks(self, i: int, kv: int, drafts: int) -> int:
        """New blocks decoder i's step with `drafts` draft tokens allocates (vLLM's
        allocate_slots: slots for kv + 1 + drafts + lookahead, past the blocks it holds)."""
        need = -(-self.slots(kv + 1 + drafts + self.cfg.lookahead) // self.block_size)
        return max(0, need - self.blocks_held(i, kv))

    def next_blocks(self, i: int, kv: int) -> int:
        """New blocks decoder i (`kv` KV tokens) allocates at its next step, with its drafts."""
        return self.step_blocks(i, kv, self.proposal(i, kv))

    def new_blocks(self, rep: Replica) -> int:
        """Blocks one decode step of every decoder needs, each with its drafts."""
        total = 0
        for c in rep._decoders.cohorts:
            for i in c.members:
                total += self.next_blocks(i, c.kv_tokens(i))
        return total

    def decode_tokens(self, rep: Replica) -> int:
        """Tokens one decode step of every decoder schedules: 1 + its drafts each."""
        total = rep._decoders.n
        for c in rep._decoders.cohorts:
            for i in c.members:
                total += self.proposal(i, c.kv_tokens(i))
        return total

    # the step (sim/batch.py)
    def plan(self, cohorts, cap) -> tuple[int, list[tuple[int, int]]]:
        """The decode step of `cohorts` (the selected decoders), with `cap` (Plan.spec: None, a
        limit for all, or a mapping request -> limit): (new blocks, verify chunks as (KV tokens
        before, 1 + drafts)). Draws the step's acceptances, takes the blocks' room as held (the
        batch then runs or the run fails) and keys the next draws."""
        ids, kvs = [], []
        for c in cohorts:
            for i in c.members:
                ids.append(i)
                kvs.append(c.kv_tokens(i))
        cfg, steps = self.cfg, self.steps
        n = [steps.get(i, 0) for i in ids]
        u = keyed_uniforms(cfg.seed, ids, n, cfg.k + 1)
        drafts = np.where(u[:, 0] < cfg.proposal_rate, self.k_now, 0)
        if self.max_len is not None:        # `proposal`: vLLM's max_model_len cap
            drafts = np.minimum(drafts, np.maximum(0, self.max_len - np.array(kvs, dtype=np.int64) - 2))
        if cap is not None:
            drafts = np.minimum(drafts, cap if type(cap) is int else [cap.get(i, cfg.k) for i in ids])
        tiers = np.array([self._tier[i] + 1 for i in ids], dtype=np.int64)
        ok = np.cumprod(u[:, 1:] < self._rates[tiers], axis=1)
        accepted = (ok * (np.arange(cfg.k)[None, :] < drafts[:, None])).sum(axis=1)
        bs, look, held = self.block_size, cfg.lookahead, self.held
        new_blocks = 0
        chunks = []
        step, needs = self._step, self.needs
        step.clear()
        needs.clear()
        for i, kv, s, a, k in zip(ids, kvs, drafts.tolist(), accepted.tolist(), n):
            have = self.blocks_held(i, kv)
            need = -(-self.slots(kv + 1 + s + look) // bs)
            if need > have:
                new_blocks += need - have
                needs[i] = need - have
                have = need
            if have * bs > kv + 1:          # its blocks reach past the step's verified tokens
                held[i] = have
            steps[i] = k + 1
            if s:
                chunks.append((kv, 1 + s))
                step[i] = (s, a)
        return new_blocks, chunks

    def verified(self, rep: Replica, ch) -> None:
        """After cohort `ch` stepped (one token each): each verifying member emits its accepted
        drafts too, cut at its output length (vLLM's check_stop)."""
        step, output, unhashed = self._step, rep.reqs.output, self.unhashed
        for i in ch.members:
            sa = step.get(i)
            if sa is None:
                if unhashed:
                    unhashed.pop(i, None)
                continue
            s, a = sa
            self.drafted += s
            self.accepted += a
            self.verifies += 1
            self.recent[i] = a / s
            e = min(a, output[i] - ch.progress(i)[1])
            if e > 0:
                ch.advance(i, e)
                if self._cached:            # freed by kv_blocks.free (prefix caching)
                    unhashed[i] = e
            elif unhashed:
                unhashed.pop(i, None)

    def pad_limit(self, computed: int | None = None) -> int:
        """Placeholder drafts an admission may be padded with: k, as vLLM pads without dynamic k
        and when `computed` + 1 + k + 1 tokens stay within max_model_len (scheduler.py); else 0."""
        k = 0 if self.cfg.schedule else self.cfg.k
        if k and computed is not None and self.max_len is not None and computed + k + 2 > self.max_len:
            return 0
        return k

    def pad(self, rep: Replica, i: int, p: int, c: int, n: int) -> int:
        """Admission i's one-token last chunk (after `p` tokens) padded with n placeholder drafts, all
        rejected (vLLM's `pad_spec_decode`, scheduler.py: 1 + k rows keep the step's CUDA graph
        uniform): its rows and its slots, held while it decodes (a speculating decoder's)."""
        if c != 1 or p + c != rep._target[i]:
            raise PlanError(f"policy {rep.name} padded request {i}'s chunk of {c} tokens after {p}; only the "
                            f"last token of a prefill ({rep._target[i]} tokens) is padded")
        have = -(-self.slots(p + c + n) // self.block_size)
        if have > -(-(p + c) // self.block_size):
            self.held[i] = have
        self.padded += n
        return c + n

    def batch_done(self, scheduled: int) -> None:
        """The drafts proposed after a step of `scheduled` requests (dynamic k: vLLM's
        `num_spec_tokens_to_schedule`, looked up from the step's own size), set before the step
        is timed: its drafter passes are these (cost/spec_cost.py)."""
        if self.cfg.schedule:
            self.k_now = self.cfg.k_for(scheduled)

    def forget(self, i: int) -> None:
        """Request i finished: its draws' key and last acceptance go."""
        self.steps.pop(i, None)
        self.recent.pop(i, None)

    def leave(self, i: int, kv: int) -> int:
        """Decoder i leaves the decode phase with `kv` KV tokens: the blocks it held past them."""
        have = self.held.pop(i, 0)
        return max(0, have - -(-kv // self.block_size))

def spec_summary(specs: list[Speculation]) -> dict:
    """The run's speculation figures (vLLM's spec-decode metrics, vllm/v1/spec_decode/metrics.py):
    acceptance rate = accepted / drafted tokens; tokens per verify step = 1 + accepted / drafts
    (its "mean acceptance length", over the steps that verified drafts)."""
    cfg = specs[0].cfg
    drafted = sum(s.drafted for s in specs)
    accepted = sum(s.accepted for s in specs)
    verifies = sum(s.verifies for s in specs)
    out = {"spec_method": cfg.method, "spec_k": cfg.k, "spec_lookahead_slots": cfg.lookahead,
           "spec_draft_tokens": drafted, "spec_accepted_tokens": accepted, "spec_verify_steps": verifies,
           "spec_acceptance_rate": accepted / drafted if drafted else None,
           "spec_tokens_per_step": 1 + accepted / verifies if verifies else None}
    if cfg.schedule:
        out["spec_adaptive"] = [list(e) for e in cfg.schedule]
    return out

