"""Approximate reuse's effect on answers: greedy agreement on the real default model.

What. The prompt cache's opt-in approximate reuse (engine/cache/reuse.py) keeps a
cached conversation's KV past a small same-length change (a clock, a date, a
session id, a request counter in the system prompt): only the changed spans,
and `recompute_after` tokens after each, are recomputed; every later token
keeps KV computed with the OLD value in view. That is not the computation
the model was trained for, so its answers may change. This measures how
much, on SmolLM2-135M-Instruct (the GGUF set-up fetched, the model mlxd
serves by default), over a fixed set of prompt pairs.

How. In-process with mlx-lm, no servers, through the engine's own pieces so
that what is measured is what the engine does: the plan is reuse.patch_plan
with ApproxPolicy(recompute_after=r); the cached entry is cut and copied as
the prompt cache does for a branch (a shallow copy, trim_prompt_cache,
kv_cache.packed); spans are recomputed with prefill.recompute; the
rest is prefilled with prefill.prefill (generate_step's chunking) and
decoded greedily with mlx-lm's generate_step (temperature 0, as the engine's
sampler makes it). Per prompt pair A (old value) / B (new value), both
rendered with the chat template (generation prompt on) and of the SAME token
length (approximate reuse needs aligned prompts; the new value is picked from
a fixed list of candidates, and candidates that change the length are
skipped and counted):

  reference  a cold prefill of B, N greedy tokens (--tokens, default 32), or
             fewer where the answer ends (EOS: where the engine stops)
  exact      A's KV cut back to the common prefix of A and B, the rest of B
             prefilled: the same computation as the reference, so it must
             agree token for token (a disagreement is numerical noise: the
             prefill is chunked differently; it is reported as it comes)
  approx rR  A's KV (prefilled cold), patch_plan(A, B, len(B) - 1,
             ApproxPolicy(recompute_after=R)), the spans recomputed, the rest
             of B after the plan's end prefilled; R in --recompute-after
             (default 0, 4, 16)
  stale      the control: A's KV for all of B but its last token, nothing
             recomputed, so the model sees the OLD value (--no-control
             leaves it out). It shows whether the prompts can tell at all:
             most questions do not depend on the value, so a model that never
             saw the change answers them the same. A quarter of the prompts
             therefore ask for the value itself ("What time is it right
             now?"), and the results have a second table for those.

Per arm and prompt: the tokens generated before the first difference from
the reference (all of them when identical; decoding stops there: after it
the two continue from different texts and agreement means nothing), whether
the whole answer agrees, the first generated token's distribution against
the reference's (top-1 agreement and KL(reference || arm)), and, because N
greedy tokens over a few dozen prompts is a small sample, the same two
teacher-forced over all the reference's steps: the reference's tokens fed
after the arm's prompt in one forward pass (against the reference fed the
same way), so every step compares the next-token distributions given the
same text. And the share of B's prompt tokens whose KV was reused (the
plan's end minus the recomputed tokens, over len(B)).

Why on float32 by default. MLX's Linux CPU wheel ships a reference BLAS:
on 2 cores this model prefills ~7 tok/s whether Q4_1 or float32. With
Debian's OpenBLAS preloaded float32 prefills ~170 tok/s and decodes ~9 tok/s
(Q4_1: ~7 and ~5 either way: its kernels do not use BLAS). So by default the Q4_1 weights are
dequantized to float32 (every weight exactly w*scale+bias, the same model,
in float32 arithmetic) and run with OpenBLAS:

  apt-get install -y libopenblas0-pthread      # once
  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
      .venv/bin/python bench/approx_reuse_quality.py            # 24 prompts, ~11 min on 2 cores
  ... bench/approx_reuse_quality.py --quick                     # 8 prompts, 16 tokens, ~2.5 min
  ... bench/approx_reuse_quality.py --weights q4_1 --prompts 6  # the Q4_1 kernels (slow on CPU)

The weights, dtype and BLAS in use are written into the results.

Results: bench/results/approx_reuse_quality/approx_reuse_quality.md and
.json (--out-dir): the summary table and every per-prompt, per-arm row.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import random
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))  # when imported by path (bench/run.py, tests)
from benchkit import (RESULTS, compare_distributions, first_difference,  # noqa: E402
                      machine_info, mean_of, open_real_model, say, write_json)

DEFAULT_RECOMPUTE_AFTER = (0, 4, 16)
WEIGHTS = ("float32", "q4_1")
CLOCK_START = dt.datetime(2026, 11, 25, 10, 42, 13)
CANDIDATES = 40  # new values tried per prompt before it is dropped
STALE = "stale"  # the control arm: A's KV kept whole, the changed spans NOT recomputed

# --- the prompt set (pure) --------------------------------------------------------------

# Every persona: an opening line, paragraphs of its own, user questions, and one
# earlier exchange for the multi-turn prompts. Paragraphs of GENERIC fill the rest.
PERSONAS: dict[str, dict[str, Any]] = {
    "coding": {
        "intro": "You are Forge, a coding agent working inside the user's repository through the tools below.",
        "paragraphs": (
            "Read a file before you edit it, and never invent its contents. When a change touches several files, "
            "list them first and say why each one must change. Keep every edit as small as the task allows and do "
            "not reformat code you did not otherwise change.",
            "The tools are read_file(path), write_file(path, text), search(pattern, path) and run(command). The "
            "run tool executes in a sandbox without network access; commands that run longer than ten minutes are "
            "stopped. Prefer search over reading whole directories.",
            "After a change, run the tests of the modules you touched, not the whole suite. If a test fails, read "
            "its output carefully before changing anything else; report a failure you cannot fix instead of hiding "
            "it, and never delete or skip a test to make the run pass.",
            "Commit messages have a short first line in the imperative mood, a blank line, and a body that says "
            "what changed and why. Do not push, rebase or force anything unless the user asks for it explicitly.",
        ),
        "questions": ("Why does the test for the cache eviction fail only on the second run?",
                      "Write a function that merges two sorted lists of integers.",
                      "What is the difference between a list and a tuple in Python?",
                      "How should I name the new module that parses the configuration file?"),
        "history": ("Can you find where the retry delay is computed?",
                    "It is computed in client/retry.py, in the function backoff(), which doubles the delay on "
                    "every attempt and caps it at thirty seconds."),
    },
    "support": {
        "intro": "You are the customer support assistant of Northwind Outdoor, an online shop for camping gear.",
        "paragraphs": (
            "Greet the customer once, then answer the question directly. Orders ship within two business days; "
            "delivery takes three to five days inside the country and up to twelve days abroad. Tracking numbers "
            "are sent by email as soon as the parcel leaves the warehouse.",
            "Customers may return unused items within thirty days for a full refund. Tents and sleeping bags that "
            "were used may be returned within fourteen days if they are clean and complete. Refunds reach the "
            "original payment method within five business days after the return arrives.",
            "Never ask for a full card number or a password. To look up an order you need the order number, which "
            "starts with NW and has eight digits, and the email address used for the purchase.",
            "If the customer is upset, acknowledge the problem in one sentence and move on to a concrete next step. "
            "Offer a call with a human agent when the problem involves a damaged item, a missing parcel after "
            "fifteen days, or a payment charged twice.",
        ),
        "questions": ("My tent arrived with a broken pole. What can I do?",
                      "How long does shipping to Canada take?",
                      "Can I return a sleeping bag I used for one night?",
                      "I was charged twice for order NW20481137, please help."),
        "history": ("Hi, where is my order?",
                    "Hello! I can check that for you. Could you tell me your order number and the email address "
                    "you used for the purchase?"),
    },
    "travel": {
        "intro": "You are Wayfarer, a travel planning assistant that helps people plan trips by train and bus.",
        "paragraphs": (
            "Plan with public transport first. Give departure and arrival times in the local time of each city, "
            "name the station, and mention when a seat reservation is required. Never promise a price: fares "
            "change, so give a typical range and say where to book.",
            "When the traveller gives a budget, keep the whole plan inside it and show the main costs in a short "
            "list: transport, accommodation, food. Suggest one cheaper alternative when the plan uses most of the "
            "budget.",
            "Ask at most one clarifying question, and only when the answer changes the plan: the travel dates, the "
            "number of travellers, or whether they can climb stairs with luggage.",
            "For trips longer than three days, propose a day-by-day outline with one main activity per day and a "
            "rest afternoon every third day. Keep transfers under four hours whenever a reasonable route exists.",
        ),
        "questions": ("Plan three days in Vienna for two people on a small budget.",
                      "What is the best way to get from Milan to Zurich by train?",
                      "Is it worth buying a rail pass for a week in Switzerland?",
                      "Suggest a weekend trip from Berlin without a car."),
        "history": ("I want to visit Lisbon in spring.",
                    "Spring is a lovely time for Lisbon. How many days do you have, and will you travel alone?"),
    },
    "data": {
        "intro": "You are Ledger, an assistant that writes SQL and explains data for the analytics team.",
        "paragraphs": (
            "The warehouse is PostgreSQL 16. The main tables are orders(id, customer_id, created_at, total_cents, "
            "status), customers(id, country, signup_at) and order_items(order_id, sku, quantity, price_cents). "
            "Money is stored in cents; always divide by 100 in results shown to people.",
            "Write queries that are easy to read: one clause per line, explicit column lists, no SELECT star in "
            "final answers, and common table expressions instead of nested subqueries when a query has more than "
            "one step.",
            "When the question is ambiguous about a time range, use the last complete calendar month and say so. "
            "Exclude orders whose status is cancelled or test unless the user asks for them.",
            "After the query, explain in two or three sentences what it returns and any assumption it makes. If "
            "the result could be misleading, for example because of a small sample, say that too.",
        ),
        "questions": ("Which countries had the highest revenue last month?",
                      "Write a query for the average order value per customer.",
                      "How many customers ordered twice within thirty days of signing up?",
                      "Explain the difference between an inner join and a left join."),
        "history": ("How many orders did we get yesterday?",
                    "SELECT count(*) FROM orders WHERE created_at::date = current_date - 1 AND status NOT IN "
                    "('cancelled', 'test'); it counts yesterday's real orders."),
    },
    "tutor": {
        "intro": "You are Euclid, a patient mathematics and physics tutor for secondary school students.",
        "paragraphs": (
            "Do not simply give the final answer to a homework problem. Ask what the student already tried, point "
            "to the next step, and let them do it. Give the full solution only after two attempts or when the "
            "student asks to check their own result.",
            "Use plain words before formulas. When you write a formula, name every symbol and its unit. Prefer "
            "small whole numbers in examples so that the arithmetic does not hide the idea.",
            "Check the student's reasoning, not only the result: a right answer reached by a wrong method deserves "
            "a gentle correction. Praise specific steps that were done well.",
            "Topics include fractions, equations, functions, geometry, probability, motion, forces, energy and "
            "simple circuits. For anything beyond that level, say so and give the idea in one or two sentences.",
        ),
        "questions": ("How do I solve 3x + 5 = 20?",
                      "Why does a heavier ball not fall faster than a lighter one?",
                      "What is the probability of rolling two sixes with two dice?",
                      "Can you explain what a function is?"),
        "history": ("I don't understand fractions.",
                    "No problem. Let's start with a pizza cut into four equal slices: if you eat one slice, what "
                    "part of the pizza did you eat?"),
    },
    "kitchen": {
        "intro": "You are Basil, a cooking assistant that helps home cooks plan meals and follow recipes.",
        "paragraphs": (
            "Give quantities in grams and millilitres, with cups in brackets when the user seems to be in the "
            "United States. Oven temperatures are in degrees Celsius with Fahrenheit in brackets.",
            "Ask about allergies and diets only once per conversation, and remember the answer. Never suggest "
            "peanuts, tree nuts or shellfish to a user who mentioned an allergy, even as an optional topping.",
            "Recipes are numbered steps of one or two sentences each. Put the total time and the active time at "
            "the top, and say which steps can be done a day ahead.",
            "When the user has leftovers, suggest two or three dishes that use them, starting with the quickest. "
            "Mention food safety briefly when cooked rice, chicken or fish has been kept for more than a day.",
        ),
        "questions": ("What can I cook with leftover rice and two eggs?",
                      "How do I make a simple tomato sauce?",
                      "Plan three vegetarian dinners for this week.",
                      "How long should I roast a chicken of 1.5 kg?"),
        "history": ("I have chickpeas, spinach and garlic.",
                    "Great start! A quick chickpea and spinach stew would take about twenty minutes. Do you also "
                    "have tomatoes or coconut milk?"),
    },
}
GENERIC = (
    "Answer in the language of the user's last message. Be concise: short paragraphs, no filler, and lists only "
    "when the content is a list. Do not repeat the question back to the user.",
    "If you are not sure about a fact, say so instead of guessing, and suggest how the user could check it. Do not "
    "make up names, numbers, links or quotations.",
    "Refuse requests that could cause harm to people, and say briefly why. For medical, legal or financial "
    "questions give general information and recommend a qualified professional for decisions.",
    "Keep track of what the user told you earlier in the conversation and do not ask for it again. If the user "
    "corrects you, accept the correction and continue from it without long apologies.",
    "Format code in fenced blocks with the language named. Use tables only for comparisons of three or more items "
    "with the same attributes. Avoid emoji unless the user uses them first.",
    "Your answers are shown in a small chat window on a phone, so prefer answers under two hundred words. Offer to "
    "go into more detail instead of writing everything at once.",
)

# The volatile values: the line each puts into the system prompt.
LINES = {"clock": "Current time is {clock}.",
         "date": "Today's date is {date}.",
         "session": "Session id: {session}",
         "counter": "This is request #{counter} of the current session."}
KINDS = ("clock", "date", "session", "counter", "clock+counter")
# Questions whose answer is the volatile value itself (every fourth prompt): the
# only prompts where a model that saw the old value would answer differently, so
# the only ones where the stale control can show that the measure can fail.
VALUE_QUESTIONS = {"clock": "What time is it right now?", "date": "What is today's date?",
                   "session": "What is my session id?", "counter": "What number is this request?"}
PLACES = ("start", "middle", "end")


@dataclass(frozen=True)
class PromptSpec:
    """One prompt pair's fixed parts: the system prompt with `{name}`
    placeholders, the conversation, the old value(s), the new candidates."""

    id: str
    persona: str
    kind: str
    place: str  # where the (first) volatile line sits in the system prompt
    system: str
    history: tuple[str, ...]  # earlier user/assistant turns, alternating
    question: str
    asks_value: bool  # the question asks for the (first) volatile value
    old: dict[str, str]
    candidates: tuple[dict[str, str], ...]

    def messages(self, values: dict[str, str]) -> list[dict[str, str]]:
        system = self.system
        for name, value in values.items():
            system = system.replace("{" + name + "}", value)
        turns = [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(self.history)]
        return [{"role": "system", "content": system}, *turns, {"role": "user", "content": self.question}]


def _values(name: str, rng: random.Random) -> tuple[str, list[str]]:
    """(old value, candidates for the new one) of one volatile field: what a
    later request of the same session would carry (pure given `rng`)."""
    if name == "clock":
        t = CLOCK_START + dt.timedelta(minutes=rng.randrange(0, 600), seconds=rng.randrange(60))
        # The next request seconds to minutes later.
        later = sorted(rng.sample(range(3, 900), CANDIDATES))
        return f"{t:%Y-%m-%d %H:%M:%S}", [f"{t + dt.timedelta(seconds=s):%Y-%m-%d %H:%M:%S}" for s in later]
    if name == "date":
        d = CLOCK_START + dt.timedelta(days=rng.randrange(0, 200))
        fmt = "%A, %B %d, %Y"
        return d.strftime(fmt), [(d + dt.timedelta(days=k)).strftime(fmt) for k in range(1, CANDIDATES + 1)]
    if name == "session":
        new = lambda: str(uuid.UUID(int=rng.getrandbits(128), version=4))  # noqa: E731
        return new(), [new() for _ in range(CANDIDATES)]
    if name == "counter":
        n = rng.randrange(10, 9000)
        return str(n), [str(n + k) for k in range(1, CANDIDATES + 1)]
    raise ValueError(f"no volatile value {name!r}")


def _system(persona: dict[str, Any], kind: str, place: str, words: int, rng: random.Random) -> str:
    """The persona's system prompt of at least `words` words, the volatile
    line(s) placed at its start, middle or end (pure given `rng`)."""
    start = rng.randrange(len(GENERIC))  # the generic rules rotated: prompts of one persona differ
    pool = list(persona["paragraphs"]) + list(GENERIC[start:] + GENERIC[:start])
    body = [persona["intro"]]
    for p in pool:
        if sum(len(b.split()) for b in body) >= words:
            break
        body.append(p)
    names = kind.split("+")
    at = {"start": 0, "middle": (len(body) + 1) // 2, "end": len(body)}[place]
    body.insert(at, LINES[names[0]])
    if len(names) > 1:  # a second value at the other end: two changed spans far apart
        body.insert(len(body) if place != "end" else 0, LINES[names[1]])
    return "\n\n".join(body)


def prompt_specs(n: int, seed: int = 0) -> list[PromptSpec]:
    """`n` fixed prompt pairs, varied (pure): personas, kinds of volatile
    value and their places cycle at different periods, the system prompt's
    length is drawn from 140-440 words (about 200-600 tokens), every third
    prompt carries one earlier exchange before the question, and every fourth
    asks for the volatile value itself."""
    names = list(PERSONAS)
    specs = []
    for i in range(n):
        rng = random.Random(f"{seed}:{i}")
        persona_name = names[i % len(names)]
        persona = PERSONAS[persona_name]
        kind = KINDS[i % len(KINDS)]
        place = PLACES[(i // len(KINDS)) % len(PLACES)]
        # i // len(names) walks each persona's questions in turn.
        question = persona["questions"][(i // len(names)) % len(persona["questions"])]
        asks_value = i % 4 == 1
        if asks_value:
            question = VALUE_QUESTIONS[kind.split("+")[0]]
        history = tuple(persona["history"]) if i % 3 == 2 else ()
        system = _system(persona, kind, place, rng.randrange(140, 440), rng)
        old: dict[str, str] = {}
        per_name: list[list[str]] = []
        for name in kind.split("+"):
            old[name], cands = _values(name, rng)
            per_name.append(cands)
        # With two values both change each time (a clock and a counter advance together).
        candidates = tuple(dict(zip(old, values)) for values in zip(*per_name))
        specs.append(PromptSpec(f"p{i:02d}-{persona_name}-{kind}@{place}", persona_name, kind, place, system,
                                history, question, asks_value, old, candidates))
    return specs


@dataclass(frozen=True)
class Pair:
    """A prompt pair whose two tokenizations have the same length."""

    spec: PromptSpec
    new: dict[str, str]
    tokens_a: list[int]
    tokens_b: list[int]
    skipped: int  # candidates tried first whose prompt had another token count


def pair_values(spec: PromptSpec, encode: Callable[[list[dict[str, str]]], list[int]]) -> tuple[Pair | None, int]:
    """The first candidate new value whose prompt, tokenized by `encode`
    (messages -> tokens), has exactly as many tokens as the old one's and
    differs from it; (None, skipped) when none does (pure). Approximate
    reuse compares prompts position by position: a value one token longer
    shifts everything after it and the plan falls back to the exact prefix,
    which is not what is measured here."""
    a = list(encode(spec.messages(spec.old)))
    skipped = 0
    for new in spec.candidates:
        b = list(encode(spec.messages(new)))
        if len(b) != len(a):
            skipped += 1
            continue
        if b != a:
            return Pair(spec, new, a, b, skipped), skipped
    return None, skipped


# --- agreement counting and the summary (pure) ---------------------------------------------

def summarize(rows: Sequence[dict[str, Any]], arms: Sequence[str]) -> list[dict[str, Any]]:
    """One line per arm (in `arms`' order; arms without rows left out) from
    the per-prompt rows (pure)."""
    out = []
    for arm in arms:
        mine = [r for r in rows if r["arm"] == arm]
        if not mine:
            continue
        out.append({
            "arm": arm,
            "prompts": len(mine),
            "tokens": mean_of(r["tokens"] for r in mine),  # the reference's answer: N tokens or fewer (EOS)
            "mean_agreeing_tokens": mean_of(r["first_difference"] for r in mine),
            "identical_share": mean_of(float(r["first_difference"] == r["tokens"]) for r in mine),
            "first_top1": mean_of(float(r["first_top1"]) for r in mine),
            "first_kl": mean_of(r["first_kl"] for r in mine),
            "forced_top1": mean_of(r["forced_top1"] for r in mine),
            "forced_kl": mean_of(r["forced_kl"] for r in mine),
            "reused_share": mean_of(r["reused_share"] for r in mine),
            "patched": sum(1 for r in mine if r.get("spans")),
        })
    return out


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.0f} %"


def _num(x: float | None, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def markdown_table(summary: Sequence[dict[str, Any]]) -> str:
    """The summary as a markdown table (pure)."""
    head = ("| arm | prompts | tokens agreeing before the first difference (mean / the reference's mean) "
            "| identical answers | first token: top-1 agreement | first token: mean KL (nats) "
            "| teacher-forced: top-1 agreement | teacher-forced: mean KL (nats) | mean share of the prompt reused |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for s in summary:
        arm = s["arm"] + (f" ({s['patched']}/{s['prompts']} patched)" if s["arm"].startswith("approx") else
                          " (control: nothing recomputed)" if s["arm"] == STALE else "")
        agreeing = f"{_num(s['mean_agreeing_tokens'], '.1f')} / {_num(s['tokens'], '.1f')}"
        lines.append(f"| {arm} | {s['prompts']} | {agreeing} "
                     f"| {_pct(s['identical_share'])} | {_pct(s['first_top1'])} | {_num(s['first_kl'], '.2g')} "
                     f"| {_pct(s['forced_top1'])} | {_num(s['forced_kl'], '.2g')} | {_pct(s['reused_share'])} |")
    return "\n".join(lines)


def arm_names(recompute_after: Sequence[int], control: bool = True) -> list[str]:
    return ["exact"] + [f"approx r{r}" for r in recompute_after] + ([STALE] if control else [])


# --- the model (MLX) -------------------------------------------------------------------------

class Runner:
    """One model's arms, each built the way the engine builds its turn."""

    def __init__(self, model: Any, tokenizer: Any, n_tokens: int, step: int) -> None:
        from mlx_lm.sample_utils import make_sampler

        self.model, self.tokenizer, self.n, self.step = model, tokenizer, n_tokens, step
        self.sampler = make_sampler(temp=0.0)  # what the engine's make_sampling makes of temperature 0: argmax

    def pace(self) -> Any:
        """Steps of `step` tokens each: the engine's chunking, without its pacing."""
        from mlxd.engine.model.prefill_pace import PrefillPace

        return PrefillPace(self.step, 1e9, first=self.step)

    def cold(self, tokens: list[int]) -> list[Any]:
        from mlx_lm.models.cache import make_prompt_cache

        from mlxd.engine.model.prefill import prefill

        kv = make_prompt_cache(self.model)
        prefill(self.model, kv, tokens, self.pace(), lambda: None)
        return kv

    def branch(self, entry: list[Any], covered: int, keep: int, prompt_len: int) -> list[Any]:
        """The prompt cache's take on an entry another conversation branched
        from (cache_fetch._take with copy): shallow copies, cut
        to `keep` tokens, packed into buffers of their own (the entry stays
        as it was for the next arm)."""
        from mlx_lm.models.cache import KVCache, trim_prompt_cache

        from mlxd.engine.cache.kv_cache import packed

        kv = [copy.copy(c) if type(c) is KVCache else copy.deepcopy(c) for c in entry]
        if covered > keep:
            trim_prompt_cache(kv, covered - keep)
        return packed(kv, prompt_len - keep, shared=True)

    def finish(self, kv: list[Any], prompt: list[int], start: int,
               reference: list[int] | None) -> tuple[list[int], Any, Any]:
        """Prefill `prompt[start:]` over `kv` and decode greedily, as the
        engine's decode does (generate_step on the rest; its prefill is
        prefill.prefill's chunking); stops after N tokens, at EOS, or at
        the first token that differs from `reference`. Then the teacher-forced pass: the cache cut
        back to the prompt, the reference's tokens (or, for the reference,
        its own) fed after the prompt's last token in one forward pass.
        (tokens, first step's logprobs, forced logprobs [reference tokens, vocab])."""
        import mlx.core as mx
        from mlx_lm.generate import generate_step
        from mlx_lm.models.cache import trim_prompt_cache

        from mlxd.engine.model.prefill import prefill

        rest = prompt[start:]
        prefill(self.model, kv, rest[:-1], self.pace(), lambda: None)  # = generate_step's own prefill of rest[:-1]
        tokens: list[int] = []
        first = None
        steps = generate_step(mx.array(rest[-1:]), self.model, prompt_cache=kv, max_tokens=self.n,
                              sampler=self.sampler, prefill_step_size=self.step)
        for token, logprobs in steps:
            if first is None:
                first = logprobs
                mx.eval(first)
            tokens.append(int(token))
            if reference is None and tokens[-1] in self.tokenizer.eos_token_ids:
                break  # the engine's answer ends here (stream_generate stops at EOS)
            if reference is not None and (len(tokens) == len(reference) or tokens[-1] != reference[len(tokens) - 1]):
                break
        steps.close()
        fed = reference if reference is not None else tokens
        mx.eval([c.state for c in kv])
        trim_prompt_cache(kv, kv[0].offset - (len(prompt) - 1))
        logits = self.model(mx.array([rest[-1:] + fed[:-1]]), cache=kv)[0].astype(mx.float32)
        forced = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        mx.eval(forced)
        return tokens, first, forced


def measure(runner: Runner, pair: Pair, recompute_after: Sequence[int],
            control: bool = True) -> list[dict[str, Any]]:
    """Every arm of one prompt pair: rows for the JSON (the reference's
    tokens and text in each)."""
    import numpy as np

    from mlxd.engine.model.prefill import recompute
    from mlxd.engine.cache.reuse import ApproxPolicy, common_prefix, patch_plan

    a, b = pair.tokens_a, pair.tokens_b
    length = len(b)
    text = lambda toks: runner.tokenizer.decode(toks)  # noqa: E731
    t0 = time.perf_counter()
    ref_tokens, ref_first, ref_forced = runner.finish(runner.cold(b[:-1]), b, len(b) - 1, None)
    t_ref = time.perf_counter() - t0
    n = len(ref_tokens)  # N, or fewer where the reference's answer ended (EOS)
    entry = runner.cold(a)  # A's turn, as the cache holds it
    a_np, b_np = np.asarray(a), np.asarray(b)
    changed = np.flatnonzero(a_np != b_np).tolist()
    base = {"prompt": pair.spec.id, "kind": pair.spec.kind, "place": pair.spec.place, "prompt_tokens": length,
            "history_turns": len(pair.spec.history), "asks_value": pair.spec.asks_value, "old": pair.spec.old,
            "new": pair.new,
            "changed_positions": changed, "skipped_candidates": pair.skipped, "tokens": n,
            "reference_text": text(ref_tokens), "reference_seconds": round(t_ref, 2)}
    rows = []
    plans: list[tuple[str, int, tuple[tuple[int, int], ...]]] = [
        ("exact", min(common_prefix(a_np, b_np), length - 1), ())]
    for r in recompute_after:
        end, spans = patch_plan(a_np, b_np, length - 1, ApproxPolicy(recompute_after=r))
        plans.append((f"approx r{r}", end, spans))
    if control:  # everything but the last token from A's KV, the old value's included
        plans.append((STALE, length - 1, ()))
    for arm, end, spans in plans:
        t = time.perf_counter()
        kv = runner.branch(entry, len(a), end, length)
        if spans:
            recompute(runner.model, kv, b, spans, end, runner.pace(), lambda: None)
        tokens, first, forced = runner.finish(kv, b, end, ref_tokens)
        recomputed = sum(e - s for s, e in spans)
        # reused_share: the KV taken from the cache and not recomputed, over B's prompt
        rows.append({**base, "arm": arm, "plan_end": end, "spans": [list(s) for s in spans],
                     "recomputed": recomputed, "computed_tokens": recomputed + length - end,
                     "reused_share": (end - recomputed) / length,
                     "first_difference": first_difference(ref_tokens, tokens, n), "generated_text": text(tokens),
                     **compare_distributions(ref_first, ref_forced, first, forced), "seconds": round(time.perf_counter() - t, 2)})
    return rows


# --- the run -----------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from mlxd import default_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=24, help="prompt pairs (default 24; --quick 8)")
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per arm (default 32; --quick 16)")
    ap.add_argument("--recompute-after", default=",".join(map(str, DEFAULT_RECOMPUTE_AFTER)),
                    help="the approximate arms' ApproxPolicy.recompute_after values (default 0,4,16)")
    ap.add_argument("--weights", choices=WEIGHTS, default="float32",
                    help="float32: the Q4_1 weights dequantized (fast with OpenBLAS); q4_1: as they are")
    ap.add_argument("--gguf", type=Path, default=default_model.gguf_path(), help="the model's GGUF")
    ap.add_argument("--prefill-step", type=int, default=512, help="the engine's prefill_step_size (default 512)")
    ap.add_argument("--seed", type=int, default=0, help="the prompt set's seed (default 0: the fixed set)")
    ap.add_argument("--no-control", dest="control", action="store_false",
                    help="leave out the stale control arm (nothing recomputed)")
    ap.add_argument("--quick", action="store_true", help="8 prompts, 16 tokens: about 3 min on 2 cores")
    ap.add_argument("--out-dir", type=Path, default=RESULTS / "approx_reuse_quality")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.tokens = min(args.prompts, 8), min(args.tokens, 16)
    args.recompute_after = [int(x) for x in args.recompute_after.split(",") if x.strip()]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    opened = open_real_model(args.gguf, args.weights)
    if opened is None:
        return 1
    model, tokenizer, model_info = opened

    from mlxd.engine.model.prompt_tokens import template_tokens

    encode = lambda messages: template_tokens(tokenizer, messages)  # noqa: E731 - the engine's own tokenization
    pairs: list[Pair] = []
    skipped_total, dropped = 0, []
    for spec in prompt_specs(args.prompts, args.seed):
        pair, skipped = pair_values(spec, encode)
        skipped_total += skipped
        if pair is None:
            dropped.append(spec.id)
        else:
            pairs.append(pair)
    say(f"{len(pairs)} prompt pairs, {min(len(p.tokens_b) for p in pairs)}-{max(len(p.tokens_b) for p in pairs)} "
        f"tokens; {skipped_total} candidate new values skipped for a token-count mismatch"
        + (f"; dropped (no same-length value): {', '.join(dropped)}" if dropped else ""))

    runner = Runner(model, tokenizer, args.tokens, args.prefill_step)
    arms = arm_names(args.recompute_after, args.control)
    rows: list[dict[str, Any]] = []
    for i, pair in enumerate(pairs, 1):
        t = time.monotonic()
        mine = measure(runner, pair, args.recompute_after, args.control)
        rows += mine
        say(f"[{i}/{len(pairs)}] {pair.spec.id}: {len(pair.tokens_b)} tokens, first change at "
            f"{mine[0]['changed_positions'][0]}; agreeing tokens "
            + ", ".join(f"{r['arm']} {r['first_difference']}" for r in mine)
            + f" /{mine[0]['tokens']} ({time.monotonic() - t:.0f} s, {time.monotonic() - started:.0f} s so far)")

    summary = summarize(rows, arms)
    asking = [r for r in rows if r["asks_value"]]
    summary_asking = summarize(asking, arms)
    seconds = round(time.monotonic() - started, 1)
    notes = [f"model: SmolLM2-135M-Instruct, {model_info['description']}; BLAS: {model_info['blas']}",
             f"{len(pairs)} prompt pairs ({', '.join(KINDS)}; at the system prompt's start, middle, end), "
             f"{min(len(p.tokens_b) for p in pairs)}-{max(len(p.tokens_b) for p in pairs)} prompt tokens; "
             f"{skipped_total} candidate values skipped for a token-count mismatch, {len(dropped)} prompts dropped",
             f"N = {args.tokens} greedy tokens at most: the reference (a cold prefill of B) stops at EOS, as the "
             f"engine's answer does, and an arm at its first difference from the reference; 'patched': prompts "
             f"whose plan recomputed spans (otherwise the arm is the exact one); KL is KL(reference || arm)",
             f"{len({r['prompt'] for r in asking})} of the prompts ask for the changed value itself (second table): "
             f"there an answer from the old value's KV differs, which the stale control shows",
             f"{seconds:.0f} s in all"]
    md = "\n".join(["# Approximate reuse: agreement with a cold prefill", "", "All prompts:", "",
                    markdown_table(summary), "", "The prompts whose question asks for the changed value:", "",
                    markdown_table(summary_asking) if asking else "(none in this run)", "",
                    *[f"- {n}" for n in notes], ""])
    print(md)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "approx_reuse_quality.md").write_text(md)
    write_json(args.out_dir / "approx_reuse_quality.json", {
        "benchmark": "approx_reuse_quality", "machine": machine_info(), "model": model_info,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "prompt_set": {"pairs": len(pairs), "skipped_candidates": skipped_total, "dropped": dropped,
                       "prompts": [{"id": p.spec.id, "messages_a": p.spec.messages(p.spec.old), "old": p.spec.old,
                                    "new": p.new, "tokens": len(p.tokens_b)} for p in pairs]},
        "summary": summary, "summary_asking_value": summary_asking, "rows": rows, "seconds": seconds})
    say(f"wrote {args.out_dir / 'approx_reuse_quality.md'} and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
