"""Quantised KV cache's effect on answers and perplexity, on the real default model.

What. mlx-lm can keep the KV cache quantised (mlx_lm.models.cache.
QuantizedKVCache: keys and values stored as affine 8- or 4-bit integers in
groups along the head dimension, with a scale and a bias per group, and
attention computed over them with MLX's quantised kernels). That cuts the
cache's memory 3-6x, but every token then attends to rounded keys and values,
so answers may change. This measures how much on SmolLM2-135M-Instruct (the
GGUF set-up fetched, the model mlxd serves by default), at KV bits 16 (the
model's own dtype: nothing quantised; float32 on the fast CPU path, see
below), 8 and 4 (--bits), group size 64 (--group-size; SmolLM2's head_dim is
64), quantised from the first token: every layer's cache is a
QuantizedKVCache(group_size, bits) before the prompt goes in.

How. In-process with mlx-lm, no servers. Three measures, each of a quantised
setting against the unquantised reference:

  greedy     a fixed set of 28 chat prompts (rendered with the chat template,
             generation prompt on): 16 one-line questions, 5 of medium length
             (code, a review, JSON, a multi-turn chat; 55-210 tokens), 3
             long system prompts (310-450 tokens) and 4 questions about the
             passage below (380 to 2,300 tokens), so that the quantisation
             error has long contexts to act on. Each prompt is prefilled in fixed steps
             (--prefill-step, the engine's 512) and decoded greedily with
             mlx-lm's generate_step (temperature 0: what the engine's sampler
             makes of it). The reference decodes N tokens (--tokens, default
             64) or to EOS; a quantised arm stops at its first token that
             differs (after it the two continue from different texts and
             agreement means nothing). Per prompt: the tokens generated
             before the first difference (all of them when identical) and
             whether the whole answer agrees; summed up as mean / median and
             "answers identical x/N", over all prompts and by prompt length.
  forced     over the same answers, teacher-forced: the reference's tokens
             fed after the prompt in one forward pass through the arm's cache
             (the cache cut back to the prompt), so every step compares the
             next-token distributions given the same text: top-1 agreement
             and KL(16 || b) per step, over all the answers' steps (and the
             first generated token's, from the decode itself).
  perplexity teacher-forced on a fixed English passage (the first two
             chapters of Jane Austen's Pride and Prejudice, 1813, public
             domain, embedded below: 2,243 tokens), fed in chunks of
             --chunk tokens (256) through each setting's cache, so later
             chunks attend to cached (quantised) keys and values: perplexity,
             its change against 16 in %, and per position top-1 agreement and
             KL(16 || b), plus the cache's bytes per token and the chunks'
             speed through it.

Why on float32 by default. MLX's Linux CPU wheel brings a reference BLAS;
the engine puts OpenBLAS under MLX (engine/cpu/fast_blas.py: the system's
libopenblas or set-up's shim to the scipy-openblas32 wheel) and runs small
models as float32 there, ~15x faster than the Q4_1 kernels. This does the
same: fast_blas.activate() before MLX is imported, the Q4_1 weights
dequantized to float32 (every weight exactly w*scale+bias, the same model).
So "16" is the model's own dtype, unquantised: float32 KV on this path,
float16 with --weights q4_1.

  .venv/bin/python bench/kv_quality.py                   # 28 prompts, 64 tokens: 23 CPU-minutes (2 cores)
  .venv/bin/python bench/kv_quality.py --quick           # 4 prompts, 16 tokens, 512 tokens of text: ~1.5 min
  .venv/bin/python bench/kv_quality.py --bits 16,8,4     # 16 as an arm too: the control (must agree exactly)

(The full run took 42 min on 2 cores that other programs kept busy, at a
load of 4-6.) The weights, dtype and BLAS in use are written into the results.

Results: bench/results/kv_quality/kv_quality.md and .json (--out-dir): the
tables, the perplexity per chunk, and every per-prompt, per-setting row (the
answers' texts included).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))  # when imported by path (bench/run.py, tests)
from benchkit import (RESULTS, compare_distributions, first_difference,  # noqa: E402
                      log_kl, machine_info, mean_of, open_real_model, say, write_json)

REFERENCE = 16  # the model's own dtype: nothing quantised
SUPPORTED_BITS = (16, 8, 6, 5, 4, 3, 2)  # 16, or what mx.quantize takes
DEFAULT_BITS = (8, 4)
WEIGHTS = ("float32", "q4_1")
LENGTH_CLASSES = ((0, "< 128 tokens"), (128, "128-511 tokens"), (512, ">= 512 tokens"))

# --- the fixed text (pure) -------------------------------------------------------------------

# Jane Austen, Pride and Prejudice (1813), chapters 1 and 2 (public domain;
# the Project Gutenberg text with straight quotes and the italics' underscores dropped).
_WRAPPED = """\
It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of
a wife.

However little known the feelings or views of such a man may be on his first entering a neighbourhood, this
truth is so well fixed in the minds of the surrounding families, that he is considered the rightful property
of some one or other of their daughters.

"My dear Mr. Bennet," said his lady to him one day, "have you heard that Netherfield Park is let at last?"

Mr. Bennet replied that he had not.

"But it is," returned she; "for Mrs. Long has just been here, and she told me all about it."

Mr. Bennet made no answer.

"Do you not want to know who has taken it?" cried his wife impatiently.

"You want to tell me, and I have no objection to hearing it."

This was invitation enough.

"Why, my dear, you must know, Mrs. Long says that Netherfield is taken by a young man of large fortune from
the north of England; that he came down on Monday in a chaise and four to see the place, and was so much
delighted with it, that he agreed with Mr. Morris immediately; that he is to take possession before
Michaelmas, and some of his servants are to be in the house by the end of next week."

"What is his name?"

"Bingley."

"Is he married or single?"

"Oh! Single, my dear, to be sure! A single man of large fortune; four or five thousand a year. What a fine
thing for our girls!"

"How so? How can it affect them?"

"My dear Mr. Bennet," replied his wife, "how can you be so tiresome! You must know that I am thinking of his
marrying one of them."

"Is that his design in settling here?"

"Design! Nonsense, how can you talk so! But it is very likely that he may fall in love with one of them, and
therefore you must visit him as soon as he comes."

"I see no occasion for that. You and the girls may go, or you may send them by themselves, which perhaps will
be still better, for as you are as handsome as any of them, Mr. Bingley may like you the best of the party."

"My dear, you flatter me. I certainly have had my share of beauty, but I do not pretend to be anything
extraordinary now. When a woman has five grown-up daughters, she ought to give over thinking of her own
beauty."

"In such cases, a woman has not often much beauty to think of."

"But, my dear, you must indeed go and see Mr. Bingley when he comes into the neighbourhood."

"It is more than I engage for, I assure you."

"But consider your daughters. Only think what an establishment it would be for one of them. Sir William and
Lady Lucas are determined to go, merely on that account, for in general, you know, they visit no newcomers.
Indeed you must go, for it will be impossible for us to visit him if you do not."

"You are over-scrupulous, surely. I dare say Mr. Bingley will be very glad to see you; and I will send a few
lines by you to assure him of my hearty consent to his marrying whichever he chooses of the girls; though I
must throw in a good word for my little Lizzy."

"I desire you will do no such thing. Lizzy is not a bit better than the others; and I am sure she is not half
so handsome as Jane, nor half so good-humoured as Lydia. But you are always giving her the preference."

"They have none of them much to recommend them," replied he; "they are all silly and ignorant like other
girls; but Lizzy has something more of quickness than her sisters."

"Mr. Bennet, how can you abuse your own children in such a way? You take delight in vexing me. You have no
compassion for my poor nerves."

"You mistake me, my dear. I have a high respect for your nerves. They are my old friends. I have heard you
mention them with consideration these last twenty years at least."

"Ah, you do not know what I suffer."

"But I hope you will get over it, and live to see many young men of four thousand a year come into the
neighbourhood."

"It will be no use to us, if twenty such should come, since you will not visit them."

"Depend upon it, my dear, that when there are twenty, I will visit them all."

Mr. Bennet was so odd a mixture of quick parts, sarcastic humour, reserve, and caprice, that the experience of
three-and-twenty years had been insufficient to make his wife understand his character. Her mind was less
difficult to develop. She was a woman of mean understanding, little information, and uncertain temper. When
she was discontented, she fancied herself nervous. The business of her life was to get her daughters married;
its solace was visiting and news.

Chapter 2

Mr. Bennet was among the earliest of those who waited on Mr. Bingley. He had always intended to visit him,
though to the last always assuring his wife that he should not go; and till the evening after the visit was
paid she had no knowledge of it. It was then disclosed in the following manner. Observing his second daughter
employed in trimming a hat, he suddenly addressed her with:

"I hope Mr. Bingley will like it, Lizzy."

"We are not in a way to know what Mr. Bingley likes," said her mother resentfully, "since we are not to
visit."

"But you forget, mamma," said Elizabeth, "that we shall meet him at the assemblies, and that Mrs. Long
promised to introduce him."

"I do not believe Mrs. Long will do any such thing. She has two nieces of her own. She is a selfish,
hypocritical woman, and I have no opinion of her."

"No more have I," said Mr. Bennet; "and I am glad to find that you do not depend on her serving you."

Mrs. Bennet deigned not to make any reply, but, unable to contain herself, began scolding one of her
daughters.

"Don't keep coughing so, Kitty, for Heaven's sake! Have a little compassion on my nerves. You tear them to
pieces."

"Kitty has no discretion in her coughs," said her father; "she times them ill."

"I do not cough for my own amusement," replied Kitty fretfully. "When is your next ball to be, Lizzy?"

"To-morrow fortnight."

"Aye, so it is," cried her mother, "and Mrs. Long does not come back till the day before; so it will be
impossible for her to introduce him, for she will not know him herself."

"Then, my dear, you may have the advantage of your friend, and introduce Mr. Bingley to her."

"Impossible, Mr. Bennet, impossible, when I am not acquainted with him myself; how can you be so teasing?"

"I honour your circumspection. A fortnight's acquaintance is certainly very little. One cannot know what a man
really is by the end of a fortnight. But if we do not venture somebody else will; and after all, Mrs. Long and
her nieces must stand their chance; and, therefore, as she will think it an act of kindness, if you decline
the office, I will take it on myself."

The girls stared at their father. Mrs. Bennet said only, "Nonsense, nonsense!"

"What can be the meaning of that emphatic exclamation?" cried he. "Do you consider the forms of introduction,
and the stress that is laid on them, as nonsense? I cannot quite agree with you there. What say you, Mary? For
you are a young lady of deep reflection, I know, and read great books and make extracts."

Mary wished to say something sensible, but knew not how.

"While Mary is adjusting her ideas," he continued, "let us return to Mr. Bingley."

"I am sick of Mr. Bingley," cried his wife.

"I am sorry to hear that; but why did not you tell me that before? If I had known as much this morning I
certainly would not have called on him. It is very unlucky; but as I have actually paid the visit, we cannot
escape the acquaintance now."

The astonishment of the ladies was just what he wished; that of Mrs. Bennet perhaps surpassing the rest;
though, when the first tumult of joy was over, she began to declare that it was what she had expected all the
while.

"How good it was in you, my dear Mr. Bennet! But I knew I should persuade you at last. I was sure you loved
your girls too well to neglect such an acquaintance. Well, how pleased I am! and it is such a good joke, too,
that you should have gone this morning and never said a word about it till now."

"Now, Kitty, you may cough as much as you choose," said Mr. Bennet; and, as he spoke, he left the room,
fatigued with the raptures of his wife.

"What an excellent father you have, girls!" said she, when the door was shut. "I do not know how you will ever
make him amends for his kindness; or me, either, for that matter. At our time of life it is not so pleasant, I
can tell you, to be making new acquaintances every day; but for your sakes, we would do anything. Lydia, my
love, though you are the youngest, I dare say Mr. Bingley will dance with you at the next ball."

"Oh!" said Lydia stoutly, "I am not afraid; for though I am the youngest, I'm the tallest."

The rest of the evening was spent in conjecturing how soon he would return Mr. Bennet's visit, and determining
when they should ask him to dinner.
"""
# One line a paragraph, paragraphs apart by a blank line.
TEXT = "\n\n".join(" ".join(p.split("\n")) for p in _WRAPPED.strip().split("\n\n")) + "\n"
CHAPTER_1, CHAPTER_2 = TEXT.split("\nChapter 2\n\n")

# --- the prompt set (pure) -------------------------------------------------------------------

SHORT = (
    "What is the capital of Australia?",
    "Write a haiku about autumn leaves.",
    "Explain what a hash table is in two sentences.",
    "Give me three tips for sleeping better.",
    "Translate 'Where is the train station?' into French and Spanish.",
    "What is 17 multiplied by 23? Show your working.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Why is the sky blue?",
    "Suggest a name for a small bakery that specialises in sourdough bread.",
    "What are the main differences between a cat and a dog as pets?",
    "Summarise the plot of Romeo and Juliet in three sentences.",
    "How do I convert a temperature from Celsius to Fahrenheit?",
    "List five vegetables that grow well in a shady garden.",
    "What does the HTTP status code 404 mean?",
    "Write a short, polite email declining a meeting invitation.",
    "What causes the seasons on Earth?",
)

CODE = '''\
def average_word_length(text):
    words = text.split(" ")
    total = 0
    for word in words:
        total += len(word.strip(".,!?"))
    return total / len(words)


print(average_word_length("The quick brown fox jumps over the lazy dog."))
print(average_word_length(""))'''

REVIEW = (
    "I bought the TrailLite 2 tent for a week of hiking in the hills. Setting it up the first time took "
    "me almost forty minutes because the instructions are printed in tiny letters and two of the poles "
    "look identical but are not. Once it was up, though, it stood firm through two nights of strong wind "
    "and one of heavy rain, and I stayed completely dry. It packs small and weighs just under two kilos. "
    "The zips feel a bit cheap, and the inner door already has a small tear after one week. For the price "
    "I would probably buy it again, but I would not recommend it for winter.")

RECORDS = """\
[{"name": "Alice Moreau", "age": 34, "city": "Lyon", "role": "engineer"},
 {"name": "Bernd Schulz", "age": 51, "city": "Hamburg", "role": "accountant"},
 {"name": "Chiara Rossi", "age": 27, "city": "Turin", "role": "designer"},
 {"name": "Dmitri Volkov", "age": 45, "city": "Riga", "role": "teacher"},
 {"name": "Elena Garcia", "age": 39, "city": "Valencia", "role": "doctor"}]"""

MEDIUM: tuple[tuple[str, tuple[dict[str, str], ...]], ...] = (
    ("code", ({"role": "user", "content": f"What does this function do, and is there a bug in it?\n\n"
                                          f"```python\n{CODE}\n```"},)),
    ("review", ({"role": "user", "content": f"Is this product review positive or negative overall? Explain "
                                            f"briefly.\n\n{REVIEW}"},)),
    ("json", ({"role": "user", "content": f"Turn these records into a markdown table with the columns name and "
                                          f"age, sorted by age.\n\n{RECORDS}"},)),
    ("chat", ({"role": "user", "content": "I want to start a small vegetable garden on my balcony."},
              {"role": "assistant", "content": "That is a great idea! How much sun does your balcony get, and "
                                               "how much space do you have?"},
              {"role": "user", "content": "About four hours of sun in the morning, and roughly two square metres."},
              {"role": "assistant", "content": "Four hours of morning sun suits leafy vegetables and herbs well: "
                                               "lettuce, spinach, chard, parsley and mint. Tomatoes would need more "
                                               "sun. Do you want to grow from seed or buy young plants?"},
              {"role": "user", "content": "From seed. What should I sow first, and when?"})),
    ("concise", ({"role": "system", "content": "You are a helpful assistant. Answer in one short paragraph, in "
                                               "plain words, for a curious twelve-year-old."},
                 {"role": "user", "content": "How does the water cycle work, and why does it matter for the "
                                             "weather?"})),
)

SYSTEMS: tuple[tuple[str, str, tuple[str, ...], str], ...] = (
    ("coding-agent",
     "You are Forge, a coding agent working inside the user's repository through the tools below.\n\n"
     "Read a file before you edit it, and never invent its contents. When a change touches several files, list "
     "them first and say why each one must change. Keep every edit as small as the task allows and do not reformat "
     "code you did not otherwise change.\n\n"
     "The tools are read_file(path), write_file(path, text), search(pattern, path) and run(command). The run tool "
     "executes in a sandbox without network access; commands that run longer than ten minutes are stopped. Prefer "
     "search over reading whole directories, and read only the parts of large files that matter.\n\n"
     "After a change, run the tests of the modules you touched, not the whole suite. If a test fails, read its "
     "output carefully before changing anything else; report a failure you cannot fix instead of hiding it, and "
     "never delete or skip a test to make the run pass.\n\n"
     "Commit messages have a short first line in the imperative mood, a blank line, and a body that says what "
     "changed and why. Do not push, rebase or force anything unless the user asks for it explicitly.\n\n"
     "Answer in the language of the user's last message. Be concise: short paragraphs, no filler, and lists only "
     "when the content is a list. Format code in fenced blocks with the language named. If you are not sure about "
     "a fact, say so instead of guessing, and suggest how the user could check it. Do not make up names, numbers, "
     "links or quotations.\n\n"
     "Keep track of what the user told you earlier in the conversation and do not ask for it again. If the user "
     "corrects you, accept the correction and continue from it without long apologies.",
     ("Can you find where the retry delay is computed?",
      "It is computed in client/retry.py, in the function backoff(), which doubles the delay on every attempt and "
      "caps it at thirty seconds."),
     "Change it so that the delay has some random jitter. Which files will you touch?"),
    ("support",
     "You are the customer support assistant of Northwind Outdoor, an online shop for camping gear.\n\n"
     "Greet the customer once, then answer the question directly. Orders ship within two business days; delivery "
     "takes three to five days inside the country and up to twelve days abroad. Tracking numbers are sent by email "
     "as soon as the parcel leaves the warehouse.\n\n"
     "Customers may return unused items within thirty days for a full refund. Tents and sleeping bags that were "
     "used may be returned within fourteen days if they are clean and complete. Refunds reach the original payment "
     "method within five business days after the return arrives.\n\n"
     "Never ask for a full card number or a password. To look up an order you need the order number, which starts "
     "with NW and has eight digits, and the email address used for the purchase.\n\n"
     "If the customer is upset, acknowledge the problem in one sentence and move on to a concrete next step. Offer "
     "a call with a human agent when the problem involves a damaged item, a missing parcel after fifteen days, or a "
     "payment charged twice.\n\n"
     "Refuse requests that could cause harm to people, and say briefly why. Your answers are shown in a small chat "
     "window on a phone, so prefer answers under two hundred words, and offer to go into more detail instead of "
     "writing everything at once. Avoid emoji unless the customer uses them first.",
     (),
     "My tent arrived with a broken pole and I leave for a trip on Friday. What can I do?"),
    ("travel",
     "You are Wayfarer, a travel planning assistant that helps people plan trips by train and bus.\n\n"
     "Plan with public transport first. Give departure and arrival times in the local time of each city, name the "
     "station, and mention when a seat reservation is required. Never promise a price: fares change, so give a "
     "typical range and say where to book.\n\n"
     "When the traveller gives a budget, keep the whole plan inside it and show the main costs in a short list: "
     "transport, accommodation, food. Suggest one cheaper alternative when the plan uses most of the budget.\n\n"
     "Ask at most one clarifying question, and only when the answer changes the plan: the travel dates, the number "
     "of travellers, or whether they can climb stairs with luggage.\n\n"
     "For trips longer than three days, propose a day-by-day outline with one main activity per day and a rest "
     "afternoon every third day. Keep transfers under four hours whenever a reasonable route exists.\n\n"
     "Use tables only for comparisons of three or more items with the same attributes. For questions about visas, "
     "health or insurance give general information and point to the official source. Keep track of what the "
     "traveller told you earlier in the conversation and do not ask for it again.",
     ("I want to visit Lisbon in spring.",
      "Spring is a lovely time for Lisbon. How many days do you have, and will you travel alone?"),
     "Five days, with my partner, and we would like to see Porto as well. Can you plan it?"),
)

PASSAGE_QUESTIONS: tuple[tuple[str, str, str], ...] = (
    # (id, which text, question)
    ("opening", "opening", "Who is the man who has taken Netherfield Park, according to this passage?"),
    ("chapter1", "chapter1", "What does Mrs. Bennet want her husband to do, and how does he answer her?"),
    ("chapter2", "chapter2", "How does Mr. Bennet reveal that he has visited Mr. Bingley?"),
    ("whole", "whole", "Summarise this passage in a few sentences."),
)


@dataclass(frozen=True)
class Prompt:
    """One chat prompt of the fixed set."""

    id: str
    kind: str  # short, medium, system (a long system prompt), passage (a question about TEXT)
    messages: tuple[dict[str, str], ...]


def passage(which: str) -> str:
    """The part of TEXT a passage question is about (pure)."""
    if which == "opening":
        return "\n\n".join(CHAPTER_1.split("\n\n")[:12])  # up to "Bingley." (~300 tokens)
    return {"chapter1": CHAPTER_1, "chapter2": CHAPTER_2, "whole": TEXT}[which].strip()


def prompt_set(n: int | None = None) -> list[Prompt]:
    """The fixed prompt set, or its first `n` (pure). The order mixes the
    kinds, cheap ones first: the first four (--quick) are three short
    questions and a medium one."""
    short = [Prompt(f"s{i:02d}", "short", ({"role": "user", "content": q},)) for i, q in enumerate(SHORT)]
    medium = [Prompt(f"m-{name}", "medium", messages) for name, messages in MEDIUM]
    system = [Prompt(f"l-{name}", "system", (
        {"role": "system", "content": text},
        *({"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(history)),
        {"role": "user", "content": question})) for name, text, history, question in SYSTEMS]
    passages = [Prompt(f"p-{name}", "passage", (
        {"role": "user", "content": f"Read this passage and answer the question after it.\n\n{passage(which)}\n\n"
                                    f"Question: {question}"},)) for name, which, question in PASSAGE_QUESTIONS]
    ordered = short[:3] + medium[:1]
    rest_short, rest_medium, long = short[3:], medium[1:], system + passages
    # Then: a long one, three short ones, a medium one, in turn while they last.
    while rest_short or rest_medium or long:
        for pool, k in ((long, 1), (rest_short, 3), (rest_medium, 1)):
            ordered += pool[:k]
            del pool[:k]
    return ordered if n is None else ordered[:n]


def length_class(tokens: int) -> str:
    """The prompt-length class of a prompt of `tokens` tokens (pure)."""
    name = LENGTH_CLASSES[0][1]
    for low, label in LENGTH_CLASSES:
        if tokens >= low:
            name = label
    return name


def parse_bits(text: str) -> list[int]:
    """The compared settings of --bits, e.g. "8,4" (pure): KV bits each; 16
    among them is the control (the reference again). Unsupported or repeated
    values raise ValueError."""
    bits = [int(x) for x in text.split(",") if x.strip()]
    if not bits:
        raise ValueError("no KV bits given")
    bad = [b for b in bits if b not in SUPPORTED_BITS]
    if bad:
        raise ValueError(f"unsupported KV bits {bad}: {', '.join(map(str, SUPPORTED_BITS))}")
    if len(set(bits)) != len(bits):
        raise ValueError(f"KV bits repeated: {text}")
    return bits


def arm_label(bits: int, kv_dtype: str, reference: bool = False) -> str:
    """A setting's name in the tables (pure)."""
    if bits == REFERENCE:
        return f"16 (unquantised, {kv_dtype})" + (": reference" if reference else ": control, again")
    return f"{bits}-bit"


# --- agreement counting and the summaries (pure) ------------------------------------------

def _weighted(rows: Sequence[dict[str, Any]], key: str, weight: str) -> float | None:
    """The mean of rows' `key` weighted by their `weight` (pure): per-prompt
    means over N steps pooled into the mean over all the steps."""
    total = sum(r[weight] for r in rows if r.get(key) is not None)
    if not total:
        return None
    return sum(r[key] * r[weight] for r in rows if r.get(key) is not None) / total


def summarize(rows: Sequence[dict[str, Any]], arms: Sequence[int]) -> list[dict[str, Any]]:
    """One line per compared setting (in `arms`' order; settings without
    rows left out) from the per-prompt rows (pure)."""
    out = []
    for bits in arms:
        mine = [r for r in rows if r["bits"] == bits]
        if not mine:
            continue
        agreeing = [r["first_difference"] for r in mine]
        decode_s = sum(r["decode_seconds"] for r in mine)
        out.append({
            "bits": bits,
            "prompts": len(mine),
            "tokens": mean_of(r["tokens"] for r in mine),  # the reference's answers: N or fewer (EOS)
            "mean_agreeing_tokens": mean_of(agreeing),
            "median_agreeing_tokens": float(statistics.median(agreeing)),
            "identical": sum(1 for r in mine if r["first_difference"] == r["tokens"]),
            "first_top1": mean_of(float(r["first_top1"]) for r in mine),
            "first_kl": mean_of(r["first_kl"] for r in mine),
            "forced_top1": _weighted(mine, "forced_top1", "tokens"),  # over all the answers' steps
            "forced_kl": _weighted(mine, "forced_kl", "tokens"),
            "decode_tok_s": sum(r["generated"] for r in mine) / decode_s if decode_s > 0 else None,
        })
    return out


def ppl_summary(stats: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Perplexity lines from per-setting sums (pure): each stat has bits,
    role ("reference" or "arm"), scored (positions), nll (their summed
    negative log-likelihood, nats), top1 and kl (sums over the positions,
    against the reference; None for it), seconds, kv_bytes_per_token. The
    delta is against the reference's perplexity, in %."""
    ref = next((s for s in stats if s["role"] == "reference"), None)
    ref_ppl = math.exp(ref["nll"] / ref["scored"]) if ref and ref["scored"] else None
    out = []
    for s in stats:
        ppl = math.exp(s["nll"] / s["scored"]) if s["scored"] else None
        is_ref = s["role"] == "reference"
        out.append({
            "bits": s["bits"], "role": s["role"], "scored": s["scored"], "ppl": ppl,
            "delta_pct": None if is_ref or ppl is None or not ref_ppl else 100 * (ppl / ref_ppl - 1),
            "top1": None if is_ref or s.get("top1") is None or not s["scored"] else s["top1"] / s["scored"],
            "kl": None if is_ref or s.get("kl") is None or not s["scored"] else max(0.0, s["kl"] / s["scored"]),
            "tok_s": s["scored"] / s["seconds"] if s.get("seconds") else None,
            "kv_bytes_per_token": s.get("kv_bytes_per_token"),
        })
    return out


def _pct(x: float | None, digits: int = 0) -> str:
    return "—" if x is None else f"{100 * x:.{digits}f} %"


def _num(x: float | None, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def greedy_table(summary: Sequence[dict[str, Any]], kv_dtype: str) -> str:
    """The greedy summary as a markdown table (pure)."""
    head = ("| KV bits | prompts | tokens agreeing before the first difference: mean / median (answer length, mean) "
            "| answers identical | first token: top-1 agreement | first token: mean KL (nats) "
            "| teacher-forced: top-1 agreement | teacher-forced: mean KL(16 ‖ b) (nats) | decode tok/s |")
    lines = [head, "|" + "---|" * (head.count(" | ") + 1)]
    for s in summary:
        agreeing = (f"{_num(s['mean_agreeing_tokens'], '.1f')} / {_num(s['median_agreeing_tokens'], '.0f')} "
                    f"({_num(s['tokens'], '.1f')})")
        lines.append(f"| {arm_label(s['bits'], kv_dtype)} | {s['prompts']} | {agreeing} "
                     f"| {s['identical']}/{s['prompts']} | {_pct(s['first_top1'])} | {_num(s['first_kl'], '.2g')} "
                     f"| {_pct(s['forced_top1'], 1)} | {_num(s['forced_kl'], '.2g')} "
                     f"| {_num(s['decode_tok_s'], '.1f')} |")
    return "\n".join(lines)


def ppl_table(lines_: Sequence[dict[str, Any]], kv_dtype: str) -> str:
    """The perplexity lines as a markdown table (pure)."""
    head = ("| KV bits | positions scored | perplexity | Δ vs 16 | top-1 agreement with 16 "
            "| mean KL(16 ‖ b) (nats) | KV bytes per token | tok/s through the cache |")
    lines = [head, "|" + "---|" * (head.count(" | ") + 1)]
    for s in lines_:
        delta = "—" if s["delta_pct"] is None else f"{s['delta_pct']:+.2f} %"
        kv = "—" if s["kv_bytes_per_token"] is None else f"{s['kv_bytes_per_token']:,.0f}"
        lines.append(f"| {arm_label(s['bits'], kv_dtype, s['role'] == 'reference')} | {s['scored']} "
                     f"| {_num(s['ppl'], '.3f')} | {delta} | {_pct(s['top1'], 1)} | {_num(s['kl'], '.2g')} "
                     f"| {kv} | {_num(s['tok_s'], '.0f')} |")
    return "\n".join(lines)


def chunks(n: int, size: int) -> list[tuple[int, int]]:
    """[start, end) of `n` positions cut into chunks of `size` (pure)."""
    return [(s, min(s + size, n)) for s in range(0, n, size)]


# --- the model (MLX) -------------------------------------------------------------------------

def make_cache(model: Any, bits: int, group_size: int) -> list[Any]:
    """A fresh cache for every layer: plain KVCache at 16 bits (the model's
    dtype), else QuantizedKVCache(group_size, bits), quantised from the first
    token."""
    from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

    if bits == REFERENCE:
        return make_prompt_cache(model)
    return [QuantizedKVCache(group_size=group_size, bits=bits) for _ in model.layers]


def kv_bytes_per_token(cache: list[Any]) -> float:
    """The cache's bytes per position held (its buffers over their length)."""
    total, length = 0, 0
    for c in cache:
        keys = c.keys[0] if isinstance(c.keys, (tuple, list)) else c.keys
        total += c.nbytes
        length = keys.shape[-2]
    return total / length if length else 0.0


class Runner:
    """One model; each setting's cache built and used as the engine uses one."""

    def __init__(self, model: Any, tokenizer: Any, n_tokens: int, step: int, group_size: int) -> None:
        from mlx_lm.sample_utils import make_sampler

        self.model, self.tokenizer, self.n, self.step, self.group_size = model, tokenizer, n_tokens, step, group_size
        self.sampler = make_sampler(temp=0.0)  # what the engine's sampling makes of temperature 0: argmax

    def prefill(self, kv: list[Any], tokens: list[int]) -> None:
        """`tokens` through the model into `kv`, in fixed steps (as
        generate_step prefills; the engine's steps are sized by pace)."""
        import mlx.core as mx

        ids = mx.array(tokens, dtype=mx.int32)
        for s, e in chunks(len(tokens), self.step):
            self.model(ids[s:e][None], cache=kv)
            mx.eval([c.state for c in kv])
        mx.clear_cache()

    def answer(self, bits: int, prompt: list[int], reference: list[int] | None) -> dict[str, Any]:
        """Prefill `prompt[:-1]` into a fresh cache of `bits`, decode greedily
        (generate_step) from the last prompt token: N tokens, to EOS, or, with
        a `reference`, to the first token that differs from it. Then the
        teacher-forced pass: the cache cut back to the prompt, the reference's
        tokens (or, for the reference, its own) fed after the prompt's last
        token in one forward pass."""
        import mlx.core as mx
        from mlx_lm.generate import generate_step
        from mlx_lm.models.cache import trim_prompt_cache

        t0 = time.perf_counter()
        kv = make_cache(self.model, bits, self.group_size)
        self.prefill(kv, prompt[:-1])
        t1 = time.perf_counter()
        tokens: list[int] = []
        first = None
        steps = generate_step(mx.array(prompt[-1:]), self.model, prompt_cache=kv, max_tokens=self.n,
                              sampler=self.sampler, prefill_step_size=self.step)
        for token, logprobs in steps:
            if first is None:
                first = logprobs.astype(mx.float32)
                mx.eval(first)
            tokens.append(int(token))
            if reference is None and tokens[-1] in self.tokenizer.eos_token_ids:
                break  # the engine's answer ends here (stream_generate stops at EOS)
            if reference is not None and (len(tokens) == len(reference) or tokens[-1] != reference[len(tokens) - 1]):
                break
        steps.close()
        t2 = time.perf_counter()
        fed = reference if reference is not None else tokens
        mx.eval([c.state for c in kv])
        trim_prompt_cache(kv, kv[0].offset - (len(prompt) - 1))
        logits = self.model(mx.array([prompt[-1:] + fed[:-1]]), cache=kv)[0].astype(mx.float32)
        forced = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        mx.eval(forced)
        del kv
        mx.clear_cache()
        return {"tokens": tokens, "first": first, "forced": forced, "prefill_seconds": t1 - t0,
                "decode_seconds": t2 - t1, "seconds": time.perf_counter() - t0}


def measure(runner: Runner, prompt: Prompt, tokens: list[int], arms: Sequence[int]) -> list[dict[str, Any]]:
    """Every compared setting on one prompt: rows for the JSON."""
    ref = runner.answer(REFERENCE, tokens, None)
    n = len(ref["tokens"])  # N, or fewer where the reference's answer ended (EOS)
    text = runner.tokenizer.decode
    base = {"prompt": prompt.id, "kind": prompt.kind, "prompt_tokens": len(tokens),
            "length_class": length_class(len(tokens)), "tokens": n, "reference_text": text(ref["tokens"]),
            "reference_seconds": round(ref["seconds"], 2),
            "reference_decode_tok_s": round(len(ref["tokens"]) / ref["decode_seconds"], 2)}
    rows = []
    for bits in arms:
        got = runner.answer(bits, tokens, ref["tokens"])
        fd = first_difference(ref["tokens"], got["tokens"], n)
        rows.append({**base, "bits": bits, "first_difference": fd, "identical": fd == n,
                     "generated": len(got["tokens"]), "generated_text": text(got["tokens"]),
                     **compare_distributions(ref["first"], ref["forced"], got["first"], got["forced"]),
                     "prefill_seconds": round(got["prefill_seconds"], 3),
                     "decode_seconds": round(got["decode_seconds"], 3), "seconds": round(got["seconds"], 2)})
    return rows


def perplexity(model: Any, ids: list[int], arms: Sequence[int], chunk: int,
               group_size: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Teacher-forced over `ids` in chunks of `chunk` positions, each
    setting through its own cache (the reference first, then `arms`, chunk
    by chunk): per setting the summed NLL of the next token at every
    position, and against the reference top-1 agreement and KL summed.
    (stats for ppl_summary, per-chunk rows)."""
    import mlx.core as mx

    settings = [(REFERENCE, "reference")] + [(b, "arm") for b in arms]
    caches = [make_cache(model, b, group_size) for b, _ in settings]
    stats = [{"bits": b, "role": role, "scored": 0, "nll": 0.0, "top1": None if role == "reference" else 0.0,
              "kl": None if role == "reference" else 0.0, "seconds": 0.0} for b, role in settings]
    inputs, targets = ids[:-1], mx.array(ids[1:])
    by_chunk = []
    for s, e in chunks(len(inputs), chunk):
        x = mx.array(inputs[s:e])[None]
        y = targets[s:e]
        ref_lp = None
        row: dict[str, Any] = {"start": s, "end": e}
        for (bits, role), kv, st in zip(settings, caches, stats):
            t = time.perf_counter()
            logits = model(x, cache=kv)[0].astype(mx.float32)
            lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            nll = -mx.sum(mx.take_along_axis(lp, y[:, None], axis=-1))
            mx.eval(lp, nll, [c.state for c in kv])
            st["seconds"] += time.perf_counter() - t
            st["scored"] += e - s
            st["nll"] += float(nll.item())
            key = f"{bits}" if role == "arm" else "reference"
            row[f"nll_{key}"] = float(nll.item()) / (e - s)
            if role == "reference":
                ref_lp = lp
            else:
                st["top1"] += float(mx.sum(mx.argmax(lp, axis=-1) == mx.argmax(ref_lp, axis=-1)).item())
                st["kl"] += float(mx.sum(log_kl(ref_lp, lp)).item())
        by_chunk.append(row)
    for st, kv in zip(stats, caches):
        st["kv_bytes_per_token"] = kv_bytes_per_token(kv)
    del caches
    mx.clear_cache()
    return stats, by_chunk


# --- the run -----------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from mlxd import default_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bits", default=",".join(map(str, DEFAULT_BITS)),
                    help="the KV bits compared with 16, the reference (default 8,4); 16 among them: the control")
    ap.add_argument("--group-size", type=int, default=64,
                    help="QuantizedKVCache's group size (default 64: SmolLM2's head_dim; 32 or 64 divide it)")
    ap.add_argument("--prompts", type=int, default=None, help="the first N of the 28 prompts (default all; --quick 4)")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per answer (default 64; --quick 16)")
    ap.add_argument("--text-tokens", type=int, default=None,
                    help="score only the passage's first N tokens (default all, 2,243; --quick 512)")
    ap.add_argument("--chunk", type=int, default=256, help="the passage's chunk through the cache (default 256)")
    ap.add_argument("--prefill-step", type=int, default=512, help="the prompts' prefill step (default 512)")
    ap.add_argument("--weights", choices=WEIGHTS, default="float32",
                    help="float32: the Q4_1 weights dequantized (fast with OpenBLAS); q4_1: as they are")
    ap.add_argument("--gguf", type=Path, default=default_model.gguf_path(), help="the model's GGUF")
    ap.add_argument("--no-greedy", dest="greedy", action="store_false", help="perplexity only")
    ap.add_argument("--no-ppl", dest="ppl", action="store_false", help="greedy agreement only")
    ap.add_argument("--quick", action="store_true", help="4 prompts, 16 tokens, 512 tokens of text")
    ap.add_argument("--out-dir", type=Path, default=RESULTS / "kv_quality")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts = min(args.prompts or 4, 4)
        args.tokens = min(args.tokens, 16)
        args.text_tokens = min(args.text_tokens or 512, 512)
    try:
        args.bits = parse_bits(args.bits)
    except ValueError as exc:
        ap.error(str(exc))
    if args.tokens < 1 or args.chunk < 1 or args.prefill_step < 1:
        ap.error("--tokens, --chunk and --prefill-step must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    opened = open_real_model(args.gguf, args.weights)
    if opened is None:
        return 1
    model, tokenizer, model_info = opened
    if model_info["head_dim"] % args.group_size:
        say(f"--group-size {args.group_size} does not divide the model's head_dim ({model_info['head_dim']})")
        return 2
    kv_dtype = model_info["kv_dtype"]

    from mlxd.engine.model.prompt_tokens import template_tokens

    rows: list[dict[str, Any]] = []
    prompts = prompt_set(args.prompts) if args.greedy else []
    encoded = [template_tokens(tokenizer, list(p.messages)) for p in prompts]  # the engine's own tokenization
    if prompts:
        say(f"{len(prompts)} prompts, {min(map(len, encoded))}-{max(map(len, encoded))} tokens "
            f"({sum(map(len, encoded))} in all); KV bits 16 (reference) vs {', '.join(map(str, args.bits))}, "
            f"group size {args.group_size}; {args.tokens} greedy tokens at most")
    runner = Runner(model, tokenizer, args.tokens, args.prefill_step, args.group_size)
    for i, (prompt, tokens) in enumerate(zip(prompts, encoded), 1):
        t = time.monotonic()
        mine = measure(runner, prompt, tokens, args.bits)
        rows += mine
        say(f"[{i}/{len(prompts)}] {prompt.id}: {len(tokens)} tokens; agreeing tokens "
            + ", ".join(f"{r['bits']}-bit {r['first_difference']}" for r in mine)
            + f" /{mine[0]['tokens']} ({time.monotonic() - t:.0f} s, {time.monotonic() - started:.0f} s so far)")

    ppl_lines: list[dict[str, Any]] = []
    by_chunk: list[dict[str, Any]] = []
    text_ids: list[int] = []
    if args.ppl:
        text_ids = list(tokenizer.encode(TEXT))
        if args.text_tokens:
            text_ids = text_ids[:args.text_tokens]
        say(f"perplexity: {len(text_ids)} tokens of Pride and Prejudice, chunks of {args.chunk}")
        t = time.monotonic()
        stats, by_chunk = perplexity(model, text_ids, args.bits, args.chunk, args.group_size)
        ppl_lines = ppl_summary(stats)
        say("   " + ", ".join(f"{s['bits']}: {s['ppl']:.3f}" for s in ppl_lines)
            + f" ({time.monotonic() - t:.0f} s)")

    summary = summarize(rows, args.bits)
    by_length = {label: summarize([r for r in rows if r["length_class"] == label], args.bits)
                 for _, label in LENGTH_CLASSES}
    seconds = round(time.monotonic() - started, 1)
    notes = [f"model: SmolLM2-135M-Instruct, {model_info['description']}; {model_info['blas']}",
             f"KV: 16 = unquantised ({kv_dtype}, the model's dtype); b-bit = mlx-lm's QuantizedKVCache(group_size="
             f"{args.group_size}, bits=b) in every layer from the first token "
             f"({model_info['layers']} layers x {model_info['kv_heads']} KV heads x head_dim {model_info['head_dim']})",
             f"greedy: {len(prompts)} chat prompts ({', '.join(sorted({p.kind for p in prompts}))}), "
             + (f"{min(map(len, encoded))}-{max(map(len, encoded))} prompt tokens; " if prompts else "")
             + f"N = {args.tokens} greedy tokens at most: the reference stops at EOS, as the engine's answer does, "
             f"and a quantised arm at its first difference from the reference; teacher-forced top-1 and KL over "
             f"all the reference answers' steps (KL(16 || b), nats); decode tok/s includes the first step",
             f"perplexity: {len(text_ids)} tokens of Pride and Prejudice (ch. 1-2), {args.chunk}-token chunks "
             f"through each setting's cache; tok/s: those chunks' speed through it",
             f"{seconds:.0f} s in all"]
    sections = ["# Quantised KV cache: agreement with the unquantised cache", ""]
    if rows:
        sections += ["Greedy answers, all prompts:", "", greedy_table(summary, kv_dtype), ""]
        for label, part in by_length.items():
            if part:
                sections += [f"Prompts of {label}:", "", greedy_table(part, kv_dtype), ""]
    if ppl_lines:
        sections += ["Perplexity on a fixed passage:", "", ppl_table(ppl_lines, kv_dtype), ""]
    md = "\n".join(sections + [f"- {n}" for n in notes] + [""])
    print(md)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "kv_quality.md").write_text(md)
    write_json(args.out_dir / "kv_quality.json", {
        "benchmark": "kv_quality", "machine": machine_info(), "model": model_info,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "prompt_set": [{"id": p.id, "kind": p.kind, "tokens": len(t), "messages": list(p.messages)}
                       for p, t in zip(prompts, encoded)],
        "summary": summary, "summary_by_length": by_length,
        "perplexity": {"tokens": len(text_ids), "chunk": args.chunk, "lines": ppl_lines, "by_chunk": by_chunk},
        "rows": rows, "seconds": seconds})
    say(f"wrote {args.out_dir / 'kv_quality.md'} and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
