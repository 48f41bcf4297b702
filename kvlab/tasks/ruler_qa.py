"""RULER's qa_1 and qa_2: a question answered from its evidence documents (SQuAD, HotpotQA) among distractors,
as RULER's data/synthetic/qa.py builds them."""

from __future__ import annotations

import random
from typing import Any

from kvlab.tasks.haystack import qa_data
from kvlab.tasks.ruler_base import RulerTask, question_of
from kvlab.tasks.sizing import Budget, ContextTooShortError

# template: RULER, Apache-2.0 (data/synthetic/constants.py)
QA_TEMPLATE = (
    "Answer the question based on the given documents. Only give me the answer and do not output any other "
    "words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given "
    "documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}"
)
QA_ANSWER_PREFIX = " Answer:"
DOCUMENT = "Document {i}:\n{document}"


class QuestionAnswering(RulerTask):
    """qa_1 (SQuAD) and qa_2 (HotpotQA): a question over its evidence documents hidden among distractor
    documents; any one of the references counts as a correct answer."""

    max_new_tokens = 32
    question = question_of(QA_TEMPLATE)
    metric = "string_match_part"

    def __init__(self, name: str, dataset: str) -> None:
        super().__init__(name)
        self.dataset = dataset

    def generate(self, budget: Budget, rng: random.Random, index: int) -> tuple[list[int], list[str], dict[str, Any]]:
        questions, docs = qa_data(self.dataset)
        choice = index % len(questions)
        for _ in range(100):
            try:
                ids, info = self.prompt(budget, rng, questions[choice], docs)
                return ids, list(questions[choice]["answers"]), {"question_index": choice, **info}
            except ContextTooShortError:
                choice = rng.randrange(len(questions))
        raise ContextTooShortError("no question's evidence fits in 100 tries")

    def prompt(
        self, budget: Budget, rng: random.Random, question: dict[str, Any], docs: list[str]
    ) -> tuple[list[int], dict[str, Any]]:
        gold = question["gold"]
        fill_order = gold + rng.sample(question["more"], len(question["more"]))
        taken, words = set(fill_order), sum(len(docs[d].split(" ")) for d in fill_order)
        while words <= budget.tokens and len(taken) < len(docs):  # a word takes at least a token: enough to overfill
            d = rng.randrange(len(docs))
            if d not in taken:
                fill_order.append(d)
                taken.add(d)
                words += len(docs[d].split(" "))
        place = {d: rng.random() for d in fill_order}  # document order, as RULER shuffles them
        split = [docs[d].split(" ") for d in fill_order]

        def documents(n: int) -> list[tuple[int, str]]:
            """The first n words in fill order (whole documents but the last), in prompt order."""
            chosen = []
            for d, doc_words in zip(fill_order, split, strict=True):
                if n <= 0:
                    break
                chosen.append((d, " ".join(doc_words[:n])))
                n -= len(doc_words)
            return sorted(chosen, key=lambda c: place[c[0]])

        def text(n: int) -> str:
            context = "\n\n".join(DOCUMENT.format(i=i + 1, document=doc) for i, (_, doc) in enumerate(documents(n)))
            return QA_TEMPLATE.format(context=context, query=question["query"])

        n, ids = budget.fill(text, QA_ANSWER_PREFIX, sum(map(len, split)), lo=sum(map(len, split[: len(gold)])))
        shown = [d for d, _ in documents(n)]
        return ids, {
            "question": question["query"],
            "documents": len(shown),
            "gold_documents": [shown.index(d) + 1 for d in gold],
        }
